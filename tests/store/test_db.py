"""The DuckDB store: schema and version, keyed inserts, transactions, reads, stats, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import duckdb
import polars as pl
import pytest

from pipeline_lib.fingerprint import content_id
from pipeline_lib.store.db import SCHEMA_VERSION, TABLES, StoreError, open_store
from pipeline_lib.store.ingest import ingest_file


def pairs_frame(ids: list[str], source: str = "s") -> pl.DataFrame:
    return pl.DataFrame({"pair_id": ids, "source": [source] * len(ids), "prompt": ids,
                         "chosen": ["c"] * len(ids), "rejected": ["r"] * len(ids)})


def test_schema_created_once_with_version(tmp_path):
    path = tmp_path / "store.duckdb"
    with open_store(path) as store:
        assert store.check_version() == SCHEMA_VERSION
    with open_store(path) as store:  # reopening neither re-creates nor re-stamps
        assert store._run("SELECT count(*) FROM schema_info")[0][0] == 1
        for table, columns in TABLES.items():
            got = [row[0] for row in store._run(f"DESCRIBE {table}")]
            assert got == list(columns), table


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "store.duckdb"
    with open_store(path) as store:
        store._run("INSERT INTO schema_info VALUES (?)", [SCHEMA_VERSION + 1])
    for read_only in (False, True):  # a reader must not misread a newer layout either
        with pytest.raises(StoreError, match=f"schema v{SCHEMA_VERSION + 1} is newer"):
            with open_store(path, read_only=read_only):
                pass


def test_a_v1_store_is_migrated_in_place_and_keeps_its_rows(tmp_path):
    """v2 added samples.chat_template; a v1 file (as v1 created it) gains the column, its rows read NULL. v3 counts a
    parquet file's quarantined rows from 1 as the text files' lines are (they held the 0-based row index)."""
    path = tmp_path / "store.duckdb"
    v1_samples = {name: kind for name, kind in TABLES["samples"].items() if name != "chat_template"}
    with duckdb.connect(str(path)) as con:
        con.execute("CREATE TABLE schema_info (version INTEGER NOT NULL)")
        con.execute("INSERT INTO schema_info VALUES (1)")
        for table, columns in (TABLES | {"samples": v1_samples}).items():
            con.execute(f"CREATE TABLE {table} ({', '.join(f'{n} {k}' for n, k in columns.items())})")
        con.execute("INSERT INTO samples (run_id, prompt_id, sample_idx, completion) VALUES ('r', 'p', 0, 'c')")
        con.execute("INSERT INTO quarantine (source, file, line_no, reason) VALUES ('d', '/x/d.PARQUET', 0, 'r'), "
                    "('t', '/x/t.jsonl', 4, 'r'), ('p', '/x/p.parquet', 2, 'r')")
    with open_store(path, read_only=True) as store:  # a reader neither migrates nor fails
        assert store.check_version() == 1 and "chat_template" not in store.read("samples").columns
        # nor shows a parquet file's 0-based row index as its row (a helper: `row 2` for the third row)
        assert dict(store.quarantine_reasons().select("source", "first").rows()) == {
            "d": "row 1", "p": "row 3", "t": "line 4"}
    with open_store(path) as store:
        assert store.check_version() == SCHEMA_VERSION == 4
        assert [row[0] for row in store._run("DESCRIBE samples")] == list(TABLES["samples"])
        assert store.read("samples").select("completion", "chat_template").rows() == [("c", None)]
        assert sorted(store.read("quarantine").select("source", "line_no").rows()) == [("d", 1), ("p", 3), ("t", 4)]
    with open_store(path) as store:  # migrated once
        assert store._run("SELECT version FROM schema_info ORDER BY version") == [(1,), (4,)]
        assert sorted(store.read("quarantine").select("source", "line_no").rows()) == [("d", 1), ("p", 3), ("t", 4)]


def test_a_v3_store_keys_its_conversations_on_their_messages(tmp_path):
    """v4 keys a chat pair on its messages JSON, not its rendered prompt (shapes.pair_id): a v3 store's chat pairs
    get the ids ingest now gives, so ingesting the same file again adds no copies; plain pairs keep theirs."""
    conversation = {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
                    "rejected": [{"role": "assistant", "content": "5"}]}
    data = tmp_path / "data"
    data.mkdir()
    (data / "chat.jsonl").write_text(json.dumps(conversation) + "\n")
    (data / "plain.jsonl").write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    path = tmp_path / "store.duckdb"
    with open_store(path) as store:
        for name in ("chat", "plain"):
            ingest_file(data / f"{name}.jsonl", store)
        new_ids = dict(store.read("preference_pairs").select("source", "pair_id").rows())
        store._run("UPDATE preference_pairs SET pair_id = ? WHERE source = 'chat'", [content_id("user: 2+2?", "4", "5")])
        store._run("DELETE FROM schema_info")
        store._run("INSERT INTO schema_info VALUES (3)")  # as v3 stored it
    with open_store(path) as store:
        assert store.check_version() == 4
        assert dict(store.read("preference_pairs").select("source", "pair_id").rows()) == new_ids
        assert new_ids["plain"] == content_id("2+2?", "4", "5")
        assert [ingest_file(data / f"{name}.jsonl", store).duplicates for name in ("chat", "plain")] == [1, 1]
        assert store.count("preference_pairs") == 2


def test_insert_new_skips_known_keys(tmp_path):
    with open_store(tmp_path / "s.duckdb") as store:
        assert store.insert_new("preference_pairs", pairs_frame(["a", "b"])) == 2
        assert store.insert_new("preference_pairs", pairs_frame(["b", "c", "d"])) == 2  # b is known
        assert store.insert_new("preference_pairs", pairs_frame([])) == 0
        assert sorted(store.read("preference_pairs")["pair_id"]) == ["a", "b", "c", "d"]
        assert store.append("preference_pairs", pairs_frame(["a"])) == 1  # no key check
        assert store.count("preference_pairs") == 5


def test_quarantine_key_is_null_safe(tmp_path):
    rows = pl.DataFrame({"source": ["s", "s"], "file": ["f", "f"], "line_no": [3, None],
                         "raw": ["{", None], "reason": ["malformed JSON", "x"]})
    with open_store(tmp_path / "s.duckdb") as store:
        assert store.insert_new("quarantine", rows) == 2
        assert store.insert_new("quarantine", rows) == 0  # NULL line_no / raw still match
        assert store.count("quarantine") == 2


def test_lists_round_trip(tmp_path):
    frame = pl.DataFrame({"ranking_id": ["r1"], "source": ["s"], "prompt": ["p"],
                          "responses": [["best", "worst"]], "ranks": [[1, 2]]})
    with open_store(tmp_path / "s.duckdb") as store:
        store.insert_new("rankings", frame)
        row = store.read("rankings").row(0, named=True)
    assert (row["responses"], row["ranks"]) == (["best", "worst"], [1, 2])


def test_transaction_rolls_back_every_write(tmp_path):
    with open_store(tmp_path / "s.duckdb") as store:
        with pytest.raises(duckdb.ConstraintException, match="NOT NULL"):  # duckdb's own error surfaces
            with store.transaction():
                store.insert_new("preference_pairs", pairs_frame(["a"]))
                store.insert_new("preference_pairs", pairs_frame(["b"]).with_columns(source=pl.lit(None, pl.String)))
        assert store.count("preference_pairs") == 0
        with store.transaction():
            store.insert_new("preference_pairs", pairs_frame(["a"]))
        assert store.count("preference_pairs") == 1


def test_read_filters_and_unknown_names(tmp_path):
    problems = pl.DataFrame({"problem_id": ["1", "2", "3"], "source": ["g", "g", "h"],
                             "split": ["train", "test", "test"], "prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]})
    with open_store(tmp_path / "s.duckdb") as store:
        store.insert_new("problems", problems)
        assert store.read("problems", split="test")["problem_id"].sort().to_list() == ["2", "3"]
        assert store.read("problems", split="test", source="g")["problem_id"].to_list() == ["2"]
        assert "ingested_at" not in store.read("problems").columns
        with pytest.raises(StoreError, match="unknown table 'pairs'"):
            store.read("pairs")
        with pytest.raises(StoreError, match="table problems has no column 'question'"):
            store.read("problems", question="a")
        with pytest.raises(StoreError, match=r"table problems has no column\(s\) \['question'\]"):
            store.insert_new("problems", problems.rename({"prompt": "question"}))


def test_the_corpus_holds_the_worked_solutions_sft_trains_on(tmp_path):
    """SFT trains on a problem's meta.solution where it has one (GSM8K's `<<48/2=24>>` steps): the tiny model's
    tokenizer left its `<`, `>`, `*`, `$` out (8% of SFT's tokens were <unk>). Problems without one add nothing."""
    problems = pl.DataFrame({"problem_id": ["1", "2", "3"], "source": ["g", "g", "h"], "split": "train",
                             "prompt": ["q1", "q2", "q3"], "answer": ["24", "5", "7"],
                             "meta": ['{"solution": "48/2 = <<48/2=24>>24\\n#### 24"}', None, '{"id": 3}']})
    with open_store(tmp_path / "s.duckdb") as store:
        store.insert_new("problems", problems)
        assert sorted(store.corpus_texts()) == sorted(["q1", "q2", "q3", "24", "5", "7",
                                                       "48/2 = <<48/2=24>>24\n#### 24"])
        assert sorted(store.corpus_texts(["h"])) == ["7", "q3"]


def test_rows_read_in_key_order_whatever_the_order_they_came_in(tmp_path):
    """A source deleted and ingested again came back after the others: SFT, RM and DPO on every source read the
    same rows in another order and trained other weights (a helper: another stage dir, other sha256)."""
    first, second = pairs_frame(["b", "d", "a"], source="A"), pairs_frame(["c", "e"], source="B")
    with open_store(tmp_path / "s.duckdb") as store:
        store.insert_new("preference_pairs", first)
        store.insert_new("preference_pairs", second)
        before = store.read("preference_pairs")
        store.delete_source("A")
        store.insert_new("preference_pairs", first)
        after = store.read("preference_pairs")
    assert before["pair_id"].to_list() == ["a", "b", "c", "d", "e"]
    assert after.equals(before)


def test_an_empty_selection_is_one_line_naming_it_and_what_the_table_holds(tmp_path):
    problems = pl.DataFrame({"problem_id": ["1", "2", "3"], "source": ["g", "g", "h"],
                             "split": ["train", "test", "test"], "prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]})
    with open_store(tmp_path / "s.duckdb") as store:
        with pytest.raises(StoreError, match=r"^no problems rows in the store; ingest some first$"):
            store.read_selected("problems", source="g")
        store.insert_new("problems", problems)
        assert store.read_selected("problems", split="test", source=None)["problem_id"].sort().to_list() == ["2", "3"]
        with pytest.raises(StoreError) as error:
            store.read_selected("problems", source="G", split="test")
        assert str(error.value) == ("no problems rows in the store with source='G', split='test'; it holds "
                                    "source='g', split='test': 1 rows; source='g', split='train': 1 rows; "
                                    "source='h', split='test': 1 rows")
        many = pl.DataFrame({"pair_id": [str(i) for i in range(12)], "source": [f"s{i:02}" for i in range(12)],
                             "prompt": ["p"] * 12, "chosen": ["c"] * 12, "rejected": ["r"] * 12})
        store.insert_new("preference_pairs", many)
        with pytest.raises(StoreError, match=r"with source='x'; it holds source='s00': 1 rows; .*source='s09': 1 rows;"
                                             r" and 2 more$"):
            store.read_selected("preference_pairs", source="x")


def test_run_samples_leave_out_problems_the_store_no_longer_holds_in_key_order(tmp_path):
    problems = pl.DataFrame({"problem_id": ["p", "q"], "source": "s", "split": "test", "prompt": ["1+1=", "2+2="],
                             "answer": ["2", "4"]})
    samples = pl.DataFrame({"run_id": ["r"] * 4 + ["o"], "prompt_id": ["q", "x", "p", "q", "p"],
                            "sample_idx": [1, 0, 0, 0, 0], "completion": ["c"] * 5})
    with open_store(tmp_path / "s.duckdb") as store:
        store.insert_new("problems", problems)
        store.append("samples", samples)
        assert store.run_samples("r").select("prompt_id", "sample_idx").rows() == [("p", 0), ("q", 0), ("q", 1)]
        assert store.run_samples("nosuch").height == 0


def test_stats_count_per_table_and_source(tmp_path):
    with open_store(tmp_path / "s.duckdb") as store:
        store.insert_new("preference_pairs", pairs_frame(["a", "b"], source="hh"))
        store.insert_new("preference_pairs", pairs_frame(["c"], source="mine"))
        store.append("samples", pl.DataFrame({"run_id": ["r"] * 3, "prompt_id": ["p", "p", "q"],
                                              "sample_idx": [0, 1, 0], "completion": ["x"] * 3, "policy": ["sft"] * 3}))
        stats = store.stats().rows()
        assert store.sampled_prompt_ids("r") == {"p", "q"}
    # samples are listed by model, not as a source `data delete --source` would find
    assert stats == [("preference_pairs", "hh", None, 2), ("preference_pairs", "mine", None, 1),
                     ("samples", None, "sft", 3)]


def test_quarantine_reasons_group_oversized_records_of_any_size(tmp_path):
    """An oversized record's reason holds its size, a long one says its raw text was cut, a record of a one-line
    JSON array says which it is: the listing groups such rows under their common reason, and each row keeps what
    is its own in the quarantine table; other reasons group as they are."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(f'{{"prompt": "{"a" * size}", "chosen": "b", "rejected": "c"}}\n'
                            for size in (40, 50, 60, 20_000))
                    + '{"prompt": "a", "chosen": 1, "rejected": "c"}\n')
    array = tmp_path / "a.json"
    array.write_text('[{"prompt": "a", "chosen": 1, "rejected": "c"}, {"prompt": "b", "chosen": "d", "rejected": "c"}, '
                     '{"prompt": "e", "chosen": 2, "rejected": "c"}]')
    with open_store(tmp_path / "store.duckdb") as store:
        assert ingest_file(data, store, max_record_bytes=80).quarantined == 5
        assert ingest_file(array, store, source="array").quarantined == 2
        reasons = store.quarantine_reasons()
        stored = sorted(store.read("quarantine")["reason"])
    assert reasons.select("source", "reason", "n_rows", "first").rows() == [
        ("p", "record as JSON is over max_record_bytes 80", 4, "line 1"),
        ("array", "field 'chosen' is a number, expected a string", 2, "line 1"),
        ("p", "field 'chosen' is a number, expected a string", 1, "line 5")], reasons
    assert stored == sorted([
        "field 'chosen' is a number, expected a string",
        "field 'chosen' is a number, expected a string (record 1 of the file, on line 1)",
        "field 'chosen' is a number, expected a string (record 3 of the file, on line 1)",
        *(f"record is {size} bytes as JSON > max_record_bytes 80" for size in (86, 96, 106)),
        "record is 20,046 bytes as JSON > max_record_bytes 80 (raw truncated to 10 KB)"])


def test_delete_eval_results_of_one_model_and_run(tmp_path):
    results = pl.DataFrame({"run_id": ["a", "a", "b", "a"], "model": ["m", "m", "m", "n"], "dataset": ["d"] * 4,
                            "k": [1, 2, 1, 1]})
    with open_store(tmp_path / "s.duckdb") as store:
        store.insert_new("eval_results", results)
        store.delete_eval_results("a", "m")
        assert store.read("eval_results").select("run_id", "model").rows() == [("a", "n"), ("b", "m")]  # key order


def test_read_only_and_one_line_open_errors(tmp_path):
    with pytest.raises(StoreError, match="no store at .*missing.duckdb; run `alignflow ingest` first"):
        with open_store(tmp_path / "missing.duckdb", read_only=True):
            pass
    path = tmp_path / "s.duckdb"
    with open_store(path) as store:
        store.insert_new("preference_pairs", pairs_frame(["a"]))
    with open_store(path, read_only=True) as store:
        assert store.count("preference_pairs") == 1
    (tmp_path / "text.duckdb").write_text("not a database")
    with pytest.raises(StoreError, match="text.duckdb cannot be opened .*not a valid DuckDB database file"):
        with open_store(tmp_path / "text.duckdb"):
            pass
    foreign = tmp_path / "foreign.duckdb"
    duckdb.connect(str(foreign)).execute("CREATE TABLE t (a INTEGER)").close()
    with pytest.raises(StoreError, match="not an alignflow store: it has no schema_info table"):
        with open_store(foreign, read_only=True):
            pass


def test_store_held_by_another_process(tmp_path):
    """A store another process holds is waited for (a `data stats` during a pipeline must not fail its next task);
    one held past the wait is a one-line error."""
    path = tmp_path / "s.duckdb"
    holder = textwrap.dedent(f"""
        import sys, time
        from pipeline_lib.store.db import open_store
        with open_store({str(path)!r}, read_only=sys.argv[1] == "ro"):
            print("ready", flush=True)
            time.sleep(float(sys.argv[2]))
    """)
    with open_store(path):
        pass  # the file exists for the read-only holder
    for mode in ("rw", "ro"):
        proc = subprocess.Popen([sys.executable, "-c", holder, mode, "2"], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            started = time.monotonic()
            with open_store(path) as store:  # waits the holder out
                assert store.count("problems") == 0
            assert time.monotonic() - started > 0.5
        finally:
            proc.wait(timeout=30)
    proc = subprocess.Popen([sys.executable, "-c", holder, "rw", "30"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(StoreError) as err:
            with open_store(path, wait=1.0):
                pass
        assert "is in use by another alignflow process" in str(err.value) and "\n" not in str(err.value)
    finally:
        proc.kill()
        proc.wait(timeout=30)
