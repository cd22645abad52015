"""Benchmark: Pass@K + exact Maj@K for 10,000 problems x 64 samples, K in {1, 2, 4, ..., 64}.

`.venv/bin/python benchmarks/evaluation.py [--problems 10000] [--samples 64] [--repeats 3] [--distinct [--fractions]]`
prints a
markdown table of seconds per step (best of the repeats); K runs over the powers of 2 up to the samples. Answers: per
problem, Dirichlet weights over 4 numeric answer classes (one of them the gold answer, or not) plus None (no answer
extracted); with --distinct every sample is its own answer (one of them the gold), the most ties Maj@K can meet; with
--fractions too, those answers are sevenths x/7 of random x < 10^6 (no finite decimal expansion: the tolerance pass
compares them), as a weak model answering a MATH-style problem writes."""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench_args import positive_int  # this directory

from pipeline_lib.evaluation import count_votes, maj_at_k_from_votes, pass_at_k


def make_answers(n_problems: int, n_samples: int, seed: int) -> tuple[list[list[str | None]], list[str]]:
    rng = np.random.default_rng(seed)
    answers, gold = [], []
    for p in range(n_problems):
        classes = [str(100 * p + i) for i in range(4)] + [None]
        weights = rng.dirichlet(np.full(len(classes), 0.7))
        picks = rng.choice(len(classes), size=n_samples, p=weights)
        answers.append([classes[i] for i in picks])
        gold.append(classes[0] if rng.random() < 0.8 else str(100 * p + 99))  # 20%: gold never sampled
    return answers, gold


def distinct_answers(n_problems: int, n_samples: int, fractions: bool, seed: int
                     ) -> tuple[list[list[str | None]], list[str]]:
    if not fractions:
        return [[f"{p}-{i}" for i in range(n_samples)] for p in range(n_problems)], [f"{p}-0" for p in range(n_problems)]
    rng = np.random.default_rng(seed)
    answers = [[f"{x}/7" for x in rng.choice(10**6, size=n_samples, replace=False)] for _ in range(n_problems)]
    return answers, [row[0] for row in answers]


def best_time(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=positive_int, default=10_000)
    parser.add_argument("--samples", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distinct", action="store_true", help="every sample a distinct answer")
    parser.add_argument("--fractions", action="store_true", help="with --distinct: distinct sevenths (x/7)")
    args = parser.parse_args()
    if args.fractions and not args.distinct:
        parser.error("--fractions needs --distinct")
    answers, gold = (distinct_answers(args.problems, args.samples, args.fractions, args.seed) if args.distinct
                     else make_answers(args.problems, args.samples, args.seed))
    ks = sorted({2**i for i in range(args.samples.bit_length())} | {args.samples})

    t_votes, votes = best_time(lambda: count_votes(answers, gold), args.repeats)
    t_pass, passes = best_time(lambda: [pass_at_k(votes.n, votes.n_correct, k) for k in ks], args.repeats)
    t_maj, majs = best_time(lambda: maj_at_k_from_votes(votes, ks), args.repeats)

    kind = ("every answer a distinct seventh" if args.fractions else "every answer distinct") if args.distinct \
        else "Dirichlet answer classes"
    print(f"{args.problems:,} problems x {args.samples} samples ({kind}), K in {ks}, best of {args.repeats}\n")
    print("| step | seconds |")
    print("|---|---|")
    print(f"| group answers into classes (count_votes) | {t_votes:.3f} |")
    print(f"| Pass@K, all K | {t_pass:.3f} |")
    print(f"| Maj@K (exact), all K | {t_maj:.3f} |")
    print(f"| total | {t_votes + t_pass + t_maj:.3f} |")
    print("\n| K | Pass@K | Maj@K |")
    print("|---|---|---|")
    for k, p, m in zip(ks, passes, majs):
        print(f"| {k} | {p.mean():.4f} | {m.mean():.4f} |")


if __name__ == "__main__":
    main()
