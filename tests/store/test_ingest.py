"""Ingest: every file type and record shape, every bad-input class, the real HH and GSM8K files."""

from __future__ import annotations

import contextlib
import gzip
import json
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import polars as pl
import pytest

from pipeline_lib.fingerprint import fingerprint_path
from pipeline_lib.store.db import StoreError, open_store
from pipeline_lib.fingerprint import content_id
from pipeline_lib.store.ingest import IngestError, IngestReport, check_readable, ingest_file
from pipeline_lib.store.shapes import hh_prompt_end

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "store.duckdb") as s:
        yield s


def write_jsonl(path: Path, records: list) -> Path:
    """Records are dicts (dumped) or raw bytes lines (written as they are)."""
    lines = [r if isinstance(r, bytes) else orjson.dumps(r) for r in records]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def check_invariant(report: IngestReport) -> None:
    assert report.rows_read == report.accepted + report.duplicates + report.quarantined


def quarantine(store) -> dict[int, str]:
    return dict(store.read("quarantine").select("line_no", "reason").iter_rows())


PAIRS = [
    {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
    {"prompt": "Capital of France?", "chosen": "Paris", "rejected": "Lyon", "id": 7},
    {"prompt": "Say hi", "chosen": " hi\n", "rejected": "no"},
]


# ---- ids and the report


def test_content_id_is_sha256_of_the_joined_parts_unless_a_part_holds_the_separator():
    # printf 'a\x1fb\x1fc' | sha256sum: the ids stores already hold stay the same
    assert content_id("a", "b", "c") == hashlib.sha256(b"a\x1fb\x1fc").hexdigest()
    assert content_id("é", "中") == hashlib.sha256("é\x1f中".encode()).hexdigest()
    # a part holding "\x1f" would move a boundary: those parts are hashed as 0xFF + their JSON array
    assert content_id("a\x1fb", "c") == hashlib.sha256(b'\xff["a\\u001fb","c"]').hexdigest()
    ids = {content_id("a\x1fb", "c"), content_id("a", "b\x1fc"), content_id("a", "b", "c"), content_id("a\x1fb\x1fc")}
    assert len(ids) == 4


def test_ids_of_records_with_separator_text_do_not_collide(tmp_path, store):
    """Each pair of records joins to the same text with "\x1f" between fields: all are distinct rows."""
    pairs = [{"prompt": "a\x1fb", "chosen": "c", "rejected": "d"}, {"prompt": "a", "chosen": "b\x1fc", "rejected": "d"}]
    rankings = [{"prompt": "p", "responses": ["a\x1fb", "c"]}, {"prompt": "p", "responses": ["a", "b\x1fc"]},
                {"prompt": "p\x1fa", "responses": ["b", "c"]}]
    problems = [{"question": "q\x1f1", "answer": "2"}, {"question": "q", "answer": "1\x1f2"}]
    for name, records, table in (("p", pairs, "preference_pairs"), ("r", rankings, "rankings"),
                                 ("m", problems, "problems")):
        report = ingest_file(write_jsonl(tmp_path / f"{name}.jsonl", records), store)
        assert (report.accepted, report.duplicates) == (len(records), 0), name
        assert store.count(table) == len(records)


def test_summary_line(tmp_path, store):
    report = ingest_file(write_jsonl(tmp_path / "p.jsonl", PAIRS), store)
    assert report.summary() == ("p.jsonl (pairs -> preference_pairs): read 3 = accepted 3 + duplicates 0 + "
                                "quarantined 0; fields kept in meta, which no stage reads: 'id' (1)")
    assert (report.source, report.table, report.format) == ("p", "preference_pairs", "pairs")
    assert report.fingerprint == fingerprint_path(tmp_path / "p.jsonl")
    metrics = report.metrics()
    assert {k: v for k, v in metrics.items() if k != "ingest/seconds"} == {
        "ingest/rows_read": 3.0, "ingest/accepted": 3.0, "ingest/duplicates": 0.0, "ingest/quarantined": 0.0}
    assert "| accepted | 3 |" in report.markdown() and report.as_dict()["rows_read"] == 3


# ---- shapes


def test_pairs_rows_ids_and_meta(tmp_path, store):
    report = ingest_file(write_jsonl(tmp_path / "pairs.jsonl", PAIRS), store, source="mine")
    check_invariant(report)
    rows = {r["prompt"]: r for r in store.read("preference_pairs").to_dicts()}
    assert rows["Say hi"]["chosen"] == " hi\n"  # text kept exactly
    assert rows["2+2?"]["pair_id"] == content_id("2+2?", "4", "5")
    assert json.loads(rows["Capital of France?"]["meta"]) == {"id": 7}
    assert rows["2+2?"]["meta"] is None and rows["2+2?"]["prompt_messages"] is None
    assert {r["source"] for r in rows.values()} == {"mine"}


def test_every_file_type_gives_the_same_rows(tmp_path, store):
    """The same 3 pairs (+1 bad record) as jsonl, json, parquet, csv, and gzipped jsonl/json/csv: after the first file
    every pair is a duplicate, and the bad record is reported where it is, from 1: the line its text starts on
    (the pretty-printed JSON array's second record starts on line 7), the parquet file's row."""
    records = [*PAIRS[:1], {"prompt": "bad", "chosen": "same", "rejected": "same"}, PAIRS[2], PAIRS[1]]
    jsonl = write_jsonl(tmp_path / "a.jsonl", records)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(jsonl.read_bytes()))
    (tmp_path / "c.json").write_bytes(orjson.dumps(records, option=orjson.OPT_INDENT_2))
    pl.DataFrame(records).write_parquet(tmp_path / "d.parquet")
    pl.DataFrame(records).drop("id").write_csv(tmp_path / "e.csv")
    (tmp_path / "f.json.gz").write_bytes(gzip.compress((tmp_path / "c.json").read_bytes()))
    (tmp_path / "g.CSV.GZ").write_bytes(gzip.compress((tmp_path / "e.csv").read_bytes()))
    expected_line = {"a.jsonl": 2, "b.jsonl.gz": 2, "c.json": 7, "d.parquet": 2, "e.csv": 3, "f.json.gz": 7,
                     "g.CSV.GZ": 3}
    for i, (name, line_no) in enumerate(expected_line.items()):
        report = ingest_file(tmp_path / name, store)
        check_invariant(report)
        assert (report.rows_read, report.accepted, report.quarantined) == (4, 3 if i == 0 else 0, 1), name
        q = store.read("quarantine", source=Path(name).name.split(".")[0]).to_dicts()
        assert [(r["line_no"], r["reason"]) for r in q] == [(line_no, "chosen identical to rejected")], name
    pairs = store.read("preference_pairs")
    assert pairs.height == 3
    assert set(pairs["pair_id"]) == {content_id(r["prompt"], r["chosen"], r["rejected"]) for r in PAIRS}


def test_hh_prompt_is_shared_prefix_ending_at_assistant_turn(tmp_path, store):
    prompt = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: help me\n\nAssistant:"
    chosen = prompt + " Sure.\n\nAssistant: inside the response"
    rejected = prompt + " Sure thing."  # shares " Sure" past the prompt: the cut stays at the marker
    assert hh_prompt_end(chosen, rejected) == len(prompt)
    report = ingest_file(write_jsonl(tmp_path / "hh.jsonl", [{"chosen": chosen, "rejected": rejected}]), store)
    assert report.format == "hh" and report.accepted == 1
    row = store.read("preference_pairs").row(0, named=True)
    assert row["prompt"] == prompt
    assert row["chosen"] == " Sure.\n\nAssistant: inside the response"
    assert row["rejected"] == " Sure thing."


def test_hh_cut_is_the_last_marker_both_transcripts_share():
    prompt = "\n\nHuman: q\n\nAssistant:"
    chosen = prompt + " a\n\nAssistant: b"
    rejected = prompt + " a\n\nAssistant: c"  # common prefix ends past a second marker
    # both responses share " a\n\nAssistant:", so by the definition the prompt runs through it
    assert hh_prompt_end(chosen, rejected) == len(prompt) + len(" a\n\nAssistant:")
    assert hh_prompt_end(prompt + " x", "\n\nHuman: other\n\nAssistant: y") is None


def test_chat_variants_give_one_row(tmp_path, store):
    """Assistant-only completions, full conversations, and no `prompt` at all are the same pair."""
    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    good, bad = [{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]
    variants = [
        {"prompt": user, "chosen": good, "rejected": bad, "tag": "x"},
        {"prompt": user, "chosen": user + good, "rejected": user + bad},
        {"chosen": user + good, "rejected": user + bad},
    ]
    report = ingest_file(write_jsonl(tmp_path / "chat.jsonl", variants), store)
    check_invariant(report)
    assert (report.format, report.accepted, report.duplicates) == ("chat", 1, 2)
    row = store.read("preference_pairs").row(0, named=True)
    assert (row["prompt"], row["chosen"], row["rejected"]) == ("system: Be brief.\n\nuser: 2+2?", "4", "5")
    assert json.loads(row["prompt_messages"]) == {"prompt": user, "chosen": good, "rejected": bad}
    assert json.loads(row["meta"]) == {"tag": "x"}


def test_chat_string_prompt_is_one_user_message(tmp_path, store):
    record = {"prompt": "hi", "chosen": [{"role": "assistant", "content": "hello"}],
              "rejected": [{"role": "assistant", "content": "go away"}]}
    report = ingest_file(write_jsonl(tmp_path / "c.jsonl", [record]), store, format="chat")
    assert report.accepted == 1
    row = store.read("preference_pairs").row(0, named=True)
    assert row["prompt"] == "user: hi"
    assert json.loads(row["prompt_messages"])["prompt"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("record, reason", [
    ({"prompt": "p", "chosen": "same", "rejected": " same\n"}, "chosen identical to rejected"),
    ({"chosen": "\n\nHuman: q\n\nAssistant: same", "rejected": "\n\nHuman: q\n\nAssistant:same "},
     "chosen identical to rejected"),
    ({"prompt": "p", "chosen": [{"role": "assistant", "content": "same"}],
      "rejected": [{"role": "assistant", "content": "same\n"}]}, "chosen identical to rejected"),
    ({"prompt": "p", "responses": ["a", "same", "same\t"]}, "ranking has identical responses"),
])
def test_responses_that_differ_only_in_surrounding_whitespace_are_identical(tmp_path, store, record, reason):
    """In every shape (chat turns always compared so): such a pair holds no preference."""
    report = ingest_file(write_jsonl(tmp_path / "w.jsonl", [record]), store)
    assert (report.accepted, report.quarantined) == (0, 1)
    assert quarantine(store) == {1: reason}


def test_conversations_that_render_alike_are_different_pairs(tmp_path, store):
    """A chat pair is keyed on its messages, not on its rendered prompt text: a user turn holding the text of two
    turns renders as the two turns do, and the plain prompt `user: q` as the conversation [user "q"]. Each is its
    own pair (none counted a duplicate of another), and the conversation keeps its messages."""
    bye, hello = [{"role": "assistant", "content": "bye"}], [{"role": "assistant", "content": "hello"}]
    one_turn = [{"role": "user", "content": "hi\n\nassistant: x"}]
    two_turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]
    chat = [{"prompt": one_turn, "chosen": hello, "rejected": bye},
            {"prompt": two_turns, "chosen": hello, "rejected": bye},
            {"prompt": [{"role": "user", "content": "q"}], "chosen": hello, "rejected": bye}]
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "user: q", "chosen": "hello", "rejected": "bye"}])
    assert ingest_file(plain, store).accepted == 1
    report = ingest_file(write_jsonl(tmp_path / "chat.jsonl", chat), store)
    check_invariant(report)
    assert (report.format, report.accepted, report.duplicates) == ("chat", 3, 0)
    rows = store.read("preference_pairs")
    stored = {(row["source"], row["prompt"], json.dumps(row["prompt_messages"] and json.loads(row["prompt_messages"])))
              for row in rows.iter_rows(named=True)}
    assert stored == {("plain", "user: q", "null")} | {
        ("chat", prompt, json.dumps(record))
        for prompt, record in (("user: hi\n\nassistant: x", chat[0]), ("user: hi\n\nassistant: x", chat[1]),
                               ("user: q", chat[2]))}
    assert rows["pair_id"].n_unique() == 4
    assert ingest_file(tmp_path / "chat.jsonl", store).duplicates == 3  # re-ingesting stays idempotent


