"""Shipped data recipes (TOML), read by `fibctl.data.recipe.load_recipe`."""
