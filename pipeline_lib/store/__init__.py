"""The DuckDB store: schema and queries (db.py, the only module that runs SQL) and ingest (ingest.py)."""
