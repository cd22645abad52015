"""Pass@K (unbiased estimator) and Maj@K (exact expected majority-vote accuracy) over sampled answers,
their per-model curves and plots, and the `eval/pass_at_8` metric names."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import PurePath
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
from matplotlib.figure import Figure
from numpy.lib.stride_tricks import sliding_window_view

from pipeline_lib.config import EvalConfig
from pipeline_lib.rewards.math import (REL_TOLERANCE, answer_value, extract_answer, is_numeric_answer, terminates,
                                      values_equivalent)
from pipeline_lib.store.db import Store
from pipeline_lib.logfns import LogFn, no_log

if TYPE_CHECKING:  # the annotation only: run_eval_stage imports the sampling stage when it runs
    from pipeline_lib.sampling.stage import SampleReport

MAX_SAMPLES = 1024  # C(1024, 512) ~ 4.5e306: subset counts above this overflow float64
METRIC_KINDS = ("pass", "maj")
CHUNK_ELEMENTS = 1 << 22  # float64 entries per matmul chunk in Maj@K (32 MB)


def metric_key(kind: str, k: int) -> str:
    """`metric_key("pass", 8) -> "eval/pass_at_8"` (MLflow rejects `@` in keys)."""
    if kind not in METRIC_KINDS:
        raise ValueError(f"kind: expected one of {METRIC_KINDS}, got {kind!r}")
    return f"eval/{kind}_at_{int(k)}"


def pass_at_k(n: np.ndarray | int, c: np.ndarray | int, k: int) -> np.ndarray:
    """Unbiased Pass@k = 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), per problem; NaN where k > n.

    Computed as the product form 1 - Π_{i=n-c+1}^{n} (1 - k/i), in log space through one cumulative sum
    over i shared by all problems: no binomial ever overflows. n, c: arrays (or scalars) of sample and
    correct counts; returns a float array of their broadcast shape."""
    n, c = np.broadcast_arrays(np.asarray(n, dtype=np.int64), np.asarray(c, dtype=np.int64))
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"k: expected an integer >= 1, got {k!r}")
    if np.any(c < 0) or np.any(c > n):
        raise ValueError("c: expected 0 <= c <= n for every problem")
    k = int(k)
    out = np.full(n.shape, np.nan)
    valid = k <= n
    if k == 1:  # c / n exactly: Maj@1 is the same fraction, and log space left Pass@1 an ulp below it (0.012 vs 0.013)
        out[valid] = c[valid] / n[valid]
        return out
    if not valid.any():
        return out
    i = np.arange(1, int(n.max()) + 1, dtype=np.float64)
    # Terms with i <= k never enter a used range (that needs n - c >= k); zero keeps the cumsum finite.
    log_terms = np.where(i > k, np.log1p(-k / np.maximum(i, k + 1)), 0.0)
    prefix = np.concatenate([[0.0], np.cumsum(log_terms)])  # prefix[m] = Σ_{i<=m} log(1 - k/i)
    certain = valid & (n - c < k)  # fewer than k wrong samples: every k-subset holds a correct one
    uncertain = valid & ~certain
    out[certain] = 1.0
    # + 0.0: no correct sample gives -expm1(0) = -0.0, which tables would print as "-0.000"
    out[uncertain] = -np.expm1(prefix[n[uncertain]] - prefix[n[uncertain] - c[uncertain]]) + 0.0
    return out


@dataclass(frozen=True)
class Votes:
    """Answer classes per problem (`answer_value`s equal within the verifier's tolerance vote together; None
    answers do not vote)."""

    n: np.ndarray  # (P,) samples per problem, None answers included
    counts: np.ndarray  # (P, R) votes per class, sorted descending per row, zero-padded
    correct: np.ndarray  # (P, R) bool: the class (its most-voted value) is equivalent to the gold answer
    n_correct: np.ndarray  # (P,) samples whose own answer is equivalent to the gold one (the verifier's count;
    # a class merged within tolerance can hold values on both sides of it)


def merge_within_tolerance(classes: Counter[Fraction | str]) -> Counter[Fraction | str]:
    """Answer values equal within the verifier's tolerance vote together (`1/3` and `0.333333`; exactly equal ones
    already do). Tolerance is not transitive (`0.6666667` and `0.666668` are each within it of 2/3, not of each
    other), so a class is a connected group of values, keyed by its most-voted one. Only a value without a finite
    decimal expansion can equal another within tolerance, so most problems skip the pass."""
    repeating = [value for value in classes if isinstance(value, Fraction) and not terminates(value)]
    if not repeating:
        return classes
    parent = {value: value for value in classes}

    def root(value: Fraction | str) -> Fraction | str:
        while parent[value] != value:
            value = parent[value]
        return value

    # |a - b| <= rel_tol * max(|a|, |b|) puts b between a * (1 - rel_tol) and a / (1 - rel_tol): only the numbers in
    # that window are compared (all of them were: a weak model's 1,024 distinct fractions took 2.5 s a problem)
    numbers = sorted(value for value in classes if isinstance(value, Fraction))
    for hub in repeating:
        low, high = sorted((hub * (1 - REL_TOLERANCE), hub / (1 - REL_TOLERANCE)))
        for value in numbers[bisect_left(numbers, low):bisect_right(numbers, high)]:
            if value != hub and values_equivalent(hub, value):
                parent[root(value)] = root(hub)
    merged: Counter[Fraction | str] = Counter()
    key: dict[Fraction | str, Fraction | str] = {}
    for value, count in sorted(classes.items(), key=lambda item: -item[1]):  # stable: the first of equal counts
        merged[key.setdefault(root(value), value)] += count
    return merged


def count_votes(answers: Sequence[Sequence[str | None]], gold: Sequence[str | None]) -> Votes:
    """Group each problem's extracted answers into classes (`merge_within_tolerance`) and mark the classes
    equivalent to its gold answer."""
    if len(answers) != len(gold):
        raise ValueError(f"gold: expected one answer per problem ({len(answers)}), got {len(gold)}")
    values: dict[str, Fraction | str] = {}  # raw answer -> value, shared across problems
    flat_rows: list[int] = []  # one entry per (problem, class)
    flat_counts: list[int] = []
    flat_correct: list[bool] = []
    n_correct = np.zeros(len(answers), dtype=np.int64)
    for p, (row, gold_answer) in enumerate(zip(answers, gold)):
        gold_value = None if gold_answer is None else answer_value(str(gold_answer))
        classes: Counter[Fraction | str] = Counter()
        for raw, count in Counter(row).items():
            if raw is not None:
                value = values.get(raw)
                if value is None:
                    value = values[raw] = answer_value(str(raw))
                classes[value] += count
        n_correct[p] = sum(count for value, count in classes.items()
                           if gold_value is not None and values_equivalent(value, gold_value))
        for value, count in merge_within_tolerance(classes).items():
            flat_rows.append(p)
            flat_counts.append(count)
            flat_correct.append(gold_value is not None and values_equivalent(value, gold_value))
    rows, counts_flat = np.array(flat_rows, dtype=np.int64), np.array(flat_counts, dtype=np.int64)
    order = np.lexsort((-counts_flat, rows))  # by problem, then count descending
    rows, starts = rows[order], np.searchsorted(rows[order], np.arange(len(answers)))
    cols = np.arange(len(rows)) - starts[rows]  # rank of each class within its problem
    width = int(cols.max(initial=-1)) + 1
    counts = np.zeros((len(answers), width), dtype=np.int64)
    correct = np.zeros((len(answers), width), dtype=bool)
    counts[rows, cols] = counts_flat[order]
    correct[rows, cols] = np.array(flat_correct, dtype=bool)[order]
    n = np.array([len(row) for row in answers], dtype=np.int64)
    return Votes(n=n, counts=counts, correct=correct, n_correct=n_correct)


def _binomials(n_max: int) -> np.ndarray:
    """table[m, b] = C(m, b) as float64 for 0 <= m, b <= n_max (0 where b > m), by Pascal's rule."""
    table = np.zeros((n_max + 1, n_max + 1))
    table[:, 0] = 1.0
    for m in range(1, n_max + 1):
        table[m, 1:] = table[m - 1, 1:] + table[m - 1, :-1]
    return table


