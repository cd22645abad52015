"""Prefect tasks: thin wrappers (caching, retries, artifacts, MLflow runs) over pipeline_lib stages."""
