"""Every benchmark script refuses a count below 1 in one usage line; the ones besides vs_trl.py (test_vs_trl.py)
print their table on a tiny run, so they cannot rot. Not run: cache_rerun.py (~90 s of Prefect start-ups) and
logprobs.py (six workers of ~7 s each); their code paths have their own tests."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def bench(script: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], check=check, capture_output=True, text=True,
                          timeout=300)


def table(out: str, which: int = -1) -> list[list[str]]:
    """The data rows of markdown table `which` in `out` (the last by default; the rows after its `|---` line), cells
    stripped."""
    lines = out.splitlines()
    start = [i for i, line in enumerate(lines) if line.startswith("|---")][which] + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[start:end]]


@pytest.mark.parametrize(("script", "option"), [
    ("evaluation.py", "--samples"), ("ingest.py", "--n"), ("cache_rerun.py", "--steps"), ("logprobs.py", "--batch"),
    ("sampling.py", "--prompts"), ("vs_trl.py", "--repeats"), ("rm_packing.py", "--groups"),
])
def test_a_count_below_one_is_a_one_line_usage_error(script, option):
    done = bench(script, option, "0", check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1] == f"{script}: error: argument {option}: expected an integer >= 1, got 0"


def test_evaluation_prints_pass_and_maj_at_k_for_each_k():
    rows = table(bench("evaluation.py", "--problems", "50", "--samples", "4", "--repeats", "1").stdout)
    assert [row[0] for row in rows] == ["1", "2", "4"]
    pass_k, maj_k = [float(row[1]) for row in rows], [float(row[2]) for row in rows]
    assert pass_k[0] == maj_k[0]  # one sample: its vote is the majority
    assert pass_k == sorted(pass_k) and all(m <= p for m, p in zip(maj_k, pass_k))


def test_ingest_accepts_the_good_rows_it_planted_and_flags_the_rest():
    out = bench("ingest.py", "--n", "1000", "--skip-datasets").stdout
    planted = ast.literal_eval(out.split("planted: ")[1].splitlines()[0])
    first, again = re.findall(r"read (\d+) = accepted (\d+) \+ duplicates (\d+) \+ quarantined (\d+)", out)
    bad = sum(planted.values()) - planted["good"] - planted["duplicate"]
    assert tuple(map(int, first)) == (1000, planted["good"], planted["duplicate"], bad)
    assert tuple(map(int, again)) == (1000, 0, 1000 - bad, bad)
    assert [row[2] for row in table(out)] == ["alignflow ingest_file, fresh store",
                                              "alignflow re-ingest, all duplicates"]


def test_sampling_prints_hf_throughput_without_the_vllm_env():
    out = bench("sampling.py", "--no-vllm", "--prompts", "2", "--n", "2", "--max-new-tokens", "2", "--repeats", "1")
    rows = table(out.stdout)
    assert [row[:3] for row in rows] == [["hf generate", "2", "1"], ["hf generate", "2", "2"]]
    assert [int(row[3]) for row in rows] == [4, 8]  # every prompt runs to max_new_tokens on the random-init model


def test_rm_packing_times_the_layouts_and_scoring_and_says_how_many_groups_pack():
    done = bench("rm_packing.py", "--data", "rankings", "hh", "--groups", "4", "--repeats", "1")
    rankings, hh = table(done.stdout, 0)
    assert rankings[:3] == ["rankings", "600", "600"]  # short prompts, 2-4 answers: every ranking saves positions
    assert float(rankings[4]) < float(rankings[3])
    assert hh[:2] == ["hh", "2308"] and 0 < int(hh[2]) < 2308 / 2  # most are cut from the left to 256 characters
    # by their own lengths: those pairs share little and run as rows
    assert all(float(cell) > 0 for cell in rankings[5:] + hh[5:])
    scored_rankings, scored_hh = table(done.stdout)  # 8 answers to each of 4 prompts, scored
    assert scored_rankings[:2] == ["rankings", "32"] and int(scored_rankings[2]) > 16  # the answers share the prompt
    assert scored_hh[:2] == ["hh", "32"] and int(scored_hh[2]) < 16  # cut from the left by their own lengths
    assert all(float(cell) > 0 for cell in scored_rankings[3:] + scored_hh[3:])
