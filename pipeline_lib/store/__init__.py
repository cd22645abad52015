"""The DuckDB store: schema and queries (db.py, the only module that runs SQL), ingest (ingest.py) and its parquet
reader, run in a child process (parquet.py)."""