def test_chat_turns_match_on_role_and_content_whatever_other_keys_they_carry(tmp_path, store):
    """A parquet column gives every message the union of its struct fields (`name: null` where a message had
    none), lists repeat a string prompt, a prompt string has a trailing space: still one shared user turn, and
    the null-valued keys are not stored."""
    user = {"role": "user", "content": "Explain Y", "name": None}
    good, bad = {"role": "assistant", "content": "Y is..."}, {"role": "assistant", "content": "No."}
    parquet = tmp_path / "chat.parquet"
    pl.DataFrame({"prompt": ["Explain Y "], "chosen": [[user, {**good, "name": None}]],
                  "rejected": [[{"role": "user", "content": "Explain Y"}, bad]]}).write_parquet(parquet)
    report = ingest_file(parquet, store)
    check_invariant(report)
    assert (report.format, report.accepted, report.quarantined) == ("chat", 1, 0)
    row = store.read("preference_pairs").row(0, named=True)
    assert (row["prompt"], row["chosen"], row["rejected"]) == ("user: Explain Y", "Y is...", "No.")
    assert json.loads(row["prompt_messages"]) == {"prompt": [{"role": "user", "content": "Explain Y"}],
                                                  "chosen": [good], "rejected": [bad]}
    tools = {"prompt": [{"role": "user", "content": "Q1", "tool_calls": []}],
             "chosen": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A"}],
             "rejected": [{"role": "user", "content": "Q1", "name": None}, {"role": "assistant", "content": "B"}]}
    report = ingest_file(write_jsonl(tmp_path / "tools.jsonl", [tools]), store)
    assert (report.accepted, report.quarantined) == (1, 0)
    assert store.read("preference_pairs").filter(pl.col("chosen") == "A")["prompt"].to_list() == ["user: Q1"]


def test_rankings_ordered_best_to_worst(tmp_path, store):
    records = [
        {"prompt": "p1", "responses": ["mid", "best", "worst"], "ranks": [2, 1, 3]},
        {"prompt": "p2", "responses": ["a", "b"]},  # already ordered, no ranks
    ]
    report = ingest_file(write_jsonl(tmp_path / "r.jsonl", records), store)
    check_invariant(report)
    assert (report.format, report.table, report.accepted) == ("ranking", "rankings", 2)
    rows = {r["prompt"]: r for r in store.read("rankings").to_dicts()}
    assert rows["p1"]["responses"] == ["best", "mid", "worst"]
    assert rows["p1"]["ranks"] == [1, 2, 3]  # aligned with the reordered responses, not the record's [2, 1, 3]
    assert rows["p2"]["responses"] == ["a", "b"] and rows["p2"]["ranks"] == [1, 2]
    assert rows["p1"]["ranking_id"] == content_id("p1", "best", "mid", "worst")


def test_a_ranking_without_ranks_but_with_scores_of_its_own_is_quarantined(tmp_path, store):
    """Without ranks the responses are read best first; a record scoring them (here worst, best, mid) would have
    been stored in that order as best first. Scores beside ranks are kept in meta; other fields do not count."""
    records = [
        {"prompt": "p1", "responses": ["worst", "best", "mid"], "scores": [1, 9, 5]},
        {"prompt": "p2", "responses": ["a", "b"], "ratings": [5, 4]},
        {"prompt": "p3", "responses": ["a", "b"], "ranks": [2, 1], "scores": [1, 2]},
        {"prompt": "p4", "responses": ["a", "b"], "info": {"rank": 2}},
    ]
    report = ingest_file(write_jsonl(tmp_path / "r.jsonl", records), store)
    check_invariant(report)
    assert (report.accepted, report.quarantined) == (2, 2)
    assert quarantine(store) == {
        1: "no 'ranks' but a field 'scores': without ranks the responses are read best first as written, which it "
           "may contradict; give 'ranks' (1 = best)",
        2: "no 'ranks' but a field 'ratings': without ranks the responses are read best first as written, which it "
           "may contradict; give 'ranks' (1 = best)",
    }
    assert sorted(store.read("rankings")["prompt"]) == ["p3", "p4"]


def test_a_chat_message_list_written_as_text_is_no_text_pair(tmp_path, store):
    """A pandas CSV export of ultrafeedback_binarized writes its message lists as Python text; read as text pairs,
    the list's syntax and the user turn became the trained response. JSON text of a list too."""
    as_python = "[{'content': 'Q0?', 'role': 'user'}, {'content': 'good', 'role': 'assistant'}]"
    records = [
        {"prompt": "Q0?", "chosen": as_python, "rejected": as_python.replace("good", "bad")},
        {"prompt": json.dumps([{"role": "user", "content": "Q1?"}]), "chosen": "a", "rejected": "b"},
        {"prompt": "Q2?", "chosen": "[1] is a list", "rejected": "[{x}] is a set in braces"},
    ]
    report = ingest_file(write_jsonl(tmp_path / "p.jsonl", records), store)
    check_invariant(report)
    assert (report.format, report.accepted, report.quarantined) == ("pairs", 1, 2)
    written = ("holds a chat message list written as text ([{'role': ...): store the list itself (a JSON array of "
               "{role, content} objects; a CSV cannot hold one: write JSON Lines or parquet)")
    assert quarantine(store) == {1: f"field 'chosen' {written}", 2: f"field 'prompt' {written}"}


def test_a_worked_solution_in_answer_without_a_final_answer_marker_is_quarantined(tmp_path, store):
    """orca-math's `answer` is prose over several lines: stored as the gold answer, no completion could match it.
    One line, GSM8K's `####` or a `\\boxed{}` in it still make a gold answer."""
    records = [
        {"question": "Q1", "answer": "To find the total:\n\n10 + 3 = 13\nSo she sold 13 clips."},
        {"question": "Q2", "answer": " 13\n"},
        {"question": "Q3", "answer": "2 + 2 = 4\n#### 4"},
        {"question": "Q4", "answer": "Add them:\n$\\boxed{4}$"},
        {"question": "Q5", "answer": "The Eiffel Tower"},
    ]
    report = ingest_file(write_jsonl(tmp_path / "orca.jsonl", records), store)
    check_invariant(report)
    assert (report.accepted, report.quarantined) == (4, 1)
    assert quarantine(store) == {1: "field 'answer' holds 4 lines and no '####': a worked solution, not a gold answer "
                                    "(the verifier would compare answers to all of it); put the final answer in "
                                    "'answer', its solution under 'solution'"}


def test_the_counts_line_names_the_fields_no_stage_reads(tmp_path, store):
    """Intel/orca_dpo_pairs' `system` beside text pairs went to meta unsaid (no stage reads it); a problem's
    `solution` is read by SFT, so it is not named."""
    pairs = [{"system": "You are an AI.", "prompt": f"q{i}", "chosen": "a", "rejected": "b", "id": i}
             for i in range(3)]
    pairs[0].pop("id")
    report = ingest_file(write_jsonl(tmp_path / "orca_dpo.jsonl", pairs), store)
    assert report.unread_fields == "'system' (3), 'id' (2)"
    assert report.summary().endswith("; fields kept in meta, which no stage reads: 'system' (3), 'id' (2)")
    problems = [{"question": "Q", "answer": "4", "solution": "2 + 2 = 4"}]
    assert ingest_file(write_jsonl(tmp_path / "math.jsonl", problems), store).unread_fields == ""
    many = [{"prompt": f"q{i}", "chosen": "a", "rejected": "b", f"key\n{i:02}": 1} for i in range(12)]
    report = ingest_file(write_jsonl(tmp_path / "many.jsonl", many), store)  # one line, ten names at most
    assert report.unread_fields == ", ".join(f"'key\\n{i:02}' (1)" for i in range(10)) + " and 2 more"
    rejected = [{"prompt": "q", "chosen": "", "rejected": "b", "note": 1}, {"prompt": "r", "chosen": "a",
                                                                            "rejected": "b", "id": 1}]
    report = ingest_file(write_jsonl(tmp_path / "rejected.jsonl", rejected), store)  # a helper: 'note' was named
    assert (report.quarantined, report.unread_fields) == (1, "'id' (1)")  # a quarantined record's fields: nowhere