def _convolve(ways: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    """out[p, t, d] = Σ_b coefficients[p, b] * ways[p, t, d - b], truncated to ways' width.

    One batched matmul over sliding windows (3x faster than a shifted add per b), in row chunks of at
    most CHUNK_ELEMENTS window entries, since matmul copies the strided windows."""
    rows, ties, width = ways.shape
    a = coefficients.shape[1]
    out = np.empty_like(ways)
    step = max(1, CHUNK_ELEMENTS // (ties * width * a))
    for start in range(0, rows, step):
        part = ways[start : start + step]
        padded = np.concatenate([np.zeros((*part.shape[:2], a - 1)), part], axis=-1)  # (p, t, width+a-1)
        windows = sliding_window_view(padded, a, axis=-1)  # (p, t, width, a)
        out[start : start + step] = (windows @ coefficients[start : start + step, ::-1, None][:, None])[..., 0]
    return out


def _tie_weighted_counts(others: np.ndarray, a: int, width: int, binom: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a class holding exactly `a` votes, the ways the other classes with >= a samples take d votes.

    others: (p, L) vote counts of the other classes, descending. Returns (weighted, taken): weighted[:, d]
    (d < width) sums, over ways for those classes to take d votes with each <= a, 1/(1 + #classes at exactly
    a) (the uniform tie split); taken = their total samples. Classes below a and Nones never threaten the
    win: the caller counts them with one binomial.

    The DP runs over (t, s): t classes at exactly a and s votes taken by the classes below a, so d = a*t + s.
    After c classes t <= c and s <= (a-1)*c, and only that corner is updated. The s axis is thus at most
    (a-1)*L + 1 wide, not `width`: for n = 1024 distinct answers (L = 1023, a = 1) the table is (ties+1) x 1, and
    Maj@K takes 0.07 s, not 5 s (a table over d made every class cost ties x width)."""
    constrained = others >= a  # (p, L)
    n_cons = int(constrained.any(axis=0).sum())  # columns are sorted descending: a prefix
    ties = min(n_cons, (width - 1) // a)
    below_width = min(width, (a - 1) * n_cons + 1)
    ways = np.zeros((others.shape[0], ties + 1, below_width))  # (p, ties at a, votes below a)
    ways[:, 0, 0] = 1.0
    for col in range(n_cons):
        m, cons = others[:, col], constrained[:, col]
        below = np.where(cons[:, None], binom[m, :a], 0.0)  # (p, a): C(m, b) for b < a
        below[~cons, 0] = 1.0  # a class below a in this row is counted with the free samples
        at_a = np.where(cons, binom[m, a], 0.0)  # (p,)
        t_end, s_end = min(col + 1, ties) + 1, min((a - 1) * (col + 1) + 1, below_width)  # reachable with col+1
        part = ways[:, :t_end, :s_end]
        new = _convolve(part, below)
        new[:, 1:] += at_a[:, None, None] * part[:, :-1]
        ways[:, :t_end, :s_end] = new
    weighted = np.zeros((others.shape[0], width))
    for t in range(ties + 1):  # d = a*t + s, each way split among its 1 + t winners
        weighted[:, a * t : a * t + below_width] += ways[:, t, : width - a * t] / (1 + t)
    return weighted, (others * constrained).sum(axis=1)


def _maj_sums(mj: np.ndarray, others: np.ndarray, n: np.ndarray, ks: list[int], binom: np.ndarray) -> np.ndarray:
    """Σ over K-subsets of [class j wins] / #tied winners, for one class j per row: (len(ks), p).

    Sum over a = votes of j: C(mj, a) * Σ over the others' s = K - a votes with every class <= a (ties split).
    When 2a > K or no other class has a samples, nothing can beat j: that sum is C(n - mj, K - a).
    Only rows with K < n are right; the caller fills K == n (one subset) and K > n (NaN)."""
    sums = np.zeros((len(ks), len(mj)))
    top = others[:, 0] if others.shape[1] else np.zeros_like(mj)
    rest = n - mj
    for a in range(1, int(mj.max(initial=0)) + 1):
        has_a = mj >= a
        contested = has_a & (top >= a)
        dp_ks = [K for K in ks if 2 * a <= K < int(n[contested].max(initial=0))]
        if dp_ks:
            weighted, taken = _tie_weighted_counts(others[contested], a, max(dp_ks) - a + 1, binom)
            free = rest[contested] - taken  # Nones + classes too small to reach a
        for q, K in enumerate(ks):
            s = K - a
            if s < 0:
                continue
            plain = has_a & ~contested if K in dp_ks else has_a
            sums[q, plain] += binom[mj[plain], a] * binom[rest[plain], s]
            if K in dp_ks:
                free_ways = binom[free[:, None], s - np.arange(s + 1)]  # (p, s+1): C(free, s - d)
                sums[q, contested] += binom[mj[contested], a] * (weighted[:, : s + 1] * free_ways).sum(axis=1)
    return sums


def _full_set_majority(counts: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """Maj@n: the one subset is all samples; the score of its top classes (0 when every answer is None)."""
    top = counts.max(axis=1, initial=0)  # (P,)
    tied = (counts == top[:, None]) & (top[:, None] > 0)  # (P, R)
    return (tied & correct).sum(axis=1) / np.maximum(tied.sum(axis=1), 1)


def maj_at_k_from_votes(votes: Votes, ks: Iterable[int]) -> np.ndarray:
    """Exact Maj@K per problem for each K: (len(ks), P); NaN where K > n.

    Maj@K is the expected score of the majority answer of a uniformly random K-subset of the n samples.
    Rule: None answers never vote (a subset of only Nones scores 0); a tie among the top classes scores the
    fraction of tied classes that are correct. Exact: a sum over the correct class's vote count a of
    C(m_j, a) times a DP over the other classes' counts with a tie-count dimension, divided by C(n, K)."""
    ks = [int(k) for k in ks]
    if any(k < 1 for k in ks):
        raise ValueError(f"ks: expected integers >= 1, got {ks}")
    n, counts, correct = votes.n, votes.counts, votes.correct
    if len(n) and int(n.max()) > MAX_SAMPLES:
        raise ValueError(f"answers: at most {MAX_SAMPLES} samples per problem (float64 range), got {int(n.max())}")
    n_max = int(n.max(initial=0))
    binom = _binomials(n_max)
    positions = [q for q, K in enumerate(ks) if K <= n_max]  # larger K are NaN everywhere
    in_range = [ks[q] for q in positions]
    sums = np.zeros((len(in_range), len(n)))
    for rank in range(int(correct.sum(axis=1).max(initial=0))):
        # rows with at least rank+1 correct classes; j = their (rank+1)-th correct class
        rows = np.flatnonzero(correct.sum(axis=1) > rank)
        j = np.argmax(np.cumsum(correct[rows], axis=1) > rank, axis=1)
        mj = counts[rows, j]
        keep = np.ones((len(rows), counts.shape[1]), dtype=bool)
        keep[np.arange(len(rows)), j] = False
        others = counts[rows][keep].reshape(len(rows), counts.shape[1] - 1)
        sums[:, rows] += _maj_sums(mj, others, n[rows], in_range, binom)
    out = np.full((len(ks), len(n)), np.nan)
    full_set = _full_set_majority(counts, correct)
    for q, (position, K) in enumerate(zip(positions, in_range)):
        below = K < n
        out[position, below] = sums[q, below] / binom[n[below], K]
        out[position, K == n] = full_set[K == n]
    return out


def maj_at_k(answers: Sequence[Sequence[str | None]], gold: Sequence[str | None], k: int) -> np.ndarray:
    """Exact Maj@k per problem (P,) from each problem's extracted answers (None = no answer); NaN where k > n.

    Ties among the top classes count the fraction of them that are correct (see maj_at_k_from_votes)."""
    return maj_at_k_from_votes(count_votes(answers, gold), [k])[0]


def evaluate(
    samples: pl.DataFrame, gold: Mapping[str, str | None], ks: Iterable[int], model: str, dataset: str
) -> pl.DataFrame:
    """Pass@K and Maj@K of one model's samples (columns prompt_id, sample_idx, completion) against
    gold[prompt_id], averaged over problems, for every K in `ks` with K <= the fewest samples of any prompt.

    Returns columns model, dataset, k, pass_at_k, maj_at_k, n_samples (that fewest count), sorted by k."""
    missing = [c for c in ("prompt_id", "sample_idx", "completion") if c not in samples.columns]
    if missing:
        raise ValueError(f"samples: missing column(s) {missing}; expected prompt_id, sample_idx, completion")
    if samples.height == 0:
        raise ValueError("samples: no rows to evaluate")
    grouped = (
        samples.sort("prompt_id", "sample_idx")
        .group_by("prompt_id", maintain_order=True)
        .agg(pl.col("completion"))
    )
    prompt_ids = grouped["prompt_id"].to_list()
    absent = [pid for pid in prompt_ids if pid not in gold]
    if absent:
        raise ValueError(f"gold: no answer for prompt_id {absent[0]!r} ({len(absent)} prompt(s) without one)")
    answers = [[extract_answer(text, numeric=is_numeric_answer(gold[pid])) for text in texts]
               for pid, texts in zip(prompt_ids, grouped["completion"].to_list())]
    votes = count_votes(answers, [gold[pid] for pid in prompt_ids])
    n_samples = int(votes.n.min())
    ks = sorted({int(k) for k in ks if int(k) <= n_samples})
    maj = maj_at_k_from_votes(votes, ks)
    return pl.DataFrame(
        {
            "model": [model] * len(ks),
            "dataset": [dataset] * len(ks),
            "k": ks,
            "pass_at_k": [float(pass_at_k(votes.n, votes.n_correct, k).mean()) for k in ks],
            "maj_at_k": [float(row.mean()) for row in maj],
            "n_samples": [n_samples] * len(ks),
        },
        schema={"model": pl.String, "dataset": pl.String, "k": pl.Int64, "pass_at_k": pl.Float64,
                "maj_at_k": pl.Float64, "n_samples": pl.Int64},
    )


def plot_curves(results: pl.DataFrame) -> tuple[Figure, Figure]:
    """Pass@K and Maj@K vs K (log2 axis), one curve per model (and dataset, when there are several).

    Plain `Figure`s (no pyplot state); saving them renders with the Agg backend."""
    if results.height == 0:
        raise ValueError("results: no rows to plot")
    figures = []
    several_datasets = results["dataset"].n_unique() > 1
    for column, title in (("pass_at_k", "Pass@K"), ("maj_at_k", "Maj@K")):
        fig = Figure(figsize=(5, 3.5), layout="constrained")
        ax = fig.add_subplot()
        for (model, dataset), curve in results.sort("k").group_by(["model", "dataset"], maintain_order=True):
            label = f"{short_label(model)} ({dataset})" if several_datasets else short_label(model)
            ax.plot(curve["k"].to_list(), curve[column].to_list(), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ks = sorted(set(results["k"].to_list()))
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set(xlabel="K (samples)", ylabel=title, title=title, ylim=(0.0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend()
        figures.append(fig)
    return figures[0], figures[1]


def short_label(model: str) -> str:
    """A model's name short enough for a plot's title and legend: `alignflow eval --model DIR` without --name labels
    its results with the absolute path, whose titles ran past the figure and over each other. A path is shown as
    its last two dirs, a final model's `final` left out (`.../models/dpo/b778cae28da53dc7/final` ->
    `dpo/b778cae28da53dc7`, its stage and key); a name or a hub id (`org/model`) as it is. The results table and the
    run's params keep the full path."""
    parts = PurePath(model).parts
    if len(parts) <= 2:
        return model
    if parts[-1] == "final":
        parts = parts[:-1]
    return "/".join(parts[-2:])


def plot_histograms(samples: pl.DataFrame, model: str) -> Figure:
    """Reward and response-length histograms of one model's samples (columns reward, n_tokens), the model's
    `short_label` as the figure's title."""
    fig = Figure(figsize=(8, 3), layout="constrained")
    fig.suptitle(short_label(model))
    for i, (column, label) in enumerate((("reward", "reward"), ("n_tokens", "response length (tokens)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.hist(samples[column].drop_nulls().to_numpy(), bins=20)
        ax.set(xlabel=label, ylabel="samples", title=label)
    return fig


def run_eval_stage(cfg: EvalConfig, store: Store, *, log: LogFn = no_log,
                   progress: bool = True) -> tuple[pl.DataFrame, pl.DataFrame, SampleReport]:
    """The evaluation stage: sample (resumable), score Pass@K / Maj@K against the gold answers, replace the
    model's rows of the run in eval_results, log `eval/pass_at_K` and `eval/maj_at_K`. Returns (results, the
    samples, the report of the sampling run they come from)."""
    from pipeline_lib.sampling.stage import run_sample_stage, select_problems

    report = run_sample_stage(cfg.sample_config, store, log=log, progress=progress)
    # the problems the run sampled this time: its samples of problems deleted or re-ingested with another answer
    # since (a run without max_problems keeps its id when its problems change) are not scored
    problems = select_problems(store, cfg.sample_config)
    gold = dict(zip(problems["problem_id"].to_list(), problems["answer"].to_list()))
    samples = store.read("samples", run_id=report.run_id).filter(pl.col("prompt_id").is_in(list(gold)))
    dataset = f"{cfg.problems_source or 'all'}/{cfg.split}"
    results = evaluate(samples, gold, cfg.k_values, model=cfg.label, dataset=dataset)
    with store.transaction():
        store.delete_eval_results(report.run_id, cfg.label)
        store.append("eval_results", results.with_columns(pl.lit(report.run_id).alias("run_id")))
    for row in results.iter_rows(named=True):
        log({metric_key("pass", row["k"]): row["pass_at_k"], metric_key("maj", row["k"]): row["maj_at_k"]}, 0)
    return results, samples, report
