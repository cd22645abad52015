"""Pass@K and Maj@K against brute-force enumeration of every K-subset, evaluate() and the curve plots."""

from __future__ import annotations

import io
import itertools
import random
from collections import Counter
from fractions import Fraction
from math import comb

import numpy as np
import polars as pl
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pipeline_lib.evaluation import (
    count_votes,
    evaluate,
    maj_at_k,
    maj_at_k_from_votes,
    merge_within_tolerance,
    metric_key,
    pass_at_k,
    plot_curves,
    plot_histograms,
)
from pipeline_lib.rewards.math import answer_value, is_correct, is_equivalent, values_equivalent


def brute_pass(correct: list[bool], k: int) -> Fraction:
    subsets = list(itertools.combinations(correct, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


def brute_maj(answers: list[str | None], gold: str | None, k: int, classes: dict | None = None) -> Fraction:
    """Mean over all k-subsets of: (#correct classes among the most-voted) / (#most-voted); Nones do not vote.
    An answer's class is its value, or `classes[answer]` where given (answers equal within tolerance)."""
    total, subsets = Fraction(0), 0
    for subset in itertools.combinations(answers, k):
        subsets += 1
        votes: dict = {}
        for answer in subset:
            if answer is not None:
                value = answer_value(classes.get(answer, answer) if classes else answer)
                votes[value] = votes.get(value, 0) + 1
        if not votes:
            continue
        top = max(votes.values())
        tied = [value for value, count in votes.items() if count == top]
        good = sum(gold is not None and values_equivalent(value, answer_value(gold)) for value in tied)
        total += Fraction(good, len(tied))
    return total / subsets


def test_metric_key_never_uses_at_sign():
    assert metric_key("pass", 8) == "eval/pass_at_8"
    assert metric_key("maj", 1) == "eval/maj_at_1"
    with pytest.raises(ValueError, match="kind"):
        metric_key("pass@", 8)


def test_pass_at_k_hand_computed():
    """n=4, c=1: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2; c=3, k=2: every pair has a correct one."""
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 0, 3) == 0.0
    assert f"{pass_at_k(64, 0, 64):.3f}" == "0.000"  # not -0.000


@pytest.mark.parametrize("seed", range(5))
def test_pass_at_k_matches_brute_force(seed):
    rng = random.Random(seed)
    correct = [[rng.random() < rng.random() for _ in range(rng.randint(1, 8))] for _ in range(30)]
    n = np.array([len(c) for c in correct])
    c = np.array([sum(c) for c in correct])
    for k in range(1, 9):
        got = pass_at_k(n, c, k)
        assert got.shape == (30,)
        for p, flags in enumerate(correct):
            if k > len(flags):
                assert np.isnan(got[p])  # documented: k > n is NaN
            else:
                assert got[p] == pytest.approx(float(brute_pass(flags, k)), abs=1e-12)


def test_pass_at_1_is_the_fraction_correct_exactly_as_maj_at_1_is():
    """Log space left Pass@1 an ulp below c/n: 1 of 80 gave 0.012499999999999994 against Maj@1's 0.0125, printed
    0.012 beside 0.013, as if Maj@K could exceed Pass@K."""
    n = np.array([80, 80, 3, 7])
    c = np.array([1, 6, 1, 5])
    assert pass_at_k(n, c, 1).tolist() == (c / n).tolist()
    answers = [["1"] + ["x"] * 79]
    assert pass_at_k(80, 1, 1) == maj_at_k(answers, ["1"], 1)[0] == 0.0125


def test_pass_at_k_is_stable_for_large_n():
    n, c, k = 10_000, 7, 1000  # C(10000, 1000) overflows float64; the product form does not
    exact = 1 - Fraction(comb(n - c, k), comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-10)
    assert pass_at_k(np.array([n]), np.array([1]), 1)[0] == pytest.approx(1e-4, rel=1e-12)


def test_pass_at_k_rejects_bad_input():
    with pytest.raises(ValueError, match="k: expected an integer >= 1"):
        pass_at_k(4, 1, 0)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(np.array([4, 3]), np.array([1, 5]), 1)


def test_maj_at_k_hand_computed():
    """['1','1','2'] gold 1, k=2: {1,1} wins, {1,2} twice ties -> 1/2 each: (1 + 1/2 + 1/2)/3 = 2/3.
    ['1', None], k=1: the None sample scores 0 -> 1/2; k=2: '1' is the only vote -> 1."""
    assert maj_at_k([["1", "1", "2"]], ["1"], 2)[0] == pytest.approx(2 / 3)
    assert maj_at_k([["1", "1", "2"]], ["1"], 1)[0] == pytest.approx(2 / 3)
    assert maj_at_k([["1", "1", "2"]], ["1"], 3)[0] == 1.0
    assert maj_at_k([["1", None]], ["1"], 1)[0] == pytest.approx(0.5)
    assert maj_at_k([["1", None]], ["1"], 2)[0] == 1.0
    assert maj_at_k([[None, None]], ["1"], 2)[0] == 0.0
    assert maj_at_k([["1", "2"]], [None], 1)[0] == 0.0
    assert np.isnan(maj_at_k([["1", "2"]], ["1"], 3)[0])  # k > n


def test_equivalent_spellings_vote_together():
    """'0.5', '1/2' and '\\frac{1}{2}' are one class with 3 votes: it beats '3' (2 votes) at k=5."""
    assert maj_at_k([["0.5", "1/2", r"\frac{1}{2}", "3", "3"]], ["1/2"], 5)[0] == 1.0


@pytest.mark.parametrize("seed", range(6))
def test_maj_at_k_matches_brute_force(seed):
    rng = random.Random(seed)
    answers, gold = [], []
    for _ in range(12):
        pool = [str(rng.randint(0, 4)) for _ in range(rng.randint(1, 5))] + [None] * rng.randint(0, 2)
        answers.append([rng.choice(pool) for _ in range(rng.randint(1, 8))])
        gold.append(str(rng.randint(0, 4)) if rng.random() < 0.9 else None)
    ks = list(range(1, 9))
    got = maj_at_k_from_votes(count_votes(answers, gold), ks)
    for q, k in enumerate(ks):
        for p in range(len(answers)):
            if k > len(answers[p]):
                assert np.isnan(got[q, p])
            else:
                assert got[q, p] == pytest.approx(float(brute_maj(answers[p], gold[p], k)), abs=1e-12)


def test_answers_equal_within_tolerance_vote_together_and_match_brute_force():
    """'0.3333333' and '1/3' are one class (equal within the verifier's tolerance, as Pass@K judges them); they
    were two, each within tolerance of the gold 1/3, so a split majority lost to a wrong answer."""
    assert maj_at_k([["0.3333333", "1/3", "0.33333333", "2", "2"]], ["1/3"], 5)[0] == 1.0  # was 0: 2 beat 1 + 1 + 1
    rng = random.Random(7)
    answers = [[rng.choice(["0.3333333", "1/3", "0.3", None]) for _ in range(8)] for _ in range(10)]
    gold = ["1/3"] * 10
    for k in range(1, 9):
        got = maj_at_k(answers, gold, k)
        for p in range(10):
            expected = brute_maj(answers[p], gold[p], k, classes={"0.3333333": "1/3"})
            assert got[p] == pytest.approx(float(expected), abs=1e-12)


def test_values_equal_within_tolerance_through_another_are_one_class():
    """0.6666667 and 0.666668 are each within tolerance of 2/3 but not of each other (two finite decimals compare
    exactly): with 2/3 among the answers the three are one class, keyed by its most-voted value."""
    third, near_third = Fraction(1, 3), Fraction(3333333, 10_000_000)
    assert merge_within_tolerance(Counter({near_third: 1, third: 3, Fraction(1, 2): 2})) == \
        Counter({third: 4, Fraction(1, 2): 2})
    two_thirds, near, farther = Fraction(2, 3), Fraction(6666667, 10_000_000), Fraction(666668, 1_000_000)
    assert merge_within_tolerance(Counter({near: 3, farther: 1, two_thirds: 2})) == Counter({near: 6})
    assert merge_within_tolerance(Counter({near: 3, farther: 1, Fraction(1, 2): 2})) == \
        Counter({near: 3, farther: 1, Fraction(1, 2): 2})
    integers = Counter({Fraction(5): 2, Fraction(7): 1, "seven": 1})
    assert merge_within_tolerance(integers) is integers  # no repeating value: nothing to compare


def test_pass_at_k_counts_each_sample_the_verifier_calls_correct_whatever_class_it_votes_in():
    """Gold 0.666667; answers 2/3 (within tolerance of the gold), 0.666668 twice (not). Tolerance merges the three
    into one class keyed by 0.666668, a wrong majority: Maj@K is 0, but Pass@1 is the verifier's 1/3 (it was 0)."""
    answers, gold = ["2/3", "0.666668", "0.666668"], "0.666667"
    assert [is_correct(f"A: {answer}", gold) for answer in answers] == [True, False, False]
    samples = sample_rows({"p": [f"A: {answer}" for answer in answers]})
    results = evaluate(samples, {"p": gold}, [1, 2, 3], model="m", dataset="d")
    assert results["pass_at_k"].to_list() == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert results["maj_at_k"].to_list() == [0.0, 0.0, 0.0]
    rng = random.Random(3)  # every problem: Pass@K of the verifier's per-sample verdicts
    pool = ["2/3", "0.6666667", "0.666668", "0.666667", "1/2", None]
    answers = [[rng.choice(pool) for _ in range(6)] for _ in range(30)]
    golds = [rng.choice(["0.666667", "2/3", "0.5"]) for _ in answers]
    votes = count_votes(answers, golds)
    for p, (row, gold) in enumerate(zip(answers, golds)):
        assert votes.n_correct[p] == sum(answer is not None and is_equivalent(answer, gold) for answer in row)


def test_maj_at_k_many_classes_and_big_n_is_a_probability():
    rng = np.random.default_rng(0)
    answers = [[str(x) for x in rng.integers(0, 30, 200)] for _ in range(20)]
    gold = [str(x) for x in rng.integers(0, 30, 20)]
    got = maj_at_k_from_votes(count_votes(answers, gold), [1, 7, 64, 150, 200])
    assert np.all((got >= 0) & (got <= 1))
    votes = count_votes(answers, gold)
    assert got[0] == pytest.approx(votes.n_correct / votes.n)  # maj@1 = fraction of correct samples


@pytest.mark.parametrize(
    "answers",
    [[str(i) for i in range(10)],  # all distinct: every vote a tie at 1
     [str(i) for i in range(7)] + [None] * 3,
     [str(i // 2) for i in range(12)],  # every class twice
     [str(i // 3) for i in range(11)] + ["9", "8"]],
    ids=["distinct", "distinct-with-nones", "pairs", "triples-and-singles"],
)
def test_maj_at_k_with_many_tied_classes_matches_brute_force(answers):
    got = maj_at_k_from_votes(count_votes([answers], ["0"]), range(1, len(answers) + 1))
    for k in range(1, len(answers) + 1):
        assert got[k - 1, 0] == pytest.approx(float(brute_maj(answers, "0", k)), abs=1e-12)


def test_maj_at_k_of_1024_distinct_answers_is_exact():
    """u distinct answers (one the gold) and z Nones: a K-subset scores 1/(1+j) when it holds the gold sample and j
    other answers (all tied at one vote), so Maj@K = Σ_j C(u-1, j) C(z, K-1-j) / ((1+j) C(n, K)); with no Nones, 1/n.
    (Its speed, ~5 s before the (t, s) table and 0.07 s after, is `benchmarks/evaluation.py --distinct`'s.)"""
    ks = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 1023, 1024]
    for u, z in ((1024, 0), (1000, 24)):
        n = u + z
        got = maj_at_k_from_votes(count_votes([[str(i) for i in range(u)] + [None] * z], ["0"]), ks)[:, 0]
        for q, k in enumerate(ks):
            exact = sum(Fraction(comb(u - 1, j) * comb(z, k - 1 - j), 1 + j) for j in range(k)) / comb(n, k)
            assert got[q] == pytest.approx(float(exact), rel=1e-12), k
            assert z or exact == Fraction(1, n)


def sample_rows(model_answers: dict[str, list[str]]) -> pl.DataFrame:
    return pl.DataFrame([
        {"prompt_id": pid, "sample_idx": i, "completion": f"The answer is {a}."}
        for pid, answers in model_answers.items() for i, a in enumerate(answers)
    ])


def test_evaluate_rows_per_k():
    """p1: answers 4,4,5,6 (gold 4); p2: 7,1,1,2 (gold 7).
    pass@1 = (2/4 + 1/4)/2 = 0.375; maj@4 = (1 + 0)/2 = 0.5; pass@4 = 1."""
    samples = sample_rows({"p1": ["4", "4", "5", "6"], "p2": ["7", "1", "1", "2"]})
    results = evaluate(samples, {"p1": "4", "p2": "7", "unused": "0"}, [8, 1, 2, 4], model="sft", dataset="demo")
    assert results.columns == ["model", "dataset", "k", "pass_at_k", "maj_at_k", "n_samples"]
    assert results["k"].to_list() == [1, 2, 4]  # k=8 > 4 samples is dropped
    assert results["pass_at_k"].to_list() == pytest.approx([0.375, 0.5 * (5 / 6 + 1 / 2), 1.0])
    assert results["maj_at_k"][0] == pytest.approx(0.375)
    assert results["maj_at_k"][2] == pytest.approx(0.5)
    assert results["n_samples"].to_list() == [4, 4, 4]
    with pytest.raises(ValueError, match="no answer for prompt_id 'p2'"):
        evaluate(samples, {"p1": "4"}, [1], model="sft", dataset="demo")


def test_evaluate_reads_numeric_answers_for_numeric_gold_and_text_for_text_gold():
    """'A: Let me think. 5+7 = 12' answers 12 for a numeric gold answer; a text gold answer keeps `A: yes`."""
    completions = {"p1": ["A: Let me think. 5+7 = 12", "A: 11"], "p2": ["A: yes.", "A: no, 3 > 2"]}
    samples = pl.DataFrame([{"prompt_id": pid, "sample_idx": i, "completion": text}
                            for pid, texts in completions.items() for i, text in enumerate(texts)])
    results = evaluate(samples, {"p1": "12", "p2": "yes"}, [1], model="sft", dataset="demo")
    assert results["pass_at_k"].to_list() == pytest.approx([0.5])


def test_plot_curves_one_line_per_model():
    samples = sample_rows({"p1": ["4", "4", "5", "6"], "p2": ["7", "1", "1", "2"]})
    results = pl.concat([
        evaluate(samples, {"p1": "4", "p2": "7"}, [1, 2, 4], model=model, dataset="demo") for model in ("sft", "grpo")
    ])
    fig_pass, fig_maj = plot_curves(results)
    for fig in (fig_pass, fig_maj):
        assert isinstance(fig, Figure)
        ax = fig.axes[0]
        assert ax.get_xscale() == "log"
        assert [line.get_label() for line in ax.get_lines()] == ["sft", "grpo"]
        assert list(ax.get_lines()[0].get_xdata()) == [1, 2, 4]
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        assert buffer.getvalue().startswith(b"\x89PNG")
    assert fig_pass.axes[0].get_title() == "Pass@K" and fig_maj.axes[0].get_title() == "Maj@K"


def test_a_model_given_by_its_path_is_named_short_in_plots_that_stay_inside_their_figures():
    """`alignflow eval --model DIR` without --name labels the results with DIR's absolute path: the histograms'
    titles ran past the figure and over each other, the legend past the axes. Plots name it by its last two dirs,
    `final` left out (the stage and key of a workspace's model); a name or a hub id is kept."""
    path = "/home/someone/projects/alignflow-runs/workspace-2026-12/models/dpo/b778cae28da53dc7/final"
    samples = sample_rows({"p1": ["4", "4", "5", "6"], "p2": ["7", "1", "1", "2"]}).with_columns(
        reward=pl.Series([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]), n_tokens=pl.Series([12, 30, 7, 9, 14, 3, 5, 8]))
    results = evaluate(samples, {"p1": "4", "p2": "7"}, [1, 2, 4], model=path, dataset="demo")
    assert results["model"][0] == path  # the eval_results rows keep the full path
    hist = plot_histograms(samples, path)
    fig_pass, _ = plot_curves(results)
    assert hist.get_suptitle() == "dpo/b778cae28da53dc7"
    assert fig_pass.axes[0].get_legend().get_texts()[0].get_text() == "dpo/b778cae28da53dc7"
    for fig in (hist, fig_pass):
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        drawn = fig.get_tightbbox(canvas.get_renderer())  # inches: every title, label and legend
        width, height = fig.get_size_inches()
        assert drawn.x0 >= -0.01 and drawn.y0 >= -0.01 and drawn.x1 <= width + 0.01 and drawn.y1 <= height + 0.01
    left, right = (ax.title.get_window_extent() for ax in hist.axes)
    assert not left.overlaps(right)
    assert [plot_histograms(samples, name).get_suptitle() for name in ("sft", "Qwen/Qwen2.5-0.5B")] == \
        ["sft", "Qwen/Qwen2.5-0.5B"]