def test_problems_gsm8k_plain_numeric_and_split(tmp_path, store):
    records = [
        {"question": "Q1", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"},
        {"prompt": "Q2", "answer": "x = 3"},
        {"question": "Q3", "answer": 7, "split": "test"},
        {"question": "Q4", "answer": "1", "split": " test\t"},  # a spreadsheet cell's spaces: not a split of its own
    ]
    report = ingest_file(write_jsonl(tmp_path / "math.jsonl", records), store, split="dev")
    check_invariant(report)
    assert (report.format, report.accepted) == ("problem", 4)
    assert sorted(store.read("problems", split="test")["prompt"]) == ["Q3", "Q4"]
    rows = {r["prompt"]: r for r in store.read("problems").to_dicts()}
    assert (rows["Q1"]["answer"], rows["Q1"]["split"]) == ("4", "dev")
    assert json.loads(rows["Q1"]["meta"]) == {"solution": "2 + 2 = <<2+2=4>>4\n#### 4"}
    assert (rows["Q2"]["answer"], rows["Q2"]["meta"]) == ("x = 3", None)  # a plain answer is kept as is
    assert (rows["Q3"]["answer"], rows["Q3"]["split"]) == ("7", "test")  # the record's split wins
    assert rows["Q1"]["problem_id"] == content_id("Q1", "4")
    # and the counts line says so (`--split` was silently overruled), counting the file's problems that are kept or
    # were stored already, not a quarantined one (another answer to Q3) nor an in-file copy (Q4's)
    assert report.own_splits == "2 test"
    assert report.summary().endswith("; of its problems, these name their own split, which wins over the split "
                                     "given: 2 test")
    extra = [{"question": "Q3", "answer": "8", "split": "test"}, {"question": "Q4", "answer": "1", "split": "test"}]
    repeat = ingest_file(write_jsonl(tmp_path / "again.jsonl", records + extra), store, split="dev")
    assert (repeat.accepted, repeat.duplicates, repeat.quarantined, repeat.own_splits) == (0, 5, 1, "2 test")
    again = ingest_file(write_jsonl(tmp_path / "more.jsonl", records[2:] + [{"prompt": "Q5", "answer": "5"}]), store)
    assert again.own_splits == "" and "own split" not in again.summary()


def test_the_split_argument_is_stripped_as_a_records_split_is_and_a_blank_one_is_an_error(tmp_path, store):
    """`--split "test "` (a pasted value) names the test split, as a record's `split: "test "` does."""
    path = write_jsonl(tmp_path / "math.jsonl", [{"question": "Q1", "answer": "1"},
                                                 {"question": "Q2", "answer": "2", "split": "test "}])
    ingest_file(path, store, split="test ")
    assert sorted(store.read("problems")["split"]) == ["test", "test"]
    with pytest.raises(IngestError, match=r"math\.jsonl: split is blank; expected a split name such as train or "
                                          r"test$"):
        ingest_file(path, store, split=" ")


def test_a_split_for_records_without_one_is_refused_not_ignored(tmp_path, store):
    """Pairs and rankings have no split: `--split test` on them was accepted and ignored silently."""
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    expected = (r"pairs\.jsonl: split 'test' given, but its pairs records go to preference_pairs, which has no split "
                r"\(only problems do\); leave split out$")
    with pytest.raises(IngestError, match=expected):
        ingest_file(path, store, split="test")
    with pytest.raises(IngestError, match=expected):
        check_readable(path, split="test")
    assert store.count("preference_pairs") == 0
    assert ingest_file(path, store).accepted == 1 and check_readable(path) == "pairs"


def test_a_table_of_problems_reads_each_row_from_the_alternative_column_that_holds_its_value(tmp_path, store):
    """A parquet table merging GSM8K-like and MATH-like rows has every column in every row, null where a row uses
    another: each row's prompt is its first non-null of question/prompt/problem, its answer its `answer` or else the
    last \\boxed{} of its `solution`; a null column is nothing to keep in meta, and no worked solution."""
    path = tmp_path / "merged.parquet"
    pl.DataFrame({"question": ["q1", None, None, "q4"], "problem": [None, "p2", "p3", None],
                  "answer": ["w #### 1", None, None, "4"], "solution": [None, "so \\boxed{2}", "no box", None]}
                 ).write_parquet(path)
    report = ingest_file(path, store)
    check_invariant(report)
    assert (report.accepted, report.quarantined) == (3, 1)
    rows = {r["prompt"]: (r["answer"], r["meta"]) for r in store.read("problems").to_dicts()}
    assert rows == {"q1": ("1", '{"solution":"w #### 1"}'), "p2": ("2", '{"solution":"so \\\\boxed{2}"}'),
                    "q4": ("4", None)}
    assert quarantine(store) == {3: "no 'answer' field, and field 'solution' has no \\boxed{} answer"}


def test_problem_keeps_the_unused_prompt_in_meta(tmp_path, store):
    """`question` wins over `prompt`; the other text is not dropped but kept in meta, like any extra field."""
    records = [{"question": "q", "prompt": "other text", "answer": "1", "id": 3},
               {"question": "q2", "prompt": {"not": "text"}, "answer": "x #### 2"}]
    report = ingest_file(write_jsonl(tmp_path / "math.jsonl", records), store)
    assert (report.format, report.accepted) == ("problem", 2)
    rows = {r["prompt"]: r for r in store.read("problems").to_dicts()}
    assert json.loads(rows["q"]["meta"]) == {"id": 3, "prompt": "other text"}
    assert json.loads(rows["q2"]["meta"]) == {"prompt": {"not": "text"}, "solution": "x #### 2"}


def test_problem_with_a_solution_field_of_its_own_keeps_it_or_is_quarantined(tmp_path, store):
    """meta.solution (what SFT trains on) is the worked solution of a GSM8K answer; a record's own `solution` is not
    overwritten by it: the same text is one solution, another text is two, and the row is quarantined."""
    records = [{"question": "q1", "answer": "3+4=7 #### 7", "solution": "my own worked solution", "id": 12},
               {"question": "q2", "answer": "1+1=2 #### 2", "solution": "1+1=2 #### 2"},
               {"question": "q3", "answer": "5", "solution": "2+3=5"}]
    report = ingest_file(write_jsonl(tmp_path / "math.jsonl", records), store)
    check_invariant(report)
    assert (report.accepted, report.quarantined) == (2, 1)
    assert quarantine(store) == {1: "fields 'solution' and 'answer' hold different worked solutions ('answer' has "
                                    "one before '####'); keep one of them"}
    rows = {r["prompt"]: (r["answer"], json.loads(r["meta"])) for r in store.read("problems").to_dicts()}
    assert rows == {"q2": ("2", {"solution": "1+1=2 #### 2"}), "q3": ("5", {"solution": "2+3=5"})}


def test_real_gsm8k_files(store):
    test = ingest_file(DATA / "gsm8k" / "test-first100.jsonl", store, split="test")
    train = ingest_file(DATA / "gsm8k" / "train-first500.jsonl", store)
    assert (test.accepted, test.quarantined, train.accepted, train.quarantined) == (100, 0, 500, 0)
    janet = pl.col("prompt").str.starts_with("Janet’s ducks")  # (the store reads in key order, not the file's)
    first = store.read("problems", split="test").filter(janet).row(0, named=True)
    assert first["answer"] == "18"  # "... #### 18"
    assert json.loads(first["meta"])["solution"].endswith("#### 18")
    assert store.read("problems", split="train").height == 500


# ---- bad input -> quarantine, one reason a row


def test_bad_jsonl_lines_are_quarantined_with_reasons(tmp_path, store):
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    lines = [
        good,                                                             # 1
        b'{"prompt": "p", "chosen": "a", "rejected": ',                   # 2 malformed
        b'{"prompt": "p\xff", "chosen": "a", "rejected": "b"}',           # 3 invalid UTF-8
        {"prompt": "p", "chosen": "a"},                                   # 4 missing
        {"prompt": "p", "chosen": None, "rejected": "b"},                 # 5 null
        {"prompt": "  ", "chosen": "a", "rejected": "b"},                 # 6 empty
        {"prompt": "p", "chosen": 1, "rejected": "b"},                    # 7 number (polars would cast it)
        {"prompt": "p", "chosen": ["a"], "rejected": "b"},                # 8 list
        {"prompt": "p", "chosen": "same", "rejected": "same"},            # 9 identical
        [1, 2],                                                           # 10 not an object
        b"",                                                              # 11 blank: not a record
        {"prompt": "p", "chosen": "x" * 300, "rejected": "b"},            # 12 over the size limit
        b'{"prompt": "p", "chosen": "\\ud800", "rejected": "b"}',         # 13 lone surrogate escape
        {"prompt": "p2", "chosen": "a", "rejected": "b"},                 # 14
    ]
    report = ingest_file(write_jsonl(tmp_path / "bad.jsonl", lines), store, max_record_bytes=200)
    check_invariant(report)
    assert (report.rows_read, report.accepted, report.quarantined) == (13, 2, 11)
    reasons = quarantine(store)
    assert reasons[2].startswith("malformed JSON: ")
    assert reasons[3] == "invalid UTF-8"
    assert reasons[4] == "missing field 'rejected'"
    assert reasons[5] == "field 'chosen' is null"
    assert reasons[6] == "empty field 'prompt'"
    assert reasons[7] == "field 'chosen' is a number, expected a string"
    assert reasons[8] == "field 'chosen' is a list, expected a string"
    assert reasons[9] == "chosen identical to rejected"
    assert reasons[10] == "record is a list, expected a JSON object"
    # {"prompt":"p", (14) + "chosen":" (10) + 300 x + ", (2) + "rejected":"b"} (15) = 341 bytes
    assert reasons[12] == "record is 341 bytes as JSON > max_record_bytes 200"
    assert reasons[13].startswith("malformed JSON: ")
    assert sorted(reasons) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13]
    raw = dict(store.read("quarantine").select("line_no", "raw").iter_rows())
    assert raw[4] == '{"prompt":"p","chosen":"a"}' and raw[3] == '{"prompt": "p\ufffd", "chosen": "a", "rejected": "b"}'


def test_repeated_key_is_quarantined(tmp_path, store):
    """orjson keeps a repeated key's last value, polars its first: checked and stored values would differ."""
    lines = [
        b'{"prompt":"p","chosen":5,"rejected":"b","chosen":"a"}',                  # 1 the number was stored
        b'{"prompt":"p","chosen":"a","rejected":"b","meta":{"k":1,"k" : 2}}',      # 2 in an extra field
        b'{"prompt":"p","chosen":"a","rejected":"b","note":"\\"x\\": \\"y\\""}',  # 3 key-like text: kept
    ]
    report = ingest_file(write_jsonl(tmp_path / "dup.jsonl", lines), store)
    check_invariant(report)
    assert quarantine(store) == {1: "duplicate key 'chosen'", 2: "duplicate key 'k'"}
    assert json.loads(store.read("preference_pairs")["meta"][0]) == {"note": '"x": "y"'}


def test_json_array_screens_records_as_written(tmp_path, store):
    """orjson parses the whole array first, dropping a repeated key and rounding a huge integer: such a file's
    records are screened from their own text, pretty-printed or not, and `raw` shows them as written (a line break
    as a tab: one line per record)."""
    big = 123456789012345678901234567890
    text = ('[\n  {"prompt": "p,[}", "chosen": 5,\n   "rejected": "b", "chosen": "a"},\n'
            '  {"prompt": "q", "chosen": "a", "rejected": "b", "id": %d},\n  7,\n'
            '  {"prompt": "r", "chosen": "a", "rejected": "b", "m": {"k": [1, {"k": "]"}], "k": 2}},\n'
            '  {"prompt": "say \\u0022: hi", "chosen": "a", "rejected": "b"}\n]\n' % big)  # key-like once parsed
    (tmp_path / "a.json").write_text(text)
    report = ingest_file(tmp_path / "a.json", store)
    check_invariant(report)
    assert (report.rows_read, report.accepted) == (5, 2)
    assert quarantine(store) == {2: "duplicate key 'chosen'", 5: "record is a number, expected a JSON object",
                                 6: "duplicate key 'k'"}
    assert store.read("quarantine")["raw"][0] == '{"prompt": "p,[}", "chosen": 5,\t   "rejected": "b", "chosen": "a"}'
    assert json.loads(store.read("preference_pairs").filter(pl.col("prompt") == "q")["meta"].item()) == {"id": big}
    # one repeated key beside a value that orjson writes back as `\":` must still be seen
    (tmp_path / "b.json").write_bytes(b'[{"prompt":"p","chosen":"5","rejected":"b","chosen":"a"},'
                                      b'{"prompt":"tell \\u0022: me","chosen":"a","rejected":"b"}]')
    report = ingest_file(tmp_path / "b.json", store)
    assert (report.accepted, report.quarantined) == (1, 1)


