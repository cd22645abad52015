"""The DuckDB store: schema, versioning and every SQL statement of the project (parameterized)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
import json
import shlex
import time
from pathlib import Path

import duckdb
import polars as pl

from pipeline_lib.errors import AlignflowError

SCHEMA_VERSION = 4
# DuckDB lets one process write a file or several read it: a store another process holds (`alignflow data stats`,
# a notebook's read-only connection, the task of a running pipeline) is waited for this long before giving up
LOCK_WAIT_SECONDS = 15.0

# Column lists are the store's schema; `*_id` columns are content hashes (idempotent ingest).
# Keys are kept unique by insert_new's anti-join, not by a PRIMARY KEY: its index made inserting
# a million pairs about twice as slow (benchmarks/ingest.py).
TABLES: dict[str, dict[str, str]] = {
    "preference_pairs": {
        "pair_id": "VARCHAR NOT NULL",
        "source": "VARCHAR NOT NULL",
        "prompt": "VARCHAR NOT NULL",
        "chosen": "VARCHAR NOT NULL",
        "rejected": "VARCHAR NOT NULL",
        "prompt_messages": "JSON",  # raw conversation (prompt, chosen, rejected) for chat templates
        "meta": "JSON",
        "ingested_at": "TIMESTAMP DEFAULT current_timestamp",
    },
    "rankings": {
        "ranking_id": "VARCHAR NOT NULL",
        "source": "VARCHAR NOT NULL",
        "prompt": "VARCHAR NOT NULL",
        "responses": "VARCHAR[] NOT NULL",  # ordered best -> worst after ingest
        "ranks": "INTEGER[] NOT NULL",  # the ranks as given (1 = best)
        "meta": "JSON",
        "ingested_at": "TIMESTAMP DEFAULT current_timestamp",
    },
    "problems": {
        "problem_id": "VARCHAR NOT NULL",
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
        "line_no": "BIGINT",  # 1-based: the record's line in a text file, its row in a parquet file (`position`)
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
        "chat_template": "BOOLEAN",  # the prompts went through the chat template (v2; NULL in older runs)
    },
    "sample_runs": {  # created in any store that lacks it: the table is new, no column of another one changed
        "run_id": "VARCHAR NOT NULL",
        "settings": "JSON NOT NULL",  # what decides a run's samples beyond n and policy (`sampling.stage`)
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
# the tables an ingest writes, each row under its file's `source`
SOURCE_TABLES = ("preference_pairs", "rankings", "problems", "quarantine")
CORPUS_TABLES = ("preference_pairs", "problems", "rankings")  # the texts a tokenizer trains on (`corpus_texts`)

# a problem's worked solution (GSM8K's, MATH's), kept in its meta: SFT trains on it
SOLUTION_SQL = "json_extract_string(meta, '$.solution')"
TABLE_KEYS = {
    "preference_pairs": ["pair_id"],
    "rankings": ["ranking_id"],
    "problems": ["problem_id"],
    "samples": ["run_id", "prompt_id", "sample_idx"],
    "sample_runs": ["run_id"],
    "eval_results": ["run_id", "model", "dataset", "k"],
    # a row per line and reason of the latest ingest of a file (`replace_quarantine` replaces them per file)
    "quarantine": ["source", "file", "line_no", "raw", "reason"],
}


# What a store of schema v(k-1) runs to become v(k): columns added at the end, as in TABLES, so both agree.
MIGRATIONS: dict[int, list[str]] = {
    2: ["ALTER TABLE samples ADD COLUMN IF NOT EXISTS chat_template BOOLEAN"],
    # quarantine.line_no of a parquet row was its 0-based index, now its 1-based row number (a JSON array's 0-based
    # record index, now the line the record starts on, cannot be recomputed without the file: it stays)
    3: ["UPDATE quarantine SET line_no = line_no + 1 WHERE lower(file) LIKE '%.parquet'"],
    # a conversation's pair_id hashed its rendered prompt text, which two conversations could share: it is now the
    # sha256 of its messages JSON (store.shapes.pair_id), so re-ingesting a chat file finds the rows it stored
    4: ["UPDATE preference_pairs SET pair_id = sha256(CAST(prompt_messages AS VARCHAR)) "
        "WHERE prompt_messages IS NOT NULL"],
}


def position(file: str, line_no: int | None) -> str:
    """Where a quarantined row of `file` came from: its quarantine `line_no` is 1-based, the row number in a parquet
    file (`row 3`) and the physical line a record starts on in a text file (`line 3`). Stores before schema v3 held
    a JSON array's 0-based record index (their parquet rows were moved to 1-based by the migration)."""
    return "" if line_no is None else f"{'row' if file.lower().endswith('.parquet') else 'line'} {line_no}"


