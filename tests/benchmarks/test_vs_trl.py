"""Smoke test of benchmarks/vs_trl.py: two steps of DPO and GRPO on each side, so the script cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_trl.py"


@pytest.mark.slow
def test_vs_trl_prints_one_row_per_implementation():
    """DPO on the demo's answer-vs-answer pairs (`--pairs` is DPO's) and GRPO on the GSM8K prompts (`--data` is
    GRPO's), in one invocation."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", "1", "--threads", "1", "--steps", "2", "--warmup", "0",
         "--no-trl-precompute", "--data", "gsm8k", "--pairs", "answers",
         "--set", "pairs=64", "batch=4", "prompts=2", "group=2", "max_new_tokens=2"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith(("| DPO", "| GRPO"))]
    assert [row.split(" | ")[1] for row in rows] == [
        "alignflow train_dpo", "TRL DPOTrainer (precompute_ref_log_probs=False, the default)",
        "alignflow train_grpo (hf sampler)", "TRL GRPOTrainer (use_vllm=False)",
    ]
    for row in rows:
        step_ms = float(row.split(" | ")[2].split()[0])
        peak_mib = float(row.split(" | ")[6])
        assert step_ms > 0 and 100 < peak_mib < 8000
    assert "'data': 'gsm8k'" in out.split("grpo: ")[1] and "'data'" not in out.split("dpo: ")[1].splitlines()[0]
    assert "'pairs_kind': 'answers'" in out.split("dpo: ")[1].splitlines()[0] and "pairs_kind" not in \
        out.split("grpo: ")[1].splitlines()[0]


def test_dpo_pairs_mixed_are_the_first_ones_and_answers_leave_out_non_answer_rejections():
    import polars as pl

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from vs_trl import DEMO, dpo_pairs
    finally:
        sys.path.remove(str(SCRIPT.parent))
    demo = pl.read_ndjson(DEMO / "pairs.jsonl")
    mixed = dpo_pairs({"pairs": 100, "pairs_kind": "mixed"})
    assert mixed == demo.select("prompt", "chosen", "rejected").head(100).to_dicts()
    answers = dpo_pairs({"pairs": 100, "pairs_kind": "answers"})
    kept = demo.filter(pl.col("rejected_kind") != "non_answer")
    assert len(answers) == 100 and answers == kept.select("prompt", "chosen", "rejected").head(100).to_dicts()
    assert max(len(row["rejected"]) for row in answers) < 10 < max(len(row["rejected"]) for row in mixed)


@pytest.mark.parametrize(("args", "error"), [
    (["--steps", "2", "--warmup", "2"], "dpo: warmup 2 with 2 steps: expected 0 <= warmup < steps - 1"),
    # step 1 starts no interval: 2 steps give one, which a warm-up of 1 would leave out
    (["--steps", "2", "--warmup", "1"], "dpo: warmup 1 with 2 steps: expected 0 <= warmup < steps - 1"),
    (["--steps", "1", "--warmup", "0"], "dpo: warmup 0 with 1 steps: expected 0 <= warmup < steps - 1"),
    (["--set", "prompts=abc"], "--set prompts=abc: expected an integer"),
    (["--set", "lr=fast"], "--set lr=fast: expected a number"),
])
def test_vs_trl_refuses_settings_that_time_nothing_in_one_line_before_it_builds_the_model(args, error):
    done = subprocess.run([sys.executable, str(SCRIPT), "--algo", "dpo", "grpo", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "uptime" not in done.stdout
    [line] = done.stderr.splitlines()
    assert line.startswith(error)
