"""Training stages: shared loop helpers (common.py) and one explicit loop per stage."""