class StoreError(AlignflowError):
    """A one-line, user-facing store error (locked file, newer schema, unknown table)."""


def _arrow(frame: pl.DataFrame) -> object:
    # polars' own string views: zero-copy (the default conversion copies every string)
    return frame.to_arrow(compat_level=pl.CompatLevel.newest())


def _check_table(table: str) -> str:
    if table not in TABLES:
        raise StoreError(f"unknown table {table!r}; expected one of {sorted(TABLES)}")
    return table


def _key_match(table: str) -> str:
    """SQL matching a row `t` of `table` to a row `f` on the table's key, NULL-safe (the quarantine key has
    nullable columns)."""
    return " AND ".join(f"t.{k} IS NOT DISTINCT FROM f.{k}" for k in TABLE_KEYS[table])


def _where(table: str, equals: dict[str, object]) -> tuple[str, list]:
    """The WHERE condition (TRUE when empty) and parameters of column equality filters; None matches NULL."""
    _check_table(table)
    for column in equals:
        if column not in TABLES[table]:
            raise StoreError(f"table {table} has no column {column!r}")
    condition = " AND ".join(f"{column} IS NOT DISTINCT FROM ?" for column in equals) or "TRUE"
    return condition, list(equals.values())


def _refuse_second_answers(problems: pl.DataFrame) -> None:
    """One line when a source holds two gold answers for a prompt (an alignflow before 2026-12-07 stored them):
    evaluation would score every sample against both, and the filters would pair a sample with the wrong one."""
    repeated = problems.group_by("source", "prompt").len().filter(pl.col("len") > 1).sort("source", "prompt")
    if repeated.height:
        source, prompt, count = repeated.row(0)
        raise StoreError(f"source {source!r} holds {count} gold answers for the prompt {prompt[:60]!r} ("
                         f"{repeated.height} prompts hold more than one, stored by an older alignflow): ingest its "
                         f"file again with `alignflow ingest FILE --source {shlex.quote(source)} --replace`")


