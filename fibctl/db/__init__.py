"""The results database: schema (public API), engine, migrations, and writers."""
