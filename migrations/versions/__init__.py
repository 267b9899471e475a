"""One module per schema revision, oldest first: 0001_core_tables, 0002_..."""