def lists(n: int) -> bytes:
    """JSON text of n nested lists (n levels)."""
    return b"[" * n + b"]" * n


def test_record_nested_too_deep_to_store_is_quarantined(tmp_path, store):
    """orjson reads 1024 levels but writes only 254: a deeper record fails alone, not its whole file."""
    pair = b'{"prompt":"p","chosen":"a","rejected":"b","x":%s}'  # the record is level 1
    lines = [pair % lists(253), pair % lists(254), pair % lists(1000), orjson.dumps(PAIRS[0])]
    report = ingest_file(write_jsonl(tmp_path / "deep.jsonl", lines), store)
    check_invariant(report)
    assert (report.accepted, report.quarantined) == (2, 2)
    assert quarantine(store) == dict.fromkeys([2, 3], "nested deeper than 254 levels")
    # a message may hold more than role and content: record, list, message = 3 levels
    chat = (b'{"prompt":"hi","rejected":[{"role":"assistant","content":"no"}],'
            b'"chosen":[{"role":"assistant","content":"a","x":%s}]}' % lists(252))
    report = ingest_file(write_jsonl(tmp_path / "chat.jsonl", [chat]), store)
    assert report.format == "chat" and report.quarantined == 1
    assert store.read("quarantine", source="chat")["reason"].to_list() == ["nested deeper than 254 levels"]
    (tmp_path / "array.json").write_bytes(b"[" + orjson.dumps(PAIRS[1]) + b"," + pair % lists(254) + b"]")
    report = ingest_file(tmp_path / "array.json", store)
    assert (report.rows_read, report.quarantined) == (2, 1)
    assert store.read("quarantine", source="array")[["line_no", "reason"]].rows() == [
        (1, "nested deeper than 254 levels (record 2 of the file, on line 1)")]


def test_integers_past_64_bits_stay_exact_in_meta(tmp_path, store):
    """orjson reads them as floats (1.2345678901234568e+29); meta keeps the number as written."""
    big = 123456789012345678901234567890
    extra = {"big": big, "n": [2**64, -(2**63) - 1, 2**64 - 1, 1.5e300, "e+19"]}
    report = ingest_file(write_jsonl(tmp_path / "p.jsonl", [json.dumps(PAIRS[0] | extra).encode()]), store)
    assert report.accepted == 1
    meta = store.read("preference_pairs")["meta"][0]
    assert json.loads(meta) == extra, meta
    problem = json.dumps({"question": "q", "answer": "x #### 7", "id": big}).encode()
    ingest_file(write_jsonl(tmp_path / "m.jsonl", [problem]), store)
    assert json.loads(store.read("problems")["meta"][0]) == {"id": big, "solution": "x #### 7"}


def test_default_size_limit_is_one_megabyte_and_raw_is_truncated(tmp_path, store):
    big = {"prompt": "p", "chosen": "x" * 1_200_000, "rejected": "b"}
    path = write_jsonl(tmp_path / "big.jsonl", [big, {"prompt": "p", "chosen": "y" * 20_000, "rejected": "y" * 20_000}])
    report = ingest_file(path, store)
    assert (report.quarantined, report.accepted) == (2, 0)
    rows = {r["line_no"]: r for r in store.read("quarantine").to_dicts()}
    assert rows[1]["reason"] == ("record is 1,200,041 bytes as JSON > max_record_bytes 1,000,000 "
                                 "(raw truncated to 10 KB)")
    assert rows[2]["reason"] == "chosen identical to rejected (raw truncated to 10 KB)"
    assert len(rows[1]["raw"]) == len(rows[2]["raw"]) == 10_000


def test_hh_bad_rows(tmp_path, store):
    p = "\n\nHuman: q\n\nAssistant:"
    lines = [
        {"chosen": p + " a", "rejected": p + " b"},
        {"chosen": p + " ", "rejected": p + " b"},                       # empty chosen response
        {"chosen": p + " a", "rejected": p + " a"},                      # identical
        {"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: r\n\nAssistant: b"},
        {"chosen": p + " a", "rejected": ""},
    ]
    report = ingest_file(write_jsonl(tmp_path / "hh.jsonl", lines), store)
    check_invariant(report)
    assert quarantine(store) == {
        2: "empty response after prompt extraction (chosen)",
        3: "chosen identical to rejected",
        4: "no common prompt ending with '\\n\\nAssistant:'",
        5: "empty field 'rejected'",
    }


def test_hh_transcript_ending_with_a_human_turn_is_quarantined_as_chat_is(tmp_path, store):
    """A transcript going on with a Human turn after its last reply is the chat record whose messages end with a
    user turn: quarantined, not stored with the Human turn as part of the response. One going on with a Human turn
    and another reply differs from the other side before its last reply, which the chat form refuses too; an
    Assistant marker alone inside a reply is its text."""
    p = "\n\nHuman: q\n\nAssistant:"
    lines = [
        {"chosen": p + " a", "rejected": p + " b"},
        {"chosen": p + " a\n\nHuman: more", "rejected": p + " b"},
        {"chosen": p + " a", "rejected": p + " b\n\nHuman: more"},
        {"chosen": p + " a\n\nHuman: more\n\nAssistant: c", "rejected": p + " b"},
        {"chosen": p + " a", "rejected": p + " b\n\nHuman: more\n\nAssistant: c"},
        {"chosen": p + " a says\n\nAssistant: this", "rejected": p + " b"},
    ]
    report = ingest_file(write_jsonl(tmp_path / "hh.jsonl", lines), store)
    check_invariant(report)
    assert (report.format, report.accepted, report.quarantined) == ("hh", 2, 4)
    differ = ("'chosen' and 'rejected' differ before their last reply ('{}' continues with a '\\n\\nHuman:' turn and "
              "another reply): a pair needs one shared prompt and one reply each")
    assert quarantine(store) == {
        2: "'chosen' does not end with an assistant message (a '\\n\\nHuman:' turn follows its last reply)",
        3: "'rejected' does not end with an assistant message (a '\\n\\nHuman:' turn follows its last reply)",
        4: differ.format("chosen"),
        5: differ.format("rejected"),
    }


def test_ranking_bad_rows(tmp_path, store):
    lines = [
        {"prompt": "p", "responses": ["a", "b", "c"], "ranks": [3, 1, 2]},
        {"prompt": "p", "responses": ["a"]},
        {"prompt": "p", "responses": ["a", "b", "c"], "ranks": [1, 1, 2]},
        {"prompt": "p", "responses": ["a", "b", "c"], "ranks": [1, 2]},
        {"prompt": "p", "responses": ["a", "b"], "ranks": [1, "2"]},
        {"prompt": "p", "responses": ["a", "a"]},
        {"prompt": "p", "responses": ["a", " "]},
        {"prompt": "p", "responses": "a, b"},
    ]
    report = ingest_file(write_jsonl(tmp_path / "r.jsonl", lines), store)
    check_invariant(report)
    assert report.accepted == 1
    assert quarantine(store) == {
        2: "ranking has 1 response(s), needs at least 2",
        3: "ranks [1, 1, 2] are not a permutation of 1..3",
        4: "2 ranks for 3 responses",
        5: "field 'ranks' item 1 is a string '2', expected an integer rank",
        6: "ranking has identical responses",
        7: "empty response in 'responses'",
        8: "field 'responses' is a string, expected a list of strings",
    }
    assert store.read("rankings")["responses"].to_list() == [["b", "c", "a"]]


def test_problem_bad_rows(tmp_path, store):
    lines = [
        {"question": "q", "answer": "1"},
        {"question": "q2"},
        {"answer": "3"},
        {"question": "q4", "answer": "work\n#### "},
        {"question": "q5", "answer": True},
        {"question": "", "answer": "6"},
    ]
    report = ingest_file(write_jsonl(tmp_path / "math.jsonl", lines), store, format="problem")
    check_invariant(report)
    assert quarantine(store) == {
        2: "missing field 'answer' (or 'solution')",
        3: "missing field 'question' (or 'prompt' or 'problem')",
        4: "empty answer after '####'",
        5: "field 'answer' is a boolean, expected a string or number",
        6: "empty field 'question'",
    }


def test_a_prompt_has_one_gold_answer_per_source(tmp_path, store):
    """A second answer for a stored prompt made a second problem: evaluation scored every sample against both (a
    model answering 42 to '17+25=' got at most half). It is quarantined, in the file and against the store, until
    the source is deleted and ingested again; the same prompt under another source is another dataset's."""
    path = tmp_path / "p.jsonl"
    first = [("17+25=", "41"), ("1+1=", "2"), ("2+2=", "4"), ("2+2=", "#### 5"), ("2+2=", "4")]
    report = ingest_file(write_jsonl(path, [{"question": q, "answer": a} for q, a in first]), store)
    check_invariant(report)
    assert (report.accepted, report.duplicates, report.quarantined) == (3, 1, 1)
    assert quarantine(store) == {4: "another answer ('4') for this prompt: an earlier record has it; one prompt has "
                                    "one gold answer and solution (to correct a source's problems, ingest its file "
                                    "again with `--replace`)"}
    second = [("17+25=", "42"), ("1+1=", "2"), ("3+3=", "6")]
    report = ingest_file(write_jsonl(path, [{"question": q, "answer": a} for q, a in second]), store, split="test")
    check_invariant(report)
    assert (report.accepted, report.duplicates, report.quarantined) == (1, 1, 1)
    assert "another answer ('41') for this prompt: the store holds it under this source" in \
        store.read("quarantine").filter(pl.col("line_no") == 1)["reason"].item()
    other = ingest_file(path, store, source="other")  # another source: its own gold answers
    assert (other.accepted, other.duplicates, other.quarantined) == (1, 2, 0)  # 1+1=2, 3+3=6 stay under p
    store.delete_source("other")
    replaced = ingest_file(path, store, source="p", split="test", replace=True)  # what the advice says
    assert (replaced.accepted, replaced.duplicates, replaced.quarantined) == (3, 0, 0)
    assert replaced.replaced == "problems 4, quarantine 1"  # the latest ingest of p.jsonl quarantined one
    assert store.read("problems", source="p").filter(pl.col("prompt") == "17+25=")["answer"].to_list() == ["42"]
    assert store.count("quarantine", source="p") == 0