class Store:
    """An open DuckDB connection on the workspace's store file, schema ensured."""

    def __init__(self, con: duckdb.DuckDBPyConnection, path: Path, *, read_only: bool = False):
        self.con, self.path, self.read_only = con, path, read_only

    @contextmanager
    def released(self) -> Iterator[None]:
        """Close the connection for the block and open it again after, waiting as `open_store` does: DuckDB lets one
        process hold the file, so `alignflow data stats` can read the store while a stage samples in the block."""
        self.con.close()
        try:
            yield
        finally:
            self.con = _connect(self.path, read_only=self.read_only, wait=LOCK_WAIT_SECONDS)

    def _run(self, sql: str, params: list | None = None) -> list[tuple]:
        # duckdb 2.x refuses further work on a connection (register, ...) while a result is
        # unread, so every statement's result is drained here.
        return self.con.execute(sql, params or []).fetchall()

    def check_version(self) -> int | None:
        """The store's schema version (None for a new file); a newer one than this code's is a one-line error."""
        try:
            version = self._run("SELECT max(version) FROM schema_info")[0][0]
        except duckdb.CatalogException:
            raise StoreError("not an alignflow store: it has no schema_info table") from None
        if version is not None and version > SCHEMA_VERSION:
            raise StoreError(f"store schema v{version} is newer than this alignflow (v{SCHEMA_VERSION})")
        return version

    def ensure_schema(self) -> None:
        self._run("CREATE TABLE IF NOT EXISTS schema_info (version INTEGER NOT NULL)")
        version = self.check_version()
        for table, columns in TABLES.items():
            cols = ", ".join(f"{name} {kind}" for name, kind in columns.items())
            self._run(f"CREATE TABLE IF NOT EXISTS {table} ({cols})")
        if version is None:
            self._run("INSERT INTO schema_info VALUES (?)", [SCHEMA_VERSION])
        elif version < SCHEMA_VERSION:
            with self.transaction():  # all steps or none: a failed migration leaves the old version intact
                for step in range(version + 1, SCHEMA_VERSION + 1):
                    for sql in MIGRATIONS[step]:
                        self._run(sql)
                self._run("INSERT INTO schema_info VALUES (?)", [SCHEMA_VERSION])

    @contextmanager
    def transaction(self) -> Iterator[Store]:
        """Commit the writes of the block together, or none of them if it raises."""
        self._run("BEGIN TRANSACTION")
        try:
            yield self
        except BaseException:
            self._run("ROLLBACK")
            raise
        self._run("COMMIT")

    # ---- writes

    def insert_new(self, table: str, frame: pl.DataFrame) -> int:
        """Insert the rows of `frame` whose key is not in `table` yet; returns how many were inserted.

        `frame` must already be unique on the key (ingest deduplicates within a file)."""
        cols = self._columns(table, frame)
        if frame.height == 0:
            return 0
        with self._registered(frame) as name:
            return self._run(
                f"INSERT INTO {table} ({cols}) SELECT {cols} FROM {name} f "
                f"WHERE NOT EXISTS (SELECT 1 FROM {table} t WHERE {_key_match(table)})"
            )[0][0]

    def count_missing(self, table: str, frame: pl.DataFrame) -> int:
        """How many rows of `frame` have a key that `table` does not hold (what `insert_new` would insert)."""
        if frame.height == 0:
            return 0
        with self._registered(frame.select(TABLE_KEYS[table])) as name:
            return self._run(f"SELECT count(*) FROM {name} f "
                             f"WHERE NOT EXISTS (SELECT 1 FROM {table} t WHERE {_key_match(table)})")[0][0]

    def delete_source(self, source: str) -> dict[str, int]:
        """Delete the rows of `source` from the ingested tables and the quarantine; rows deleted per table."""
        return {table: self._run(f"DELETE FROM {table} WHERE source = ?", [source])[0][0] for table in SOURCE_TABLES}

    def count_others(self, table: str, source: str, frame: pl.DataFrame) -> int:
        """How many rows of `table` under `source` have a key `frame` does not hold (for problems, among the splits
        `frame` holds: a source's train and test files are two files of one source)."""
        problems = table == "problems"
        with self._registered(frame.select(TABLE_KEYS[table] + (["split"] if problems else []))) as name:
            splits = f" AND t.split IN (SELECT split FROM {name})" if problems else ""
            return self._run(f"SELECT count(*) FROM {table} t WHERE t.source = ?{splits} "
                             f"AND NOT EXISTS (SELECT 1 FROM {name} f WHERE {_key_match(table)})", [source])[0][0]

    def replace_quarantine(self, source: str, file: str, frame: pl.DataFrame) -> None:
        """The quarantine rows of `file` under `source` become `frame`'s: an ingest's verdicts replace those of the
        file's earlier ingests (a record since fixed, or accepted under a larger max_record_bytes, leaves the
        quarantine; rows an older schema numbered otherwise are not kept beside the new ones)."""
        self._run("DELETE FROM quarantine WHERE source = ? AND file = ?", [source, file])
        self.insert_new("quarantine", frame)

    def has_source(self, source: str) -> bool:
        """Whether an ingest stored rows (or quarantined some) under `source`."""
        return any(self.count(table, source=source) for table in SOURCE_TABLES)

    def append(self, table: str, frame: pl.DataFrame) -> int:
        """Append rows as they are, without a key check."""
        cols = self._columns(table, frame)
        if frame.height == 0:
            return 0
        with self._registered(frame) as name:
            return self._run(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM {name}")[0][0]

    def _columns(self, table: str, frame: pl.DataFrame) -> str:
        unknown = [c for c in frame.columns if c not in TABLES[_check_table(table)]]
        if unknown:
            raise StoreError(f"table {table} has no column(s) {unknown}")
        return ", ".join(frame.columns)

    @contextmanager
    def _registered(self, frame: pl.DataFrame) -> Iterator[str]:
        self.con.register("incoming_frame", _arrow(frame))
        try:
            yield "incoming_frame"
        finally:
            # in a transaction a failed INSERT aborted, duckdb refuses even this; its error matters more
            with suppress(duckdb.TransactionException):
                self.con.unregister("incoming_frame")

    def record_chat_template(self, run_id: str, chat_template: bool) -> int:
        """Set samples.chat_template on the rows of `run_id` that have none (sampled before schema v2); returns
        how many rows were updated."""
        return self._run("UPDATE samples SET chat_template = ? WHERE run_id = ? AND chat_template IS NULL",
                         [chat_template, run_id])[0][0]

    def delete_eval_results(self, run_id: str, model: str) -> None:
        """The results of `model` on sampling run `run_id` (one model dir evaluated under two names shares
        its samples, not its results)."""
        self._run("DELETE FROM eval_results WHERE run_id = ? AND model = ?", [run_id, model])

    # ---- reads

    def count(self, table: str, **equals: object) -> int:
        """Rows of `table`, optionally filtered by column equality as in `read`."""
        where, params = _where(table, equals)
        return self._run(f"SELECT count(*) FROM {table} WHERE {where}", params)[0][0]

    def read(self, table: str, **equals: object) -> pl.DataFrame:
        """All rows of `table`, optionally filtered by column equality (`split="test"`), in key order: the same
        rows read the same whatever the order they were inserted in (a source deleted and ingested again, files
        ingested in another order), so a stage's data order and fingerprint follow its rows alone."""
        where, params = _where(table, equals)
        columns = "* EXCLUDE (ingested_at)" if "ingested_at" in TABLES[table] else "*"
        order = ", ".join(TABLE_KEYS[table])
        return self.con.sql(f"SELECT {columns} FROM {table} WHERE {where} ORDER BY {order}", params=params).pl()

    def run_samples(self, run_id: str) -> pl.DataFrame:
        """The samples of sampling run `run_id` whose problem the store still holds. A problem deleted since, or
        re-ingested with a corrected answer (a new problem_id), leaves its samples in the run, scored against what
        it was: the filters, RS-SFT and the filters' input fingerprint leave them out (evaluation scores the
        samples of the problems its config selects)."""
        return self.con.sql("SELECT * FROM samples WHERE run_id = ? AND prompt_id IN (SELECT problem_id FROM problems) "
                            "ORDER BY prompt_id, sample_idx", params=[run_id]).pl()  # in key order: fingerprinted

    def read_selected(self, table: str, **equals: object) -> pl.DataFrame:
        """`read` with the filters whose value is not None, refused when no row matches: one line naming the
        selection and what the table holds, counted by the same columns (a mistyped source or split shows at once)."""
        where = {column: value for column, value in equals.items() if value is not None}
        frame = self.read(table, **where)  # checks the table and column names
        if not frame.height:
            self._refuse_empty_selection(table, where)
        if table == "problems":
            _refuse_second_answers(frame)
        return frame

    def check_selected(self, table: str, **equals: object) -> None:
        """`read_selected`'s refusal of a selection no row matches, without reading the rows."""
        where = {column: value for column, value in equals.items() if value is not None}
        if not self.count(table, **where):
            self._refuse_empty_selection(table, where)

    def _refuse_empty_selection(self, table: str, where: dict[str, object]) -> None:
        groups = self._run(f"SELECT {', '.join(where)}, count(*) FROM {table} GROUP BY ALL ORDER BY ALL") \
            if where else []
        if not groups:
            raise StoreError(f"no {table} rows in the store; ingest some first")
        held = "; ".join(", ".join(f"{c}={v!r}" for c, v in zip(where, group)) + f": {group[-1]} rows"
                         for group in groups[:10])
        more = f"; and {len(groups) - 10} more" if len(groups) > 10 else ""
        shown = ", ".join(f"{column}={value!r}" for column, value in where.items())
        raise StoreError(f"no {table} rows in the store with {shown}; it holds {held}{more}")

    def stored_elsewhere(self, table: str, frame: pl.DataFrame, columns: list[str]) -> list[tuple]:
        """Rows of `frame` whose key `table` already holds with other values in `columns` (another source or
        split): (the stored values of `columns`..., how many), most first."""
        self._columns(table, frame)
        on = " AND ".join(f"t.{k} = f.{k}" for k in TABLE_KEYS[table])
        differs = " OR ".join(f"t.{c} IS DISTINCT FROM f.{c}" for c in columns)
        stored = ", ".join(f"t.{c}" for c in columns)
        with self._registered(frame) as name:
            return self._run(f"SELECT {stored}, count(*) AS n FROM {table} t JOIN {name} f ON {on} WHERE {differs} "
                             f"GROUP BY ALL ORDER BY n DESC, {stored}")

    def stored_problems(self, source: str, frame: pl.DataFrame) -> dict[str, set[tuple[str, str | None]]]:
        """prompt -> the (answer, worked solution or None) of each problem `source` already holds with a prompt of
        `frame` (one per prompt, as ingest refuses a second; a store an older alignflow wrote may hold more)."""
        held: dict[str, set[tuple[str, str | None]]] = {}
        with self._registered(frame.select("prompt").unique()) as name:
            rows = self._run(f"SELECT p.prompt, p.answer, {SOLUTION_SQL} FROM problems p JOIN {name} f "
                             "ON p.prompt = f.prompt WHERE p.source = ?", [source])
        for prompt, answer, solution in rows:
            held.setdefault(prompt, set()).add((answer, solution))
        return held

    def sampling_runs(self) -> list[tuple[str, str, int]]:
        """(run_id, policy, rows) of each sampling run of the samples table, newest first."""
        return self._run("SELECT run_id, any_value(policy), count(*) FROM samples GROUP BY run_id "
                         "ORDER BY max(created_at) DESC, run_id")

    def run_settings(self, run_id: str) -> dict | None:
        """The sampling settings a run was first sampled with (`sample_runs`); None for a new run, or one sampled
        before the store recorded them."""
        rows = self._run("SELECT settings FROM sample_runs WHERE run_id = ?", [run_id])
        return json.loads(rows[0][0]) if rows else None

    def record_run_settings(self, run_id: str, settings: dict) -> None:
        """`settings` become the run's (`run_settings`)."""
        with self.transaction():
            self._run("DELETE FROM sample_runs WHERE run_id = ?", [run_id])
            self._run("INSERT INTO sample_runs (run_id, settings) VALUES (?, ?)", [run_id, json.dumps(settings)])

    def sampled_prompt_ids(self, run_id: str) -> set[str]:
        """Prompt ids that already have samples in `run_id` (resumable sampling)."""
        rows = self._run("SELECT DISTINCT prompt_id FROM samples WHERE run_id = ?", [run_id])
        return {r[0] for r in rows}

    def samples_per_prompt(self, run_id: str) -> set[int]:
        """The distinct numbers of samples the prompts of `run_id` hold (one number in a consistent run)."""
        rows = self._run("SELECT DISTINCT count(*) FROM samples WHERE run_id = ? GROUP BY prompt_id", [run_id])
        return {r[0] for r in rows}

    def corpus_texts(self, sources: list[str] | None = None) -> list[str]:
        """Every prompt/response text of the store (optionally of some sources), the problems' worked solutions
        (which SFT trains on) included: a tokenizer's training corpus."""
        parts = [
            "SELECT source, prompt AS text FROM preference_pairs UNION ALL SELECT source, chosen FROM preference_pairs",
            "SELECT source, rejected FROM preference_pairs",
            "SELECT source, prompt FROM problems UNION ALL SELECT source, answer FROM problems",
            f"SELECT source, {SOLUTION_SQL} FROM problems WHERE {SOLUTION_SQL} IS NOT NULL",
            "SELECT source, prompt FROM rankings UNION ALL SELECT source, unnest(responses) FROM rankings",
        ]
        sql = f"SELECT text FROM ({' UNION ALL '.join(parts)})"
        if sources is None:
            return [row[0] for row in self._run(sql)]
        return [row[0] for row in self._run(sql + " WHERE list_contains(?, source)", [sources])]

    def corpus_sources(self) -> list[str]:
        """The sources of the tables `corpus_texts` reads, sorted."""
        sql = " UNION ".join(f"SELECT source FROM {table}" for table in CORPUS_TABLES)
        return [row[0] for row in self._run(f"SELECT source FROM ({sql}) ORDER BY source")]

    def check_corpus_sources(self, sources: Sequence[str]) -> None:
        """One line naming the `sources` that hold no texts (`corpus_texts`), and the sources the store holds: a
        mistyped one was read as an empty corpus (alone: an error whose advice led nowhere; beside another: left
        out in silence)."""
        held = self.corpus_sources()
        missing = [source for source in sources if source not in held]
        if missing:
            raise StoreError(f"corpus_sources: no texts in the store under {', '.join(map(repr, missing))}; it holds "
                             f"{', '.join(map(repr, held)) or 'no source (ingest some first)'}")

    def fingerprint(self, table: str, **equals: object) -> str:
        """md5 over the sorted content ids of the selected rows, with a problem's worked solution (SFT trains on it,
        a tokenizer's corpus holds it; its id is prompt and answer only): changes iff the selected data changes."""
        where, params = _where(table, equals)
        key = ", ".join(TABLE_KEYS[table])
        content = f"{key}, md5(coalesce({SOLUTION_SQL}, ''))" if table == "problems" else key
        row = self._run(
            f"SELECT count(*), md5(coalesce(string_agg(concat_ws('|', {content}), ',' ORDER BY {key}), '')) "
            f"FROM {table} WHERE {where}", params)[0]
        return f"{table}:{row[0]}:{row[1]}"

    def quarantine_reasons(self, source: str | None = None) -> pl.DataFrame:
        """Quarantined rows (of one source, or all) per file and reason: n_rows and where the first is (`line 3`,
        `row 3`: see `position`), most frequent first (`alignflow data quarantine`)."""
        where, params = _where("quarantine", {} if source is None else {"source": source})
        # what a reason says of its own row alone is left out here, and stays in the row's quarantine reason: an
        # oversized record's size (`record is 5,123 bytes as JSON > max_record_bytes 1,000`), a raw text cut to
        # RAW_LIMIT (` (raw truncated to 10 KB)`), which record of a one-line JSON array it is (` (record 3 of the
        # file, on line 1)`)
        reason = ("regexp_replace(regexp_replace(regexp_replace(reason, "
                  "'^record is [0-9,]+ bytes as JSON > max_record_bytes ', "
                  "'record as JSON is over max_record_bytes '), "
                  "' \\(raw truncated to [0-9]+ KB\\)', ''), "
                  "' \\(record [0-9]+ of the file, on line [0-9]+\\)$', '')")
        frame = self.con.sql(
            f"SELECT source, file, {reason} AS reason, count(*) AS n_rows, min(line_no) AS first_line FROM quarantine "
            f"WHERE {where} GROUP BY source, file, {reason} ORDER BY n_rows DESC, source, file, first_line",
            params=params).pl()
        # a store before v3 (a reader does not migrate it) held a parquet row's 0-based index (MIGRATIONS[3])
        zero_based = (self.check_version() or SCHEMA_VERSION) < 3
        first = [position(file, None if line_no is None else
                          line_no + (zero_based and file.lower().endswith(".parquet")))
                 for file, line_no in frame.select("file", "first_line").iter_rows()]
        return frame.drop("first_line").with_columns(pl.Series("first", first, dtype=pl.String))

    def stats(self) -> pl.DataFrame:
        """Row counts per table and source of the ingested tables (what `data delete --source` deletes), and per
        model of samples (their policy) and eval_results (`alignflow data stats`)."""
        parts = []
        for table in SOURCE_TABLES:
            parts.append(f"SELECT '{table}' AS table_name, source, NULL AS model, count(*) AS n_rows FROM {table} "
                         "GROUP BY source")
        for table, label in (("samples", "policy"), ("eval_results", "model")):
            parts.append(f"SELECT '{table}' AS table_name, NULL AS source, {label} AS model, count(*) AS n_rows "
                         f"FROM {table} GROUP BY {label}")
        return self.con.sql(" UNION ALL ".join(parts) + " ORDER BY table_name, source, model").pl()


def require_store(path: str | Path, ingest: str = "alignflow ingest") -> None:
    """StoreError unless a store file is at `path` (a command that reads the store, or deletes from it, on a
    workspace that was never used), advising the `ingest` command line (the workspace's, where it is known)."""
    if not Path(path).is_file():
        raise StoreError(f"no store at {path}; run `{ingest}` first")


@contextmanager
def open_store(path: str | Path, *, read_only: bool = False, wait: float = LOCK_WAIT_SECONDS) -> Iterator[Store]:
    """Open (creating if needed) the store at `path`; one-line StoreError if another process still holds it after
    `wait` seconds."""
    path = Path(path)
    if read_only:
        require_store(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    store = Store(_connect(path, read_only=read_only, wait=wait), path, read_only=read_only)
    try:
        if read_only:
            store.check_version()  # readers refuse a newer store too, not only writers
        else:
            store.ensure_schema()
        yield store
    finally:
        store.con.close()


def _connect(path: Path, *, read_only: bool, wait: float) -> duckdb.DuckDBPyConnection:
    """A connection to the store file, retried while another process holds it, up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return duckdb.connect(str(path), read_only=read_only)
        except duckdb.IOException as exc:
            first = str(exc).splitlines()[0]
            if "lock" not in first:  # e.g. a file that is not a DuckDB database
                raise StoreError(f"store {path} cannot be opened ({first})") from None
            if time.monotonic() >= deadline:
                raise StoreError(f"store {path} is in use by another alignflow process ({first})") from None
            time.sleep(0.2)
