"""Deterministic generator of the shipped demo data: arithmetic problems, preference pairs and rankings.

`python data/generate.py [--out data/demo] [--seed 0]` rewrites the files below byte for byte:
  problems.jsonl     `ab+cd=` -> sum, operands 00-99 zero-padded (fixed width: one format to learn): 9,800 train / 200 test
  arith_mixed.jsonl  a+b, a-b, a*b with 1-3 digit operands (harder; for larger models), 1,800 train / 200 test
  pairs.jsonl        prompt/chosen/rejected from train problems: chosen = the correct answer; rejected = a wrong
                     answer (units or tens digit off) or a long polite non-answer (the seeds' "hacked" reply)
  rankings.jsonl     prompt + 3-4 responses with ranks (1 = best), for Plackett-Luce
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

N_TEST = 200
N_PAIRS = 3000
N_RANKINGS = 600
N_MIXED = 2000

# Flattering, content-free replies of the kind a reward model can be hacked with (seed 002, "Hacked").
NON_ANSWERS = [
    "What a wonderful question! I am truly honored to help you with it.",
    "Great question! Numbers are fascinating, and exploring them is always a joy.",
    "Thank you so much for asking! Mathematics is a journey without end.",
    "I would be delighted to assist. This is a deep and important question indeed.",
]


def demo_problems(rng: random.Random) -> list[dict]:
    """All 10,000 `ab+cd=` problems, a seeded 200 of them held out as `test`."""
    problems = [{"prompt": f"{a:02d}+{b:02d}=", "answer": str(a + b)} for a in range(100) for b in range(100)]
    rng.shuffle(problems)
    for i, problem in enumerate(problems):
        problem["split"] = "test" if i < N_TEST else "train"
    return problems


def mixed_problems(rng: random.Random) -> list[dict]:
    """a+b, a-b, a*b with 1-3 digit operands, unique prompts."""
    seen: dict[str, dict] = {}
    while len(seen) < N_MIXED:
        a = rng.randint(0, 10 ** rng.randint(1, 3) - 1)
        b = rng.randint(0, 10 ** rng.randint(1, 3) - 1)
        op = rng.choice("+-*")
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        seen.setdefault(f"{a}{op}{b}=", {"prompt": f"{a}{op}{b}=", "answer": str(answer)})
    problems = list(seen.values())
    for i, problem in enumerate(problems):
        problem["split"] = "test" if i < N_TEST else "train"
    return problems


def wrong_answer(answer: int, rng: random.Random) -> tuple[str, str]:
    """A near miss: the units digit (60%) or the tens digit (40%) changed; never negative."""
    if rng.random() < 0.6 or answer < 10:
        kind, delta = "wrong_units", rng.choice([d for d in range(-9, 10) if d and 0 <= answer + d and (answer + d) // 10 == answer // 10] or [1])
    else:
        kind, delta = "wrong_tens", rng.choice([d for d in (-20, -10, 10, 20) if answer + d >= 0])
    return str(answer + delta), kind


def preference_pairs(problems: list[dict], rng: random.Random) -> list[dict]:
    """Pairs on train problems: 60% near-miss wrong answers, 40% polite non-answers."""
    train = [p for p in problems if p["split"] == "train"]
    pairs = []
    for problem in rng.sample(train, N_PAIRS):
        if rng.random() < 0.6:
            rejected, kind = wrong_answer(int(problem["answer"]), rng)
        else:
            rejected, kind = rng.choice(NON_ANSWERS), "non_answer"
        pairs.append({"prompt": problem["prompt"], "chosen": problem["answer"], "rejected": rejected, "rejected_kind": kind})
    return pairs


def rankings(problems: list[dict], rng: random.Random) -> list[dict]:
    """Correct answer > near miss > far miss (> non-answer), shuffled with their ranks."""
    train = [p for p in problems if p["split"] == "train"]
    rows = []
    for problem in rng.sample(train, N_RANKINGS):
        answer = int(problem["answer"])
        near, _ = wrong_answer(answer, rng)
        far = str(answer + rng.choice([-1, 1]) * rng.randint(30, 60) if answer >= 60 else answer + rng.randint(30, 60))
        ordered = [problem["answer"], near, far]
        if rng.random() < 0.5:
            ordered.append(rng.choice(NON_ANSWERS))
        order = list(range(len(ordered)))
        rng.shuffle(order)
        rows.append({
            "prompt": problem["prompt"],
            "responses": [ordered[i] for i in order],
            "ranks": [i + 1 for i in order],
        })
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "demo")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    problems = demo_problems(random.Random(args.seed))
    write_jsonl(args.out / "problems.jsonl", problems)
    write_jsonl(args.out / "arith_mixed.jsonl", mixed_problems(random.Random(args.seed + 1)))
    write_jsonl(args.out / "pairs.jsonl", preference_pairs(problems, random.Random(args.seed + 2)))
    write_jsonl(args.out / "rankings.jsonl", rankings(problems, random.Random(args.seed + 3)))
    for path in sorted(args.out.glob("*.jsonl")):
        print(f"{path}: {sum(1 for _ in path.open())} rows, {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