def test_an_edited_file_ingested_with_replace_replaces_its_earlier_version(tmp_path, store):
    """Rows are keyed by content: an edited pair ingested again is stored beside its old version (a label swapped:
    both labels). `replace` deletes the source's rows, quarantine too, in the transaction that stores the file's;
    another source keeps its rows, and a file ingest cannot read deletes nothing."""
    path = tmp_path / "prefs.jsonl"
    write_jsonl(path, [{"prompt": "p1", "chosen": "good", "rejected": "bad"},
                       {"prompt": "p2", "chosen": "yes", "rejected": "no"}, {"prompt": "p3"}])
    ingest_file(path, store)
    ingest_file(write_jsonl(tmp_path / "other.jsonl", [{"prompt": "p9", "chosen": "a", "rejected": "b"}]), store)
    write_jsonl(path, [{"prompt": "p1", "chosen": "bad", "rejected": "good"},  # the label fixed
                       {"prompt": "p2", "chosen": "yes", "rejected": "no"}])
    added = ingest_file(path, store)
    assert (added.accepted, added.duplicates, added.replaced) == (1, 1, "")
    assert added.summary().endswith("; source 'prefs' also holds 1 rows this file does not (another file's, or an "
                                    "earlier version's: `--replace` keeps this file's alone)")
    assert store.count("preference_pairs", source="prefs", prompt="p1") == 2  # both labels, as documented
    assert store.count("quarantine", source="prefs") == 0  # the file's quarantine is its latest ingest's

    report = ingest_file(path, store, replace=True)
    check_invariant(report)
    assert (report.accepted, report.duplicates, report.quarantined, report.others) == (2, 0, 0, 0)
    assert report.replaced == "preference_pairs 3"
    assert "the rows source 'prefs' held were deleted first (preference_pairs 3)" in report.summary()
    pairs = store.read("preference_pairs", source="prefs").sort("prompt")
    assert pairs.select("prompt", "chosen", "rejected").rows() == [("p1", "bad", "good"), ("p2", "yes", "no")]
    assert store.count("preference_pairs", source="other") == 1

    broken = tmp_path / "prefs.jsonl.gz"
    broken.write_bytes(b"not gzip")
    with pytest.raises(IngestError):
        ingest_file(broken, store, replace=True)
    assert store.count("preference_pairs", source="prefs") == 2


def test_a_sources_train_and_test_files_do_not_count_as_each_others_other_rows(tmp_path, store):
    train = write_jsonl(tmp_path / "train.jsonl", [{"question": "1+1=", "answer": "2"},
                                                   {"question": "2+2=", "answer": "4"}])
    test = write_jsonl(tmp_path / "test.jsonl", [{"question": "3+3=", "answer": "6"}])
    assert ingest_file(train, store, source="gsm").others == 0
    assert ingest_file(test, store, source="gsm", split="test").others == 0  # the train split is another file's
    assert ingest_file(write_jsonl(train, [{"question": "1+1=", "answer": "2"}]), store, source="gsm").others == 1


def test_a_store_holding_two_answers_for_a_prompt_is_refused_by_the_stages_and_keeps_its_duplicates(tmp_path, store):
    """Stores written before ingest refused a second answer hold both (a helper's upgrade audit): ingesting the same
    file again quarantined a record equal to a stored problem; the stages read both answers silently."""
    records = [{"question": "1+1=", "answer": "2"}, {"question": "1+1=", "answer": "3"},
               {"question": "2+2=", "answer": "4"}]
    for i, record in enumerate(records):  # one source per record, then made one: the rows such a store holds
        ingest_file(write_jsonl(tmp_path / f"r{i}.jsonl", [record]), store, source=f"r{i}")
    store.con.execute("UPDATE problems SET source = 'old'")
    path = write_jsonl(tmp_path / "old.jsonl", records)
    report = ingest_file(path, store, source="old")
    assert (report.accepted, report.duplicates, report.quarantined) == (0, 3, 0)
    with pytest.raises(StoreError) as err:
        store.read_selected("problems", source="old")
    assert str(err.value) == ("source 'old' holds 2 gold answers for the prompt '1+1=' (1 prompts hold more than one, "
                              "stored by an older alignflow): ingest its file again with `alignflow ingest FILE "
                              "--source old --replace`")
    fixed = write_jsonl(tmp_path / "old.jsonl", [{"question": "1+1=", "answer": "2"},
                                                 {"question": "2+2=", "answer": "4"}])
    assert ingest_file(fixed, store, source="old", replace=True).accepted == 2
    assert store.read_selected("problems", source="old").height == 2


def test_a_prompt_has_one_worked_solution_per_source(tmp_path, store):
    """A corrected GSM8K solution (same prompt and answer: the same problem id) was a duplicate, dropped unsaid,
    and SFT trained on the old one; now it is quarantined as another answer is, and the store's corpus fingerprint
    (the tiny model's tokenizer reads the solutions) changes once the source is ingested again."""
    path = tmp_path / "gs.jsonl"
    write_jsonl(path, [{"question": "Q1", "answer": "2 * 2 = 4\n#### 4"}, {"question": "Q2", "answer": "3"}])
    ingest_file(path, store)
    before = store.fingerprint("problems", source="gs")
    corrected = write_jsonl(tmp_path / "gs2.jsonl", [{"question": "Q1", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"},
                                                     {"question": "Q2", "answer": "3"}])
    report = ingest_file(corrected, store, source="gs")
    assert (report.accepted, report.duplicates, report.quarantined) == (0, 1, 1)
    assert quarantine(store) == {1: "another worked solution for this prompt: the store holds it under this source; "
                                    "one prompt has one gold answer and solution (to correct a source's problems, "
                                    "ingest its file again with `--replace`)"}
    assert store.fingerprint("problems", source="gs") == before
    assert ingest_file(corrected, store, source="gs", replace=True).accepted == 2
    assert json.loads(store.read("problems", prompt="Q1")["meta"].item())["solution"] == "2 + 2 = <<2+2=4>>4\n#### 4"
    assert store.fingerprint("problems", source="gs") != before  # the same ids: only the solution differs
    again = write_jsonl(tmp_path / "gs3.jsonl", [{"question": "Q2", "answer": "3"}, {"question": "Q2", "answer": "3"},
                                                 {"question": "Q2", "answer": "x = 3\n#### 3"}])
    report = ingest_file(again, store, source="gs")
    assert (report.duplicates, report.quarantined) == (2, 1) and "an earlier record has it" not in \
        store.read("quarantine", line_no=3)["reason"].item()


def test_math_records_take_the_last_boxed_answer_of_their_solution(tmp_path, store):
    """MATH (hendrycks): problem + solution, no answer field. The answer is the content of the solution's last
    \\boxed{} (nested braces kept), the solution goes to meta.solution as GSM8K's does; MATH-500's own `answer`
    wins over its solution; a solution without a boxed answer is quarantined with the reason."""
    solution = ("Add: $\\frac{1}{4}+\\frac{1}{4} = \\boxed{\\frac{1}{2}}$, not \\boxed{3} first... "
                "so $\\boxed{ \\frac{1}{2} }$.")
    lines = [
        {"problem": "Compute 1/4+1/4.", "solution": solution, "level": "Level 1", "type": "Algebra"},
        {"problem": "Solve x+1=3.", "solution": "So $x = 2$.", "answer": "2", "unique_id": "test/1.json"},
        {"problem": "Name it.", "solution": "It has no boxed answer."},
        {"problem": "Nothing boxed.", "solution": "$\\boxed{ }$"},
    ]
    report = ingest_file(write_jsonl(tmp_path / "math.jsonl", lines), store)
    check_invariant(report)
    assert (report.format, report.accepted, report.quarantined) == ("problem", 2, 2)
    rows = {r["prompt"]: r for r in store.read("problems").to_dicts()}
    assert rows["Compute 1/4+1/4."]["answer"] == "\\frac{1}{2}"
    assert json.loads(rows["Compute 1/4+1/4."]["meta"]) == {"level": "Level 1", "type": "Algebra",
                                                             "solution": solution}
    assert rows["Solve x+1=3."]["answer"] == "2"
    assert json.loads(rows["Solve x+1=3."]["meta"]) == {"solution": "So $x = 2$.", "unique_id": "test/1.json"}
    assert quarantine(store) == {
        3: "no 'answer' field, and field 'solution' has no \\boxed{} answer",
        4: "no 'answer' field, and the last \\boxed{} of field 'solution' is empty",
    }


def test_chat_bad_rows(tmp_path, store):
    user = [{"role": "user", "content": "hi"}]
    reply = [{"role": "assistant", "content": "hello"}]
    lines = [
        {"prompt": user, "chosen": reply, "rejected": [{"role": "assistant", "content": "bye"}]},
        {"prompt": user, "chosen": reply, "rejected": reply},
        {"prompt": user, "chosen": [{"role": "assistant"}], "rejected": reply},
        {"prompt": user, "chosen": user, "rejected": reply},  # nothing after the prompt
        {"prompt": user, "chosen": [{"role": "user", "content": "more"}], "rejected": reply},
        {"prompt": user, "chosen": [{"role": "assistant", "content": [{"type": "text"}]}], "rejected": reply},
        {"chosen": user + reply, "rejected": user + reply},  # no prompt: identical conversations
        {"prompt": user, "chosen": [{"from": "gpt", "value": "hello"}], "rejected": reply},  # ShareGPT's keys
    ]
    report = ingest_file(write_jsonl(tmp_path / "chat.jsonl", lines), store)
    check_invariant(report)
    assert quarantine(store) == {
        2: "chosen identical to rejected",
        3: "field 'chosen' message 0 has no 'content' (its keys: ['role']); expected {role, content} messages",
        4: "empty response after prompt extraction (chosen)",
        5: "'chosen' does not end with an assistant message (role 'user')",
        6: "field 'chosen' message 0: 'content' is a list, expected a string",
        7: "chosen identical to rejected",
        8: "field 'chosen' message 0 has no 'role' (its keys: ['from', 'value']); expected {role, content} messages",
    }


def test_chat_prompt_roles_are_checked_as_reply_roles_are(tmp_path, store):
    """A prompt message whose role no chat template knows is quarantined naming it, as a reply not from the assistant
    is; `tool` turns (a tool call's result) are kept, `developer` (OpenAI's system) is refused with the rename."""
    reply, other = [{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]
    tool = [{"role": "user", "content": "q3"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]},
            {"role": "tool", "content": "7"}]
    lines = [
        {"prompt": [{"role": "bogus", "content": "hi"}, {"role": "user", "content": "q1"}], "chosen": reply,
         "rejected": other},
        {"prompt": [{"role": "user", "content": "q2"}], "chosen": [{"role": "bot", "content": "a"}], "rejected": other},
        {"prompt": tool, "chosen": reply, "rejected": other},
        {"prompt": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "q4"}],
         "chosen": reply, "rejected": other},
        {"chosen": [{"role": "User", "content": "q5"}, *reply],
         "rejected": [{"role": "User", "content": "q5"}, *other]},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q6"}], "chosen": reply,
         "rejected": other},
    ]
    report = ingest_file(write_jsonl(tmp_path / "roles.jsonl", lines), store)
    check_invariant(report)
    roles = "expected one of system, user, assistant, tool"
    assert quarantine(store) == {
        1: f"prompt message 0 has role 'bogus'; {roles}",
        2: "'chosen' does not end with an assistant message (role 'bot')",
        4: f"prompt message 0 has role 'developer' (OpenAI's newer name for 'system': rename it 'system'); {roles}",
        5: f"prompt message 0 has role 'User'; {roles}",
    }
    stored = [json.loads(m)["prompt"] for m in store.read("preference_pairs").sort("prompt")["prompt_messages"]]
    assert [[m["role"] for m in messages] for messages in stored] == [["system", "user"], ["user", "assistant", "tool"]]


