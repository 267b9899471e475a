"""Run matrices shipped with fibctl (TOML data files; see fibctl.matrix)."""
