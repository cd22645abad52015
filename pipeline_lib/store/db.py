"""The DuckDB store: schema, versioning and every SQL statement of the project (parameterized)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import polars as pl

from pipeline_lib.errors import AlignflowError

SCHEMA_VERSION = 1

# Column lists are the schema of DESIGN.md; `*_id` columns are content hashes (idempotent ingest).
TABLES: dict[str, dict[str, str]] = {
    "preference_pairs": {
        "pair_id": "VARCHAR PRIMARY KEY",
        "source": "VARCHAR NOT NULL",
        "prompt": "VARCHAR NOT NULL",
        "chosen": "VARCHAR NOT NULL",
        "rejected": "VARCHAR NOT NULL",
        "prompt_messages": "JSON",  # raw conversation (prompt, chosen, rejected) for chat templates
        "meta": "JSON",
        "ingested_at": "TIMESTAMP DEFAULT current_timestamp",
    },
    "rankings": {
        "ranking_id": "VARCHAR PRIMARY KEY",
        "source": "VARCHAR NOT NULL",
        "prompt": "VARCHAR NOT NULL",
        "responses": "VARCHAR[] NOT NULL",  # ordered best -> worst after ingest
        "ranks": "INTEGER[] NOT NULL",  # the ranks as given (1 = best)
        "meta": "JSON",
        "ingested_at": "TIMESTAMP DEFAULT current_timestamp",
    },
    "problems": {
        "problem_id": "VARCHAR PRIMARY KEY",
        "source": "VARCHAR NOT NULL",
        "split": "VARCHAR NOT NULL",
        "prompt": "VARCHAR NOT NULL",
        "answer": "VARCHAR NOT NULL",
        "meta": "JSON",
        "ingested_at": "TIMESTAMP DEFAULT current_timestamp",
    },
    "quarantine": {
        "source": "VARCHAR",
        "file": "VARCHAR",
        "line_no": "BIGINT",
        "raw": "VARCHAR",
        "reason": "VARCHAR NOT NULL",
        "ingested_at": "TIMESTAMP DEFAULT current_timestamp",
    },
    "samples": {
        "run_id": "VARCHAR NOT NULL",
        "prompt_id": "VARCHAR NOT NULL",
        "sample_idx": "INTEGER NOT NULL",
        "prompt": "VARCHAR",
        "completion": "VARCHAR NOT NULL",
        "n_tokens": "INTEGER",
        "finish_reason": "VARCHAR",
        "reward": "DOUBLE",
        "is_correct": "BOOLEAN",
        "policy": "VARCHAR",
        "created_at": "TIMESTAMP DEFAULT current_timestamp",
    },
    "eval_results": {
        "run_id": "VARCHAR NOT NULL",
        "model": "VARCHAR NOT NULL",
        "dataset": "VARCHAR NOT NULL",
        "k": "INTEGER NOT NULL",
        "pass_at_k": "DOUBLE",
        "maj_at_k": "DOUBLE",
        "n_samples": "INTEGER",
        "created_at": "TIMESTAMP DEFAULT current_timestamp",
    },
}
TABLE_KEYS = {
    "preference_pairs": ["pair_id"],
    "rankings": ["ranking_id"],
    "problems": ["problem_id"],
    "samples": ["run_id", "prompt_id", "sample_idx"],
    "eval_results": ["run_id", "model", "dataset", "k"],
}


class StoreError(AlignflowError):
    """A one-line, user-facing store error (locked file, newer schema, unknown table)."""


def _check_table(table: str) -> str:
    if table not in TABLES:
        raise StoreError(f"unknown table {table!r}; expected one of {sorted(TABLES)}")
    return table


class Store:
    """An open DuckDB connection on the workspace's store file, schema ensured."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self.con = con

    def ensure_schema(self) -> None:
        self.con.execute("CREATE TABLE IF NOT EXISTS schema_info (version INTEGER NOT NULL)")
        row = self.con.execute("SELECT max(version) FROM schema_info").fetchone()
        if row[0] is not None and row[0] > SCHEMA_VERSION:
            raise StoreError(f"store schema v{row[0]} is newer than this alignflow (v{SCHEMA_VERSION})")
        for table, columns in TABLES.items():
            cols = ", ".join(f"{name} {kind}" for name, kind in columns.items())
            self.con.execute(f"CREATE TABLE IF NOT EXISTS {table} ({cols})")
        if row[0] is None:
            self.con.execute("INSERT INTO schema_info VALUES (?)", [SCHEMA_VERSION])

    def schema_version(self) -> int:
        return self.con.execute("SELECT max(version) FROM schema_info").fetchone()[0]

    # ---- writes

    def insert_new(self, table: str, frame: pl.DataFrame) -> int:
        """Insert the rows of `frame` whose key is not in `table` yet; returns how many were inserted.

        `frame` must already be unique on the key (ingest deduplicates within a file)."""
        _check_table(table)
        if frame.height == 0:
            return 0
        cols = ", ".join(frame.columns)
        key = TABLE_KEYS[table]
        on = " AND ".join(f"t.{k} = f.{k}" for k in key)
        before = self.count(table)
        self.con.register("incoming_frame", frame.to_arrow())
        try:
            self.con.execute(
                f"INSERT INTO {table} ({cols}) SELECT {cols} FROM incoming_frame f "
                f"WHERE NOT EXISTS (SELECT 1 FROM {table} t WHERE {on})"
            )
        finally:
            self.con.unregister("incoming_frame")
        return self.count(table) - before

    def append(self, table: str, frame: pl.DataFrame) -> int:
        """Append rows as they are (the quarantine has no key)."""
        _check_table(table)
        if frame.height == 0:
            return 0
        cols = ", ".join(frame.columns)
        self.con.register("incoming_frame", frame.to_arrow())
        try:
            self.con.execute(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM incoming_frame")
        finally:
            self.con.unregister("incoming_frame")
        return frame.height

    def delete_eval_run(self, run_id: str) -> None:
        self.con.execute("DELETE FROM eval_results WHERE run_id = ?", [run_id])

    # ---- reads

    def count(self, table: str) -> int:
        return self.con.execute(f"SELECT count(*) FROM {_check_table(table)}").fetchone()[0]

    def read(self, table: str, **equals: object) -> pl.DataFrame:
        """All rows of `table`, optionally filtered by column equality (`split="test"`)."""
        _check_table(table)
        for column in equals:
            if column not in TABLES[table]:
                raise StoreError(f"table {table} has no column {column!r}")
        where = " AND ".join(f"{column} = ?" for column in equals)
        sql = f"SELECT * EXCLUDE (ingested_at) FROM {table}" if "ingested_at" in TABLES[table] else f"SELECT * FROM {table}"
        if where:
            sql += f" WHERE {where}"
        return self.con.execute(sql, list(equals.values())).pl()

    def sampled_prompt_ids(self, run_id: str) -> set[str]:
        """Prompt ids that already have samples in `run_id` (resumable sampling)."""
        rows = self.con.execute("SELECT DISTINCT prompt_id FROM samples WHERE run_id = ?", [run_id]).fetchall()
        return {r[0] for r in rows}

    def stats(self) -> pl.DataFrame:
        """Row counts per table and source (`alignflow data stats`)."""
        parts = []
        for table in ("preference_pairs", "rankings", "problems", "quarantine"):
            parts.append(f"SELECT '{table}' AS table_name, source, count(*) AS n_rows FROM {table} GROUP BY source")
        for table, label in (("samples", "policy"), ("eval_results", "model")):
            parts.append(f"SELECT '{table}' AS table_name, {label} AS source, count(*) AS n_rows FROM {table} GROUP BY {label}")
        return self.con.execute(" UNION ALL ".join(parts) + " ORDER BY table_name, source").pl()


@contextmanager
def open_store(path: str | Path, *, read_only: bool = False) -> Iterator[Store]:
    """Open (creating if needed) the store at `path`; one-line StoreError if another process holds it."""
    path = Path(path)
    if read_only and not path.exists():
        raise StoreError(f"no store at {path}; run `alignflow ingest` first")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        con = duckdb.connect(str(path), read_only=read_only)
    except duckdb.IOException as exc:
        first = str(exc).splitlines()[0]
        raise StoreError(f"store {path} is in use by another alignflow process ({first})") from None
    try:
        store = Store(con)
        if not read_only:
            store.ensure_schema()
        yield store
    finally:
        con.close()