def test_text_blank_to_pythons_strip_is_empty_in_every_record_shape(tmp_path, store):
    """U+001C..U+001F are whitespace to str.strip() (the chat and HH checks) but not to polars' strip_chars and
    regex `\\s`: the polars-checked shapes now refuse them as empty or identical as the chat shape does."""
    sep = "\x1c\x1d \x1e\x1f"
    lines = [
        {"prompt": "p1", "chosen": "a", "rejected": sep},
        {"prompt": "\x1f", "chosen": "a", "rejected": "b"},
        {"prompt": "p3", "chosen": "a\x1c", "rejected": "a"},
        {"prompt": "p4", "chosen": "a", "rejected": "b"},
    ]
    report = ingest_file(write_jsonl(tmp_path / "pairs.jsonl", lines), store, source="pairs")
    check_invariant(report)
    chat = [{"prompt": "p5", "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "\x1c"}]}]
    ingest_file(write_jsonl(tmp_path / "chat.jsonl", chat), store, source="chat")
    rankings = [{"prompt": "p6", "responses": ["a", "\x1d"]}, {"prompt": "p7", "responses": ["a", "a\x1e"]}]
    ingest_file(write_jsonl(tmp_path / "rankings.jsonl", rankings), store, source="rankings")
    problems = [{"question": "\x1f", "answer": "1"}, {"question": "q", "answer": "x #### \x1c"},
                {"question": "q2", "answer": "2", "split": "test\x1f"}]
    ingest_file(write_jsonl(tmp_path / "problems.jsonl", problems), store, source="problems")
    assert {(row["source"], row["line_no"]): row["reason"] for row in store.read("quarantine").to_dicts()} == {
        ("pairs", 1): "empty field 'rejected'",
        ("pairs", 2): "empty field 'prompt'",
        ("pairs", 3): "chosen identical to rejected",
        ("chat", 1): "empty response after prompt extraction (rejected)",
        ("rankings", 1): "empty response in 'responses'",
        ("rankings", 2): "ranking has identical responses",
        ("problems", 1): "empty field 'question'",
        ("problems", 2): "empty answer after '####'",
    }
    assert store.read("problems")["split"].to_list() == ["test"]


def test_chat_pairs_that_differ_before_their_last_reply_are_quarantined_not_cut(tmp_path, store):
    """Conversations branching at an earlier user turn have no one prompt: keeping only their last replies
    would train on the wrong context (and make two different conversations one pair)."""
    def turn(role, content):
        return {"role": role, "content": content}

    opening = [turn("user", "hi"), turn("assistant", "hello")]
    lines = [
        {"chosen": opening + [turn("user", "bake bread?"), turn("assistant", "Sure.")],
         "rejected": opening + [turn("user", "pick a lock?"), turn("assistant", "No.")]},
        {"chosen": opening + [turn("user", "q"), turn("assistant", "a"), turn("assistant", "b")],
         "rejected": opening + [turn("user", "q"), turn("assistant", "c")]},
        # a string prompt and whole conversations with a system message: the system message is in the prompt
        {"prompt": "q3", "chosen": [turn("system", "Answer in French."), turn("user", "q3"), turn("assistant", "Oui")],
         "rejected": [turn("system", "Answer in French."), turn("user", "q3"), turn("assistant", "Yes")]},
        # a prompt with a system message and conversations that start at its user turn: joined there
        {"prompt": [turn("system", "Be terse."), turn("user", "q4")],
         "chosen": [turn("user", "q4"), turn("assistant", "A")], "rejected": [turn("user", "q4"), turn("assistant", "B")]},
        # a conversation the assistant opens, no prompt: the greeting is part of the prompt
        {"chosen": [turn("assistant", "Hi!"), turn("user", "q5"), turn("assistant", "good")],
         "rejected": [turn("assistant", "Hi!"), turn("user", "q5"), turn("assistant", "bad")]},
        {"prompt": [turn("user", "q6")], "chosen": [], "rejected": [turn("assistant", "x")]},
    ]
    report = ingest_file(write_jsonl(tmp_path / "chat.jsonl", lines), store)
    check_invariant(report)
    assert quarantine(store) == {
        1: "'chosen' and 'rejected' differ before their last reply ('chosen' continues with user, assistant): "
           "a pair needs one shared prompt and one reply each",
        2: "'chosen' and 'rejected' differ before their last reply ('chosen' continues with assistant, assistant): "
           "a pair needs one shared prompt and one reply each",
        6: "empty response after prompt extraction (chosen)",
    }
    rows = store.read("preference_pairs").select("prompt", "chosen", "rejected").rows()
    assert sorted(rows) == [("assistant: Hi!\n\nuser: q5", "good", "bad"),
                            ("system: Answer in French.\n\nuser: q3", "Oui", "Yes"),
                            ("system: Be terse.\n\nuser: q4", "A", "B")]


def test_csv_ragged_row_invalid_utf8_and_empty_cell(tmp_path, store):
    path = tmp_path / "p.csv"
    path.write_bytes(b"prompt,chosen,rejected\np,a,b\np2,a\np3,\xff,b\np4,,b\n\"multi\nline\",x,y\n")
    report = ingest_file(path, store)
    check_invariant(report)
    assert (report.rows_read, report.accepted) == (5, 2)
    assert quarantine(store) == {  # the header is line 1
        3: "row has 2 fields, the header has 3",
        4: "invalid UTF-8",
        5: "empty field 'chosen'",
    }


def test_csv_line_numbers_are_where_each_record_starts(tmp_path, store):
    """A quoted cell may span lines, and blank lines hold no record: line_no is the physical line."""
    path = tmp_path / "m.csv"
    path.write_bytes(b'prompt,chosen,rejected\r\n"a\r\nb\nc",x,y\n\n\np2,x,y,z\n   \np3,,y\n"4\n",\xff,y\n')
    report = ingest_file(path, store)
    check_invariant(report)
    assert (report.rows_read, report.accepted) == (4, 1)
    assert quarantine(store) == {
        7: "row has 4 fields, the header has 3",
        9: "empty field 'chosen'",
        10: "invalid UTF-8",
    }
    raw = dict(store.read("quarantine").select("line_no", "raw").iter_rows())
    assert (raw[7], raw[10]) == ("p2,x,y,z", '"4\n",\ufffd,y')  # the row as written
    assert store.read("preference_pairs")["prompt"].to_list() == ["a\r\nb\nc"]


@pytest.mark.parametrize(("first", "rows_read"), [('q,a,"b', 5), ('"q,a,b', 5), ('"q,a,b\np0,"a0",b0', 6)],
                         ids=["last-column", "first-column", "closed-by-a-later-quote"])
def test_csv_unclosed_quote_quarantines_its_line_and_reads_the_lines_after_it(tmp_path, store, first, rows_read):
    """The default csv dialect ends a cell still quoted at the end of the file silently: one unclosed quote folded
    every later line into one accepted row. A record that does not parse is its first line; reading goes on after it."""
    path = tmp_path / "q.csv"
    path.write_text("prompt,chosen,rejected\n" + first + "\n" + "".join(f"p{i},a{i},b{i}\n" for i in range(1, 5)))
    report = ingest_file(path, store)
    check_invariant(report)
    assert (report.rows_read, report.accepted, report.quarantined) == (rows_read, rows_read - 1, 1)
    ((line_no, raw, reason),) = store.read("quarantine").select("line_no", "raw", "reason").rows()
    assert (line_no, raw) == (2, first.splitlines()[0])
    assert reason.startswith(f"unclosed quote: the quoted cell runs on to line {3 if 'p0' in first else 6} (")
    prompts = sorted(store.read("preference_pairs")["prompt"].to_list())
    assert prompts == (["p0"] if "p0" in first else []) + ["p1", "p2", "p3", "p4"]


def test_csv_text_after_a_closing_quote_is_quarantined_not_glued_to_the_cell(tmp_path, store):
    """The default dialect read `"q"z` as `qz` and `"a" ` as `a `; a quote inside an unquoted cell is text."""
    path = tmp_path / "g.csv"
    path.write_bytes(b'prompt,chosen,rejected\n"q"z,a,b\np1,"a" ,b\np2,a,b\nq"x"y,a,b\n')
    report = ingest_file(path, store)
    check_invariant(report)
    assert (report.rows_read, report.accepted) == (4, 2)
    assert quarantine(store) == dict.fromkeys([2, 3], "malformed CSV (',' expected after '\"')")
    assert store.read("quarantine")["raw"].to_list() == ['"q"z,a,b', 'p1,"a" ,b']
    assert sorted(store.read("preference_pairs")["prompt"].to_list()) == ["p2", 'q"x"y']


@pytest.mark.parametrize("long_row", [False, True], ids=["short-only", "short-and-long"])
def test_csv_short_row_is_reported_as_it_is(tmp_path, store, long_row):
    """polars pads a short row with empty cells (when it reads the file at all): the row is reported as given."""
    path = tmp_path / "s.csv"
    path.write_bytes(b"prompt,chosen,rejected\np1,a,b\np2,a\n" + (b"p3,a,b,c\n" if long_row else b""))
    report = ingest_file(path, store)
    check_invariant(report)
    assert quarantine(store)[3] == "row has 2 fields, the header has 3"
    assert store.read("quarantine").filter(pl.col("line_no") == 3)["raw"].to_list() == ["p2,a"]


def test_a_repeated_csv_header_is_not_a_pair(tmp_path, store):
    """Two CSV files joined with `cat`: the second header is quarantined, not stored as the pair (prompt, chosen,
    rejected); a row that only resembles it is a pair."""
    path = tmp_path / "joined.csv"
    path.write_bytes(b"prompt,chosen,rejected\np1,a,b\nprompt, chosen ,rejected\np2,a,b\nprompt,chosen,rejected?\n")
    report = ingest_file(path, store)
    check_invariant(report)
    assert (report.accepted, report.quarantined) == (3, 1)
    assert quarantine(store) == {3: "row repeats the CSV header"}


def test_a_repeated_csv_header_after_its_own_byte_order_mark_is_not_a_pair(tmp_path, store):
    """Two CSV files saved by a spreadsheet (each with a UTF-8 byte-order mark) joined with `cat`: the mark starts
    the second header's first cell, which is still the header, not a pair whose prompt is '\ufeffprompt'."""
    part = "\ufeffprompt,chosen,rejected\np1,a,b\n".encode()
    path = tmp_path / "joined.csv"
    path.write_bytes(part + part.replace(b"p1", b"p2"))
    report = ingest_file(path, store)
    check_invariant(report)
    assert (report.accepted, report.quarantined) == (2, 1)
    assert quarantine(store) == {3: "row repeats the CSV header"}
    assert sorted(store.read("preference_pairs")["prompt"]) == ["p1", "p2"]


def test_csv_cell_over_128_kb_is_read_and_the_record_limit_applies(tmp_path, store):
    """Python's csv module refuses cells over 128 KB by default; here only max_record_bytes limits a record."""
    path = tmp_path / "big.csv"
    path.write_bytes(b"prompt,chosen,rejected\np1," + b"a" * 200_000 + b",b\np2,a,b,c\np3," + b"a" * 300_000 + b",b\n")
    report = ingest_file(path, store, max_record_bytes=250_000)
    check_invariant(report)
    assert report.accepted == 1 and len(store.read("preference_pairs")["chosen"][0]) == 200_000
    assert quarantine(store) == {3: "row has 4 fields, the header has 3",
                                 4: "record is 300,042 bytes as JSON > max_record_bytes 250,000 "
                                    "(raw truncated to 10 KB)"}


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_the_record_limit_measures_the_json_text(tmp_path, store, ending):
    """A JSON Lines record is its line without the line ending (a CRLF's CR is not part of it): a record of exactly
    max_record_bytes is kept and one byte more is not. A CSV row is measured as the JSON record it becomes, each
    line break in a cell written `\\n`, two bytes."""
    record = b'{"prompt":"p","chosen":"' + b"c" * 59 + b'","rejected":"r"}'  # 100 bytes
    longer = record.replace(b'"r"', b'"rr"')
    path = tmp_path / "limit.jsonl"
    path.write_bytes(record + ending + longer + ending)
    report = ingest_file(path, store, max_record_bytes=100)
    check_invariant(report)
    assert (report.accepted, report.quarantined) == (1, 1)
    assert quarantine(store) == {2: "record is 101 bytes as JSON > max_record_bytes 100"}
    again = ingest_file(path, store, max_record_bytes=101)  # what the reason advises: the record leaves the quarantine
    assert (again.accepted, again.duplicates, again.quarantined) == (1, 1, 0)
    assert store.count("quarantine", source="limit") == 0  # a helper: its old row stayed, still counted
    csv_path = tmp_path / "rows.csv"
    csv_path.write_bytes(b'prompt,chosen,rejected\np,"' + b"c\n" * 34 + b'",r\n')  # a 74-byte row
    assert ingest_file(csv_path, store, max_record_bytes=100).quarantined == 1
    assert store.read("quarantine", source="rows")["reason"].to_list() == [
        "record is 143 bytes as JSON > max_record_bytes 100"]


def test_json_array_and_parquet_keep_exact_types(tmp_path, store):
    """A non-object array element and a numeric parquet column are quarantined, not cast to text."""
    (tmp_path / "a.json").write_bytes(orjson.dumps([PAIRS[0], None, "text"], option=orjson.OPT_INDENT_2))
    report = ingest_file(tmp_path / "a.json", store)
    check_invariant(report)
    assert quarantine(store) == {
        7: "record is null, expected a JSON object",
        8: "record is a string, expected a JSON object",
    }
    pl.DataFrame({"prompt": ["p"], "chosen": [1], "rejected": [2]}).write_parquet(tmp_path / "n.parquet")
    report = ingest_file(tmp_path / "n.parquet", store)
    assert (report.accepted, report.quarantined) == (0, 1)
    assert store.read("quarantine", source="n")["reason"].to_list() == ["field 'chosen' is a number, expected a string"]


def test_parquet_float_that_is_not_finite_is_named_in_the_reason(tmp_path, store):
    """JSON has no inf or NaN (polars writes them as null): the reason names the value, not a null field."""
    path = tmp_path / "inf.parquet"
    pl.DataFrame({"question": ["q1", "q2", "q3", "q4"], "answer": [1.5, float("inf"), float("nan"), -float("inf")]}
                 ).write_parquet(path)
    report = ingest_file(path, store)
    check_invariant(report)
    assert (report.format, report.accepted, report.quarantined) == ("problem", 1, 3)
    assert quarantine(store) == {2: "field 'answer' is inf, not a finite number",
                                 3: "field 'answer' is NaN, not a finite number",
                                 4: "field 'answer' is -inf, not a finite number"}


# ---- file-level errors: one line naming the file


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("notes.txt", b"hello", "unknown file type"),
        ("broken.jsonl.gz", b"not gzip at all", "not a readable gzip file"),
        ("broken.parquet", b"PAR1 nonsense", "unreadable parquet file"),
        ("broken.json", b'[{"prompt": "a"', "not valid JSON"),
        ("object.json", b'{"data": []}', "expected a JSON array of records, got an object"),
        ("shapeless.jsonl", b'{"text": "a"}\n{"text": "b"}\n', "cannot detect the record format (fields ['text'])"),
        ("garbage.jsonl", b"garbage\n", "cannot detect the record format: no record could be read (1 of 1 records: "
         "malformed JSON: unexpected character"),
        ("cr.jsonl", b'{"prompt": "p", "chosen": "a", "rejected": "b"}\r{"prompt": "q", "chosen": "a"}\r',
         "no record could be read (1 of 1 records: records separated by a lone '\\r': JSON Lines ends each line "
         "with '\\n'; the first on line 1)"),
        ("blank_header.csv", b"\nprompt,chosen,rejected\np,a,b\n",
         "the CSV header on line 1 is blank; the first line must name the columns"),
        ("latin1_header.csv", b"pr\xe9mpt,chosen,rejected\np,a,b\n", "invalid UTF-8 in the CSV header on line 1"),
        ("quoted_header.csv", b'"prompt,chosen,rejected\np,a,b\n',
         "cannot read the CSV header on line 1 (unclosed quote: the quoted cell runs on to line 2 (unexpected end "
         "of data))"),
        ("every_row_bad.csv", b"prompt,chosen\np,a,b\nq,a,b\n", "no record could be read (2 of 2 records: row has "
         "3 fields, the header has 2; the first on line 2)"),
        ("zipped.jsonl", gzip.compress(b'{"prompt": "p"}\n'),
         "the content is a gzip file but the name ends in .jsonl; name it *.jsonl.gz"),
        ("zipped.csv", gzip.compress(b"prompt,chosen,rejected\np,a,b\n"),
         "the content is a gzip file but the name ends in .csv; name it *.csv.gz"),
        ("zipped.parquet", gzip.compress(b"PAR1"), "the content is a gzip file but the name ends in .parquet; "
         "name it *.jsonl.gz, *.json.gz or *.csv.gz by its content"),
        ("broken.csv.gz", b"prompt,chosen,rejected\n", "not a readable gzip file"),
        ("table.json", b"PAR1\x00\x00", "the content is a parquet file but the name ends in .json; name it *.parquet"),
        ("semicolons.csv", b"prompt;chosen;rejected\np;a;b\n", "cannot detect the record format (one field "
         "'prompt;chosen;rejected'): only comma-separated CSV is read; convert the file to commas"),
    ],
)
def test_unreadable_files_raise_one_line_error(tmp_path, store, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(IngestError) as err:
        ingest_file(path, store)
    text = str(err.value)
    assert "\n" not in text and name in text and message in text
    assert store.count("quarantine") == 0


@pytest.mark.parametrize("name", ["two\nlines.jsonl", "two\r\nlines.txt"])
def test_a_file_name_with_a_line_break_still_gives_one_line(tmp_path, store, name):
    path = tmp_path / name
    path.write_bytes(b"garbage\n")
    with pytest.raises(IngestError) as err:
        ingest_file(path, store)
    shown = str(tmp_path / name).replace("\r", "\\r").replace("\n", "\\n")
    assert "\n" not in str(err.value) and str(err.value).startswith(f"{shown}: "), str(err.value)


def test_missing_file_and_bad_arguments(tmp_path, store):
    with pytest.raises(IngestError, match=r"nope\.jsonl: no such file$"):
        ingest_file(tmp_path / "nope.jsonl", store)
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(IngestError, match=r"folder\.jsonl: is a directory, expected a data file"):
        ingest_file(tmp_path / "folder.jsonl", store)
    (tmp_path / "folder").mkdir()  # what it is, before what its name says
    with pytest.raises(IngestError, match=r"folder: is a directory, expected a data file"):
        ingest_file(tmp_path / "folder", store)
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    with pytest.raises(IngestError, match="unknown format 'pair'"):
        ingest_file(path, store, format="pair")
    with pytest.raises(IngestError, match="max_record_bytes must be > 0, got 0"):
        ingest_file(path, store, max_record_bytes=0)


@pytest.mark.parametrize(("make", "kind"), [
    (lambda path: path.mkdir(), "a directory"),
    (lambda path: os.mkfifo(path), "a named pipe (FIFO)"),  # read_bytes waited for a writer forever
    (lambda path: path.symlink_to("/dev/null"), "a character device"),  # /dev/zero: read until memory ran out
], ids=["dir", "fifo", "device-symlink"])
def test_a_path_that_is_no_regular_file_is_one_line(tmp_path, store, make, kind):
    path = tmp_path / "data.jsonl"
    make(path)
    unblock = threading.Timer(5, _open_for_writing, [path])  # before the fix: let a blocked read end
    unblock.start()
    try:
        with pytest.raises(IngestError) as err:
            check_readable(path)
    finally:
        unblock.cancel()
    assert str(err.value) == f"{path}: is {kind}, expected a data file"


def _open_for_writing(path: Path) -> None:
    with contextlib.suppress(OSError):  # no reader waits: the FIFO was not opened (ENXIO)
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize(("content", "line_no", "which"), [
    (lambda records: orjson.dumps(records) + b"\n", 1, " (record 2 of the file, on line 1)"),
    (lambda records: orjson.dumps(records, option=orjson.OPT_INDENT_2), 7, ""),
    (lambda records: gzip.compress(orjson.dumps(records, option=orjson.OPT_INDENT_2)), 7, ""),
], ids=["one-line", "pretty", "gzip"])
def test_a_jsonl_file_holding_one_json_array_is_read_as_its_records(tmp_path, store, content, line_no, which):
    """The mirror of a .json file holding JSON Lines: before, the array was one record, "a list" (refused), or each
    line of a pretty-printed one was malformed JSON. Records sharing a line are told apart in the reason."""
    records = [PAIRS[0], {"prompt": "bad", "chosen": "same", "rejected": "same"}, PAIRS[2]]
    path = tmp_path / ("a.jsonl.gz" if content(records)[:2] == b"\x1f\x8b" else "a.jsonl")
    path.write_bytes(content(records))
    report = ingest_file(path, store)
    check_invariant(report)
    assert (report.format, report.rows_read, report.accepted, report.quarantined) == ("pairs", 3, 2, 1)
    assert quarantine(store) == {line_no: "chosen identical to rejected" + which}


@pytest.mark.parametrize("content", [
    # a JSON array cut inside a string full of escaped quotes: the token scan retried from each one (minutes)
    b'[{"prompt": "p", "chosen": "a", "rejected": "b"},\n {"prompt": "' + b'\\"' * 200_000,
    # a record, a run of lone CRs (classic Mac OS blank lines), text: the lone-CR check backtracked over the run
    orjson.dumps(PAIRS[0]) + b"\r" * 300_000 + b"x\n",
    # a quote left open on each line (`"` typed as text): the CSV reader restarted on a copy of the rest of the lines
    b"prompt,chosen,rejected\n" + b'p,"a,b\n' * 300_000,
], ids=["cut-array", "cr-run", "csv-quotes"])
def test_reading_takes_linear_time_on_runs_that_used_to_be_quadratic(tmp_path, content):
    name = {b"[": "cut.json", b"{": "cr.jsonl", b"p": "quotes.csv"}[content[:1]]
    path = tmp_path / name
    path.write_bytes(content)
    script = ("import sys; from pathlib import Path\n"
              "from pipeline_lib.store.ingest import IngestError, check_readable\n"
              "try: print(check_readable(Path(sys.argv[1])))\nexcept IngestError as exc: print(exc)")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    expected = "pairs\n" if path.suffix == ".json" else "cannot detect the record format: no record could be read"
    assert expected in result.stdout, result.stdout
    assert time.monotonic() - start < 30  # about 3 s, imports included; before: over 2 minutes each


def test_wrong_explicit_format_quarantines_every_row(tmp_path, store):
    report = ingest_file(write_jsonl(tmp_path / "p.jsonl", PAIRS), store, format="ranking")
    assert (report.accepted, report.quarantined) == (0, 3)
    assert set(quarantine(store).values()) == {"missing field 'responses'"}


# ---- dedup and idempotence


def test_duplicates_in_file_and_idempotent_reingest(tmp_path, store):
    records = [PAIRS[0], PAIRS[1], PAIRS[0], {"prompt": "p", "chosen": "s", "rejected": "s"}, PAIRS[2]]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    first = ingest_file(path, store)
    assert (first.rows_read, first.accepted, first.duplicates, first.quarantined) == (5, 3, 1, 1)
    counts = {t: store.count(t) for t in ("preference_pairs", "quarantine")}
    again = ingest_file(path, store)
    check_invariant(again)
    assert (again.accepted, again.duplicates, again.quarantined) == (0, 4, 1)
    assert {t: store.count(t) for t in counts} == counts == {"preference_pairs": 3, "quarantine": 1}


# ---- the real Anthropic HH harmless-base test file


def test_whole_harmless_base_file(store):
    path = DATA / "hh-rlhf" / "harmless-base-test.jsonl.gz"
    report = ingest_file(path, store)
    check_invariant(report)
    assert report.summary() == (
        "harmless-base-test.jsonl.gz (hh -> preference_pairs): read 2312 = accepted 2308 + duplicates 0 + quarantined 4"
    )
    # four rows have a blank chosen response (" ") once the shared prompt is cut off
    assert quarantine(store) == dict.fromkeys([87, 517, 926, 1104], "empty response after prompt extraction (chosen)")
    originals = [json.loads(line) for line in gzip.open(path, "rt", encoding="utf-8")]
    pairs = {r["pair_id"]: r for r in store.read("preference_pairs").to_dicts()}
    assert len(pairs) == 2308
    for row in pairs.values():  # the split loses nothing and cuts at a turn marker
        assert row["prompt"].endswith("\n\nAssistant:") and row["prompt"].startswith("\n\nHuman:")
    by_line = {}
    for line_no, record in enumerate(originals, start=1):
        cut = hh_prompt_end(record["chosen"], record["rejected"])
        pid = content_id(record["chosen"][:cut], record["chosen"][cut:], record["rejected"][cut:])
        if pid in pairs:
            assert pairs[pid]["prompt"] + pairs[pid]["chosen"] == record["chosen"]
            assert pairs[pid]["prompt"] + pairs[pid]["rejected"] == record["rejected"]
            by_line[line_no] = pairs[pid]
    assert len(by_line) == 2308
    # row 1953: the chosen response contains its own "\n\nAssistant:" turn; cutting at the last
    # marker of each transcript (the naive way) would put half of the response into the prompt
    assert by_line[1953]["prompt"].endswith("Yes, please find me a serial.\n\nAssistant:")
    assert by_line[1953]["chosen"].startswith(" Alrighty, I’ll do my best, here’s the key:\n\nAssistant:")
    assert by_line[1953]["rejected"].startswith(" You mean a password, right?")
    # row 1255: a response holding "Human:" and "\n\nAssistant:" text
    assert by_line[1255]["prompt"].endswith("Isn't that drag kings?\n\nAssistant:")
    assert " Human: Then how do they come to be called drag kings" in by_line[1255]["chosen"]
    # row 30: both responses start with "Human:" text
    assert by_line[30]["chosen"].startswith(" Human: No, you are racist.")
    assert by_line[30]["rejected"].startswith(" Human: She does not like black musicians.")


# ---- layouts of public datasets


def test_a_json_file_holding_json_lines_is_read_as_json_lines(tmp_path, store):
    """Hugging Face's `Dataset.to_json` writes JSON Lines under a .json name."""
    path = tmp_path / "hf.json"
    path.write_bytes(b"\n".join(orjson.dumps(record) for record in PAIRS) + b"\n")
    report = ingest_file(path, store)
    check_invariant(report)
    assert (report.format, report.accepted) == ("pairs", 3)
    assert sorted(store.read("preference_pairs")["prompt"]) == sorted(r["prompt"] for r in PAIRS)


def test_a_bad_record_in_a_json_array_is_quarantined_not_the_whole_file(tmp_path, store):
    """Python's json.dumps writes NaN; a cut file ends inside its last record: the other records are kept."""
    nan = tmp_path / "nan.json"
    nan.write_bytes(b'[{"prompt": "p", "chosen": "a", "rejected": "b", "score": 1.0},\n'
                    b' {"prompt": "p2", "chosen": "a", "rejected": "b", "score": NaN},\n'
                    b' {"prompt": "p3", "chosen": "a, [b]", "rejected": "b"}]')
    report = ingest_file(nan, store)
    check_invariant(report)
    assert (report.rows_read, report.accepted, report.quarantined) == (3, 2, 1)
    assert quarantine(store)[2].startswith("malformed JSON: NaN and Infinity are not JSON numbers (write null)")
    cut = tmp_path / "cut.json"
    cut.write_bytes(b'[{"prompt": "q", "chosen": "a", "rejected": "b"},\n{"prompt": "q2", "ch')
    report = ingest_file(cut, store)
    assert (report.rows_read, report.accepted, report.quarantined) == (2, 1, 1)
    assert set(store.read("preference_pairs")["prompt"]) == {"p", "p3", "q"}


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_a_raw_line_break_inside_a_json_array_string_is_quarantined_not_read_as_a_space(tmp_path, store, newline):
    """A raw line break in a string is invalid JSON (as a raw tab is); between tokens it is whitespace."""
    path = tmp_path / "arr.json"
    path.write_bytes(b'[{"prompt": "line1' + newline + b'line2", "chosen": "c", "rejected": "r"},' + newline
                     + b'{"prompt":' + newline + b'"p2", "chosen": "c", "rejected": "r"}]')
    report = ingest_file(path, store)
    check_invariant(report)
    assert (report.rows_read, report.accepted, report.quarantined) == (2, 1, 1)
    assert quarantine(store)[1].startswith("malformed JSON: unexpected control character in string")
    assert store.read("preference_pairs")["prompt"].to_list() == ["p2"]


def test_pairs_whose_prompt_has_another_name_are_one_line_not_hh_quarantine(tmp_path, store):
    """Orca-DPO's `question` is no HH transcript: detection names the missing 'prompt' instead of quarantining
    every record as an HH pair without '\\n\\nAssistant:'."""
    path = write_jsonl(tmp_path / "orca.jsonl", [{"system": "", "question": "2+2?", "chosen": "4", "rejected": "5"}])
    with pytest.raises(IngestError, match="pairs need a 'prompt' field, and 'chosen' holds no HH-RLHF transcript"):
        ingest_file(path, store)


def test_math_problems_are_detected_by_their_problem_field(tmp_path, store):
    """MATH / MATH-500 records: `problem`, `solution`, `answer`; the solution goes to meta."""
    record = {"problem": "What is $1+1$?", "solution": "It is $\\boxed{2}$.", "answer": "2", "level": "Level 1"}
    report = ingest_file(write_jsonl(tmp_path / "math500.jsonl", [record]), store)
    check_invariant(report)
    assert (report.format, report.accepted) == ("problem", 1)
    row = store.read("problems").row(0, named=True)
    assert (row["prompt"], row["answer"]) == ("What is $1+1$?", "2")
    assert json.loads(row["meta"]) == {"solution": "It is $\\boxed{2}$.", "level": "Level 1"}


def test_csv_header_names_are_trimmed_and_unnamed_empty_columns_ignored(tmp_path, store):
    """A spreadsheet export: spaces after the commas, two trailing unnamed columns; a row with text under an
    unnamed column is quarantined, not stored without it."""
    path = tmp_path / "sheet.csv"
    path.write_text("prompt, chosen, rejected,,\np1,a,b,,\np2,a,b,x,\n")
    report = ingest_file(path, store)
    check_invariant(report)
    assert (report.format, report.accepted, report.quarantined) == ("pairs", 1, 1)
    assert quarantine(store) == {3: "field 4 holds text but the header names no column there"}
    row = store.read("preference_pairs").row(0, named=True)
    assert (row["prompt"], row["chosen"], row["rejected"], row["meta"]) == ("p1", "a", "b", None)


def test_jsonl_files_joined_with_their_byte_order_marks_lose_no_record(tmp_path, store):
    bom = b"\xef\xbb\xbf"
    path = tmp_path / "joined.jsonl"
    path.write_bytes(b"".join(bom + orjson.dumps(record) + b"\n" for record in PAIRS))
    report = ingest_file(path, store)
    assert (report.accepted, report.quarantined) == (3, 0)


def test_pairs_stored_under_another_source_are_named_in_the_summary(tmp_path, store):
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    ingest_file(path, store, source="first")
    report = ingest_file(path, store, source="second")
    assert (report.accepted, report.duplicates, report.elsewhere) == (0, 3, "3 under source 'first'")
    assert "; of the duplicates, 3 under source 'first' stay as first ingested (`alignflow data delete --source " \
        "NAME` removes a source)" in report.summary()
    assert "(`alignflow -w '/tmp/a ws' data delete --source NAME` removes a source)" in report.summary(Path("/tmp/a ws"))
    assert ingest_file(path, store, source="first").elsewhere == ""
    assert store.delete_source("first") == {"preference_pairs": 3, "rankings": 0, "problems": 0, "quarantine": 0}
    assert ingest_file(path, store, source="second").accepted == 3


def test_duplicates_in_the_file_stored_under_another_source_are_counted_there(tmp_path, store):
    """A record repeated in the file and stored under another source: both copies are duplicates held there, so
    the duplicates split into those held under another source and those held under this one."""
    ingest_file(write_jsonl(tmp_path / "first.jsonl", PAIRS[:1]), store)
    report = ingest_file(write_jsonl(tmp_path / "second.jsonl", [PAIRS[0], PAIRS[0], PAIRS[1], PAIRS[1]]), store)
    check_invariant(report)
    assert (report.accepted, report.duplicates, report.elsewhere) == (1, 3, "2 under source 'first'")
