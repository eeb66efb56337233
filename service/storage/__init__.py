"""The database: tables, sessions, migrations, and the store (every read and guarded write)."""
