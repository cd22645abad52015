"""The demo data generator is deterministic and its shipped outputs are what it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data"


def test_generator_reproduces_shipped_files_byte_for_byte(tmp_path):
    subprocess.run([sys.executable, str(DATA / "generate.py"), "--out", str(tmp_path)], check=True, capture_output=True)
    for name in ("problems.jsonl", "arith_mixed.jsonl", "pairs.jsonl", "rankings.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / "demo" / name).read_bytes(), name


def test_demo_problems_have_correct_answers_and_splits():
    rows = [json.loads(line) for line in (DATA / "demo" / "problems.jsonl").open()]
    assert len(rows) == 10_000 and sum(r["split"] == "test" for r in rows) == 200
    for row in rows:
        a, b = row["prompt"].rstrip("=").split("+")
        assert int(row["answer"]) == int(a) + int(b)
    mixed = [json.loads(line) for line in (DATA / "demo" / "arith_mixed.jsonl").open()]
    for row in mixed:
        expression = row["prompt"].rstrip("=")
        op = next(c for c in "+-*" if c in expression[1:])
        a, b = expression.split(op, 1)
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert int(row["answer"]) == expected


def test_pairs_prefer_the_correct_answer_and_rankings_are_permutations():
    pairs = [json.loads(line) for line in (DATA / "demo" / "pairs.jsonl").open()]
    train = {json.loads(line)["prompt"] for line in (DATA / "demo" / "problems.jsonl").open()
             if json.loads(line)["split"] == "train"}
    for pair in pairs:
        a, b = pair["prompt"].rstrip("=").split("+")
        assert pair["chosen"] == str(int(a) + int(b)) != pair["rejected"]
        assert pair["prompt"] in train  # held-out problems never leak into preference data
    for row in (json.loads(line) for line in (DATA / "demo" / "rankings.jsonl").open()):
        assert sorted(row["ranks"]) == list(range(1, len(row["responses"]) + 1)) and len(row["responses"]) >= 3
        best = row["responses"][row["ranks"].index(1)]
        a, b = row["prompt"].rstrip("=").split("+")
        assert best == str(int(a) + int(b))
