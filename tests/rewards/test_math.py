"""Answer extraction and equivalence: every shipped GSM8K gold answer, hand-written formats, hostile inputs,
malicious completions through the verifier reward (read as text, never run, fast)."""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import time
from fractions import Fraction
from pathlib import Path

import pytest

from pipeline_lib.evaluation import maj_at_k
from pipeline_lib.rewards.math import (
    MAX_NUMBER_CHARS,
    MAX_SCAN_CHARS,
    answer_value,
    boxed_content,
    extract_answer,
    format_number,
    is_correct,
    is_equivalent,
    is_numeric_answer,
)
from pipeline_lib.rewards.registry import combined_reward

GSM8K = Path(__file__).resolve().parents[2] / "data" / "gsm8k"


def gsm8k_records() -> list[dict]:
    records = []
    for path in sorted(GSM8K.glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def test_every_shipped_gsm8k_gold_answer_extracts_to_the_number_after_hashes():
    records = gsm8k_records()
    assert len(records) == 600  # 500 train + 100 test
    for record in records:
        after_hashes = record["answer"].split("####")[-1].strip()
        extracted = extract_answer(record["answer"])
        assert extracted == after_hashes.replace(",", ""), record["answer"]
        assert is_equivalent(extracted, after_hashes)
        assert is_correct(record["answer"], after_hashes)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Janet sells 9 eggs.\n#### 72", "72"),
        ("#### 1,080", "1080"),
        ("The answer is 72", "72"),
        ("So the final answer is: $1,234.50.", "1234.5"),
        ("**Answer:** 42", "42"),
        ("Q: 12+30=?\nA: 42", "42"),
        (r"Therefore \boxed{72}.", "72"),
        (r"\boxed{\frac{1}{2}}", "1/2"),
        (r"\boxed{\dfrac{3}{4}}", "3/4"),
        (r"\boxed{-\frac{1}{2}}", "-1/2"),
        (r"\boxed{72 \text{ dollars}}", "72"),
        (r"\boxed{x = 5}", "5"),
        (r"it costs \$5 and then \boxed{18}", "18"),
        ("She pays $1,234.50 in total", "1234.5"),
        ("The temperature is -5 degrees", "-5"),
        ("It grew by 3.25 meters", "3.25"),
        ("About 3/4 of them", "3/4"),
        ("a change of -1/2", "-1/2"),
        (r"which is \frac{3}{4}", "3/4"),
        ("Growth was 50%.", "50"),
        ("72.0", "72"),
        ("100.", "100"),
        ("2e3 grains", "2000"),
        ("\u22127 degrees", "-7"),  # unicode minus
        ("16 - 3 - 4 = 9", "9"),
        ("5-3 is 2", "2"),  # the minus of an expression is not a sign
        ("The answer is yes.", "yes"),
        ("So the answer is (B).", "B"),  # a choice letter unwrapped
        ("The answer is **(c)**", "c"),
        # priority: #### beats boxed beats "answer is" beats "A:" beats the last number
        (r"\boxed{3} #### 4", "4"),
        (r"The answer is 3. \boxed{5} and then 9", "5"),
        ("A: 2\nThe answer is 6.\n7 more", "6"),
        ("A: 8, not 9 or 10", "8"),
        # a marker followed by reasoning, not a number, is skipped: the last number wins
        ("A: Janet has 16 eggs and earns 18", "18"),
        ("I added 3 and 4 to get 7", "7"),
        ("no digits here", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_answer_formats(text, expected):
    assert extract_answer(text) == expected


def test_only_the_tail_of_a_long_completion_is_read():
    hidden_marker = "#### 5 " + "x" * (MAX_SCAN_CHARS + 10) + " 7"
    assert extract_answer(hidden_marker) == "7"
    # a cut through a number drops the partial number instead of reading a wrong one
    assert extract_answer("12345678" * (MAX_SCAN_CHARS // 4)) is None


@pytest.mark.parametrize(
    ("pred", "gold", "expected"),
    [
        ("1/2", "0.5", True),
        ("72.0", "72", True),
        ("1,000", "1000", True),
        ("$5", "5 dollars", True),
        ("50%", "50", True),
        (r"\frac{3}{4}", "0.75", True),
        ("0.3333333", "1/3", True),  # a repeating value vs a decimal: within 1e-6 relative + absolute
        ("-0.6666667", r"-\frac{2}{3}", True),
        ("0.333", "1/3", False),
        ("1000001", "1000000", False),  # two finite decimals compare exactly: an off-by-one is wrong
        ("123456789", "123456800", False),
        ("0.0000009", "0", False),
        ("1/3000000", "0", False),  # within 1e-6 absolute, but no significant digit agrees
        ("0.000001", "1/3000000", False),
        ("0.000000333333", "1/3000000", True),
        ("0.166667", "1/6", True),
        ("0.058824", "1/17", True),  # six places of a small repeating value: relative error 8e-6
        ("0.001667", "1/600", True),  # six places, four significant digits: relative error 2e-4
        ("0.0001667", "1/6000", True),
        ("0.000167", "1/6000", False),  # six places but three significant digits
        ("2.50", "2.5", True),
        ("1{,}000", "1000", True),
        (r"1.2 \times 10^{3}", "1200", True),
        ("2 × 10^-3", "0.002", True),
        ("-2", "2", False),
        ("Yes", "yes.", True),
        ("  Paris ", "paris", True),
        ("(B)", "B", True),
        ("(B)", "C", False),
        ("(x+1)", "x+1", False),  # only a single letter is a choice
        ("paris", "london", False),
        ("72", "seventy-two", False),
        (None, "72", False),
        ("72", None, False),
        (None, None, False),
    ],
)
def test_is_equivalent(pred, gold, expected):
    assert is_equivalent(pred, gold) is expected
    assert is_equivalent(gold, pred) is expected


@pytest.mark.parametrize(
    "completion",
    ["Q: How many? A: Let me think. 5+7 = 12",
     "Hmm, so the answer is wrong. Let me redo it: 3*4 = 12",
     "My first answer is incorrect; recomputing, 5+7 = 12"],
)
def test_a_numeric_gold_answer_skips_text_after_a_marker(completion):
    """A marker followed by digit-free words is a text answer only when the gold answer is text."""
    assert extract_answer(completion, numeric=True) == "12"
    assert is_correct(completion, "12")
    assert not is_correct(completion, "13")


@pytest.mark.parametrize(("completion", "gold"), [
    ("The answer is １，０００", "1000"), ("答案是１２，３４５。", "12345"), ("The answer is ３．５", "3.5"),
    ("答案是 3，4", "3"), ("答案是5，因为", "5"),
])
def test_a_fullwidth_comma_or_full_stop_in_a_number_reads_as_the_ascii_one(completion, gold):
    """`１，０００` was 1 and `３．５` was 3 (fullwidth digits themselves were read): the fullwidth separators between
    digits now read as `,` and `.` do, and elsewhere (CJK text's commas) stay as they are."""
    ascii_text = completion.replace("，", ",").replace("．", ".")
    assert extract_answer(completion) == extract_answer(ascii_text) == gold
    assert is_correct(completion, gold)


def test_a_text_gold_answer_still_reads_text_after_a_marker():
    assert is_correct("The answer is yes.", "Yes")
    assert is_numeric_answer("1,234") and is_numeric_answer(r"\frac{1}{2}")
    assert not is_numeric_answer("yes") and not is_numeric_answer(None)


def test_format_number_is_canonical():
    assert format_number(Fraction(2469, 2)) == "1234.5"
    assert format_number(Fraction(-1, 8)) == "-0.125"
    assert format_number(Fraction(1, 3)) == "1/3"  # no terminating decimal
    assert format_number(Fraction(3, 4), as_fraction=True) == "3/4"
    assert format_number(Fraction(-6, 2)) == "-3"


def test_answer_value_merges_spellings_of_one_number():
    assert answer_value("1/2") == answer_value("0.50") == answer_value(r"\frac{1}{2}") == Fraction(1, 2)
    assert answer_value("1,000 apples") == 1000
    assert answer_value("Some Text.") == "sometext"  # text compares without spaces, as the MATH grader does


def test_a_boxed_gold_answer_is_read_as_its_box():
    assert answer_value(r"\boxed{5}") == answer_value(r"\boxed{x = 5}") == 5
    assert answer_value(r"$\boxed{\frac{1}{2}}$") == Fraction(1, 2)
    assert answer_value(r"\boxed{(1, 2)}") == "(1,2)"
    assert is_numeric_answer(r"\boxed{5}") and is_correct(r"The answer is \boxed{5}.", r"\boxed{5}")
    assert is_correct("so it is 0.5", r"$\boxed{\frac{1}{2}}$") and not is_correct("6", r"\boxed{5}")
    # MATH's solutions also write `\boxed 5`: a box up to the next `$` (or the line's end), and the last box wins
    # (the braced one before it was read instead; alone, the solution had "no \boxed{} answer")
    assert boxed_content(r"$\boxed{3}$ candidate; the final answer is $\boxed 5$.") == "5"
    assert boxed_content("so $\\boxed \\frac12$ here\n") == r"\frac12"
    assert answer_value(r"$\boxed \frac12$") == Fraction(1, 2)
    assert boxed_content("\\boxed 12\nnext line") == "12" and boxed_content(r"\boxed $") is None
    assert is_correct(r"The answer is $\boxed 9$.", "9") and not is_correct(r"$\boxed 9$", "8")
    # the command named in prose after a box is no box (the review: the answer became "as asked.)")
    assert extract_answer(r"The answer is \boxed{7}. (I put it in \boxed as asked.)") == "7"
    assert extract_answer("So $x=\\boxed{7}$.\nNote: \\boxed is a LaTeX command.\n\\fbox here") == "7"
    assert boxed_content(r"$\boxed -3$") == "-3" and boxed_content(r"$\boxed (1, 2)$") == "(1, 2)"


def test_a_plain_mixed_number_gold_answer_is_its_value():
    """`1 1/2` as a gold answer was the text `11/2`, which no completion matched."""
    assert answer_value("1 1/2") == answer_value("-1 1/2") * -1 == Fraction(3, 2)
    assert is_numeric_answer("2 3/4 cups")
    for completion in ("The answer is 1.5", "The answer is 3/2", "#### 1 1/2"):
        assert is_correct(completion, "1 1/2")
    assert not is_correct("The answer is 11/2", "1 1/2") and not is_correct("The answer is 1", "1 1/2")


# ---- LaTeX thousands separators, powers of ten, long canonical numbers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is $1{,}000$.", "1000"),  # `{,}` is LaTeX's plain comma
        ("So she earns $2{,}500 per month. #### 2{,}500", "2500"),
        (r"\boxed{1{,}000}", "1000"),
        (r"\boxed{\$1{,}234.50}", "1234.5"),
        ("a total of 12{,}345{,}678 grains", "12345678"),
        ("The answer is 1.2 × 10^3", "1200"),
        (r"\boxed{3 \times 10^3}", "3000"),
        (r"\boxed{1.5\times10^{3}}", "1500"),
        (r"The answer is $3\cdot10^{-2}$.", "0.03"),
        (r"\boxed{-2.5 \times 10^{+2}}", "-250"),
        ("about 4 x 10^2 people", "400"),
        ("#### 7·10^1", "70"),
        ("a 2 x 10 grid", "10"),  # no power of ten: two numbers, the last one wins
        ("2 × 10 = 20", "20"),
        # \( \) and \[ \] delimit math like $: the number after `answer is` wins over later ones (it lost before)
        ("So the answer is \\(1234\\).\nCheck: 1234 - 34 = 1200.", "1234"),
        ("The answer is \\(\\$1,234\\). (That is 1000 + 234.)", "1234"),
        ("The answer is \\(1{,}234\\) dollars, i.e. 12 bills.", "1234"),
        ("The answer is \\[\\frac{3}{4}\\] of the cake, not 1/2.", "3/4"),
        ("\\(\\boxed{42}\\) and then 7", "42"),
    ],
)
def test_extract_answer_reads_latex_separators_and_powers_of_ten(text, expected):
    assert extract_answer(text) == expected
    assert extract_answer(text, numeric=True) == expected


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("The answer is $1{,}000$.", "1000", True),
        ("The answer is $1{,}000$.", "1", False),  # read as 1 before: a false positive
        ("The answer is 1.2 × 10^3.", "1200", True),
        ("The answer is 1.2 × 10^3.", "1.2", False),  # read as 1.2 before: a false positive
        ("#### 2{,}500", "2500", True),
        (r"\boxed{3 \times 10^3}", "3000", True),  # a number, not the text `3 \times 10^3`
        (r"\boxed{1{,}000}", "1e3", True),
        (r"\boxed{3\cdot10^{-2}}", "3/100", True),
    ],
)
def test_is_correct_reads_latex_separators_and_powers_of_ten(completion, gold, expected):
    assert is_correct(completion, gold) is expected


# ---- a number token stays on one line; a power (`10^3`, `2^10`) is evaluated


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a number ending one line does not join a markdown bullet (or a `/`) starting the next: the last number wins
        ("total 12\n* 10^2", "100"),  # 10^2, not 12 × 10^2 = 1200
        ("total 12\n× 10^3", "1000"),
        ("4 ×\n10^3", "1000"),
        ("12\n/ 4", "4"),  # not 12/4
        ("12 /\n4", "4"),
        ("$\n5", "5"),  # a `$` ending a line: the number after it reads the same either way
        ("The answer is 5\n* 10^2 = 100 is unrelated", "5"),
        # spaces that are not line breaks still join: tabs, no-break and thin spaces
        ("1.2\t×\t10^3", "1200"),
        ("1.2\u202f×\u202f10^3", "1200"),
        ("3\u00a0/\u00a04", "3/4"),
        # a bare power of ten, braces and a signed exponent optional
        ("The answer is 10^3", "1000"),
        (r"\boxed{10^{3}}", "1000"),
        ("The answer is 10^-2.", "0.01"),
        (r"\boxed{10^{-2}}", "0.01"),
        ("#### 10^{+2}", "100"),
        ("a change of -10^2", "-100"),
        (r"\boxed{10^6 \text{ cells}}", "1000000"),
        ("The answer is 10^101", None),  # beyond MAX_EXPONENT: ignored
        # any integer power is evaluated, within 10^±MAX_EXPONENT; a power that cannot be read leaves no number
        ("2^10", "1024"),
        ("The answer is 2^10", "1024"),  # read as 2 before: a false positive against gold 2
        (r"\boxed{2^{10}}", "1024"),
        ("2 ^ 10", "1024"),
        ("2^10.", "1024"),
        ("1.5^2", "2.25"),
        ("-2^2", "-4"),  # the power binds before the sign
        ("2^-2", "0.25"),
        ("1/2^3", "1/8"),  # a power on the denominator
        ("110^2", "12100"),  # base 110, not 10
        ("0x10^2", "0"),  # 0 × 10^2
        ("0^-1", None),
        ("9^999999", None),  # beyond MAX_EXPONENT: refused before any power is built
        ("99^100", None),  # beyond 10^MAX_EXPONENT
        ("1.00001^100", None),  # 500 decimal places
        ("The answer is 1.0000001^-50/1.0000003^50", None),  # a canonical text over MAX_ANSWER_CHARS
        # an exponent is never a number of its own, and a number with an exponent it cannot read is none
        ("x^2", None),
        ("x^{2}", None),
        ("x^ 2", None),
        ("x^-2", None),
        ("e^{10}", None),
        ("The area is 16 cm^{2}.", "16"),
        ("2^x", None),
        ("2^(10)", None),
        ("2^10^2", None),
        ("the answer is 2^{10}^{2}", None),
        ("The answer is 4^0.5", None),  # read as 1 (4^0) by a first draft: a false positive
        ("10^2.5", None),
        ("Final: (-2)^2", None),
        (r"\left(\frac{3}{2}\right)^2", None),
        ("Total: 20 ^^", "20"),  # a caret without an exponent
        ("The total is 5, so 2^x", "5"),
        (r"\boxed{x^2}", "x^2"),
    ],
)
def test_extract_answer_keeps_numbers_on_one_line_and_reads_powers(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("The answer is 10^3", "1000", True),
        ("The answer is 10^3", "10", False),  # read as 10 before: a false positive
        ("The answer is 10^2", "100", True),  # read as 10 before: a false negative
        (r"\boxed{10^{3}}", "1000", True),  # read as the text `10^{3}` before
        (r"\boxed{10^{-3}}", "0.001", True),
        ("The answer is 1000", "10^3", True),  # a gold answer written as a power of ten
        ("total 12\n* 10^2", "1200", False),  # two lines are two numbers
        ("total 12\n* 10^2", "100", True),
        ("The answer is 2^10", "1024", True),
        ("The answer is 2^10", "2", False),  # read as 2 before: a false positive
        ("The answer is 2^10", "10", False),
        (r"\boxed{2^{10}}", "2", False),
        (r"\boxed{2^{10}}", "1024", True),
    ],
)
def test_is_correct_reads_powers(completion, gold, expected):
    assert is_correct(completion, gold) is expected


# ---- Python's `**` is a power like `^` (issue: `2**10` was read as its base 2), markdown bold's `**` is not

@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 2**10", "1024"),  # read as 2 before: the base
        ("2**10", "1024"),  # read as 10 before: the exponent
        ("The answer is 2 ** 10", "1024"),
        ("The answer is 2**10.", "1024"),
        (r"\boxed{2**10}", "1024"),  # the text `2**10` before
        ("#### 2**10", "1024"),
        ("the answer is 2**{10}", "1024"),
        ("1/2**3", "1/8"),  # a power on the denominator
        ("2*10**3", "2000"),  # a power of ten
        ("2 * 10**-3", "0.002"),
        ("2**-2", "0.25"),
        ("-2**2", "-4"),  # the power binds before the sign, as in Python
        ("1.5**2", "2.25"),
        ("The answer is 10**400", None),  # beyond MAX_EXPONENT: refused, never computed, never 10
        ("9**9**9", None),  # a tower, as 2^10^2: no number
        ("The answer is 10**10**10", None),
        ("The answer is 2**n", None),  # an exponent it cannot read leaves no number
        ("The answer is 2**n + 1", None),
        ("The answer is 2**(10)", None),
        ("The answer is 4**0.5", None),
        ("2**0.5", None),  # read as 0.5 before
        ("2**10x", None),
        ("(3/2)**2", None),
        ("x**2", None),  # an exponent with no number before it
        ("f(x)**2", None),
        ("The answer is 2**10 + 1", None),  # an unfinished expression
    ],
)
def test_a_python_power_is_read_as_the_caret_power_never_as_its_base(text, expected):
    assert extract_answer(text) == expected
    assert extract_answer(text, numeric=True) == expected
    assert extract_answer(text.replace("**", "^")) == expected  # `**` reads as `^` does


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("The answer is 2**10", "2", False),  # True before: the base
        ("The answer is 10**400", "10", False),  # True before
        ("The answer is 10**10**10", "10", False),  # True before
        ("2**10", "10", False),  # True before: the exponent, read as the last number
        ("The answer is 2**n", "2", False),  # True before
        ("The answer is 2**10", "1024", True),  # False before
        ("The answer is 1024", "2**10", True),  # a gold answer written as a Python power; False before
    ],
)
def test_is_correct_never_takes_a_python_powers_base(completion, gold, expected):
    assert is_correct(completion, gold) is expected


def test_markdown_bold_around_numbers_and_powers_is_never_a_power():
    """A `**` with a space on one side, or with punctuation, a word or nothing after it, is markdown bold's: its
    number stays a number. The bold-wrapped powers (the last rows) read as their values, not their bases."""
    cases = {
        "The answer is **42**": "42",
        "The answer is **42**.": "42",
        "**Answer:** 42": "42",
        "**Answer: 42**": "42",
        "The answer is: **$25**": "25",
        "Total is **42** apples": "42",
        "the **5**th": "5",
        "答案是**42**": "42",
        "is**42**": "42",
        "The answer is **12** (12 apples)": "12",
        "The answer is **2 1/2** cups": "5/2",
        "The answer is **2**10**.": "1024",  # read as 2 before
        "**Answer:** 2**10": "1024",  # read as 2 before
        "So it is **2 ** 10** apples": "1024",  # read as 10 before
    }
    assert {text: extract_answer(text) for text in cases} == cases


# written in at most MAX_NUMBER_CHARS characters, but canonically longer (1e100 is 101 digits)
LONG_NUMBERS = [
    "1e100",
    "1e-99",
    "2.5e-98",
    "-9.5e100",
    "-.5e-100",
    "9" * 96 + "e100",  # the largest: 196 digits
    "1e-100/" + str(2**308),  # the longest canonical text: 410 decimal places
    "1e100/7",  # canonically a 103-character fraction
    r"3 \times 10^{-100}",
    "10^{100}",
    "10^-100",
    "1.001^100",  # 300 decimal places
    "0.5^100",
    "1/7^{100}",
    "-2.5e-98/7^100",
    "2^-100",
]


@pytest.mark.parametrize("number", LONG_NUMBERS)
def test_every_accepted_number_round_trips_through_its_canonical_text(number):
    """extract -> canonical text -> value gives the value of the number as written, whatever its length."""
    assert len(number) <= MAX_NUMBER_CHARS
    completion = f"The answer is {number}"
    extracted = extract_answer(completion, numeric=True)
    assert extracted is not None
    assert isinstance(answer_value(number), Fraction)
    assert answer_value(extracted) == answer_value(number)
    assert is_correct(completion, number)
    assert is_correct(completion, extracted)


def test_long_numbers_vote_together_and_stay_distinct():
    # Maj@K votes on answer_value: the canonical text of 1e100 and the gold `1e100` are one class
    assert answer_value("1" + "0" * 100) == answer_value("1e100") == 10**100
    assert not is_correct("The answer is 1e100", "1e99")
    assert not is_correct("The answer is 1e-99", "1e-98")
    assert not is_correct("The answer is 1" + "0" * 150, "1" + "0" * 150)  # longer than MAX_NUMBER_CHARS: ignored


HOSTILE = {
    "10 MB of digits": "9" * 10_000_000,
    "10 MB of comma groups": "1," * 5_000_000,
    "power tower": "9**9**9",
    "python injection": "__import__('os').system('x')",
    "huge exponent": "1e999999",
    "huge exponent after marker": "The answer is 1e999999",
    "huge numerator": "1" * 5000 + "/3",
    "huge denominator boxed": r"\boxed{\frac{1}{" + "7" * 5000 + "}}",
    "unclosed boxes": "\\boxed{" * 200_000,
    "unclosed fracs": "\\frac{" * 200_000,
    "many markers": "The answer is " * 200_000,
    "spaces then a digit": "72" + " " * 1_000_000 + "x5",
    "slashes": "1/" * 500_000,
    "dots": "1." * 500_000,
    "huge power of ten": r"The answer is 3 \times 10^{999999}",
    "long power of ten": "2 × 10^" + "9" * 1_000_000,
    "many powers of ten": "2 x 10^" * 300_000,
    "LaTeX separator groups": "1" + "{,}000" * 1_000_000,
    "huge bare power of ten": r"\boxed{10^{999999}}",
    "long bare power of ten": "10^" + "9" * 1_000_000,
    "unclosed bare powers of ten": "10^{" * 300_000,
    "line-broken powers of ten": "1\n* 10^" * 300_000,
    "grouped thousands then a caret": "1" + "\u202f000" * 300_000 + "^",
    "comma groups then a caret": "1" + ",000" * 300_000 + "^x",
    "power towers": "2^" * 500_000,
    "unclosed exponent braces": "x^{" * 300_000,
    "unclosed exponent parentheses": "x^(" * 300_000,
    "powers on denominators": "1/2^" * 300_000,
    "huge power": "The answer is 9^999999",
    "long exponent": "2^" + "9" * 1_000_000,
    "python power towers": "2**" * 500_000,
    "spaced python power towers": "2 ** " * 300_000,
    "huge python power": "The answer is 9**999999",
    "long python exponent": "2**" + "9" * 1_000_000,
    "unclosed python exponent parentheses": "x**(" * 300_000,
    "unclosed python exponent braces": "2**{" * 300_000,
    "bold numbers": "**42** " * 200_000,
    "bold": "*" * 1_000_000,
    "arithmetic without an equals sign": "The answer is " + "1 + " * 300_000,
    "equals signs": "The answer is " + "1 = " * 300_000,
    "signs inside dollars": "$-" * 500_000,
    "markers ending their lines": "The answer is:\n" * 100_000,
    "a marker then blank lines": "The answer is:" + "\n" * 1_000_000 + "5",
    "mixed numbers": "1\\frac{2}{3}" * 100_000,
    "plain mixed numbers": "1 2/3 " * 200_000,
    "long whole numbers before fractions": ("9" * 150 + " \\frac12") * 5_000,
    "vulgar fractions": "1½" * 300_000,
    "superscripts": "10³⁴" * 300_000,
    "Chinese markers": "答案是" * 300_000,
    "headings": "#### 2. Step\n" * 100_000,
    "unit powers": r"\boxed{5 " + "m^2/" * 100_000 + "}",
    "clock times": "3:00 PM " * 300_000,
    "colons": "10:" * 400_000,
    "answer labels": "\nA:" * 300_000,
    "numbered headings": "#### 3 Steps to Solve\n" * 100_000,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_inputs_finish_fast_and_never_evaluate(name):
    text = HOSTILE[name]
    start = time.perf_counter()
    extracted = extract_answer(text)
    equivalent = is_equivalent(text, "9")
    is_equivalent(extracted, "1")
    assert time.perf_counter() - start < 1.0
    assert equivalent is False
    assert extracted is None or len(extracted) <= 120


def test_hostile_values_are_rejected_not_computed():
    assert extract_answer("1e999999") is None  # 10**999999 is never built
    assert extract_answer("9**9**9") is None  # a power tower leaves no number (was read as its base 9)
    assert extract_answer("The answer is 9**999999") is None  # refused before any power is built
    assert extract_answer("The answer is 10**400") is None
    assert extract_answer("__import__('os').system('x')") is None
    assert extract_answer("9" * 10_000_000) is None  # longer than MAX_NUMBER_CHARS
    assert extract_answer("x 1" + "0" * 150) is None
    assert extract_answer("1/0") is None
    assert extract_answer("The answer is 3 × 10^999999") is None
    assert extract_answer("The answer is 10^999999") is None
    assert not is_correct(r"\boxed{3 \times 10^{999999}}", "3")  # read as text, not as 3
    assert answer_value("9" * 5000) == "9" * 5000  # text, never int(): Python refuses int() of 4300+ digits


# ---- malicious completions through the verifier reward the stages use (issue #8, security)

# text -> (gold answer, expected reward): the reward comes from reading the text, never from running it
MALICIOUS = {
    "python program": ("import os\nos.system('touch MARKER')\nprint(42)", "42", 1.0),
    "eval bait": ("eval(\"__import__('os').system('touch MARKER')\")", "0", 0.0),
    "shell": ("$(touch MARKER) `touch MARKER`; rm -rf / ; echo 7", "7", 1.0),
    "power tower": ("The answer is 10**10**10", "10000000000", 0.0),  # no number, never raised to a power
    "a million nines": ("9" * 10**6, "9", 0.0),
    "deeply nested parens": ("(" * 100_000 + "1" + ")" * 100_000, "1", 0.0),
    "deeply nested boxes": ("\\boxed{" * 50_000 + "3" + "}" * 50_000, "3", 0.0),
    "format-string bait": ("{0.__class__.__mro__[1].__subclasses__()}", "0", 0.0),
    "division by zero": ("\\boxed{\\frac{1}{0}}", "0", 0.0),
}


@pytest.mark.parametrize("name", list(MALICIOUS))
def test_malicious_completion_is_read_as_text_never_run(name, tmp_path, monkeypatch):
    text, gold, expected = MALICIOUS[name]
    # a relative marker, so the text (and the numbers the verifier reads) never holds tmp_path's digits
    monkeypatch.chdir(tmp_path)
    text = text.replace("MARKER", "ran")
    ran: list[str] = []

    def refuse(what: str):
        def call(*args, **kwargs):
            ran.append(what)
            raise AssertionError(f"the verifier called {what}")
        return call

    reward = combined_reward([{"name": "verifier"}])
    for module, name_ in ((builtins, "eval"), (builtins, "exec"), (builtins, "compile"), (os, "system"),
                          (os, "popen"), (subprocess, "Popen")):
        monkeypatch.setattr(module, name_, refuse(f"{module.__name__}.{name_}"))
    start = time.perf_counter()
    total, _ = reward(["q"], [text], answers=[gold], lengths=[len(text)])
    seconds = time.perf_counter() - start
    monkeypatch.undo()
    assert ran == [] and not (tmp_path / "ran").exists()
    assert total == [expected]
    assert seconds < 1.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 12\u202f345", "12345"),  # narrow no-break, no-break and thin spaces group thousands
        ("\\boxed{2\u00a0500}", "2500"),
        ("1\u2009000.5", "1000.5"),
        ("The answer is 1\u202f000\u202f000.", "1000000"),  # read as 1 before
        ("The answer is 1\u202f000,000", "1000"),  # one kind of separator per number
        ("1\u202f0001", "1"),  # not a group of three
        # a plain space is not a thousands separator: it separates a count from a compound unit or a list's items
        ("The answer is 2 100-dollar bills.", "2"),
        ("He bought 2 250-gram packs of butter.", "250"),
        ("The list is 100 200 300", "300"),
        ("16 - 3 = 13", "13"),
    ],
)
def test_extract_answer_reads_space_separated_thousands(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a minus after the dollar sign (`$-5$` in LaTeX math) is the number's sign; before it, as before
        ("The answer is $-5$. Check: 3 - 8 = -5, plus 2.", "-5"),
        ("#### $-5 (2 left)", "-5"),
        ("The answer is $ -5$, i.e. 2 fewer.", "-5"),
        ("It lost -$5 today", "-5"),
        ("$10-$5", "5"),  # the minus of an expression is still no sign
        # a marker followed by arithmetic: what the working comes to, after its last `=`
        ("The answer is 5 + 7 = 12.", "12"),
        ("Q: What is 12+30? A: 12+30=42", "42"),
        ("#### 5+7=12", "12"),
        ("The answer is 3 * 4 = 12", "12"),
        ("The answer is 3 x 4 = 12 apples", "12"),
        ("The answer is 2 × 3 + 1 = 7 = 7", "7"),
        # ...but a sentence end stops the arithmetic, and a fraction alone is no working
        ("The answer is 12. 3 + 8 = 11", "12"),
        ("The answer is 5 dollars. 3 + 4 = 7", "5"),
        ("The answer is 3.", "3"),
        ("The answer is -2.5.", "-2.5"),
        ("The answer is 2/3 = 0.667", "2/3"),
        # a marker that ends its line: the number starting the next non-blank line
        ("Final answer:\n18 dollars (9 x 2)", "18"),
        ("The answer is:\n\n42", "42"),
        ("**Answer:**\n  $1,200", "1200"),
        ("A:\nLet me think. 5+7 = 12 so 3", "3"),  # no number starts the next line: the last number wins
    ],
)
def test_extract_answer_reads_signs_in_dollars_worked_equations_and_the_line_after_a_marker(text, expected):
    """Wrong answers a review of ordinary completions found (2026-12-02): before, these gave -5 -> 2 (the last
    number), 5 + 7 = 12 -> 5 (the first operand), `Final answer:\\n18 ... (9 x 2)` -> 2."""
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # mixed numbers, in LaTeX and Unicode: the whole number and the fraction add up (were digits run together)
        (r"\boxed{1\frac{1}{2}}", "3/2"),
        (r"The answer is 2 \frac34 cups.", "11/4"),
        (r"\boxed{-1\dfrac{1}{2}}", "-3/2"),
        ("She ate 2½ pies", "5/2"),
        ("The answer is ¾.", "3/4"),
        ("1⁄2", "1/2"),
        (r"x = \frac{1}{2}", "1/2"),  # a fraction alone is as before
        # plain text: a whole number, a space and a proper fraction (were 1, or the fraction alone)
        ("The answer is 1 1/2", "3/2"),
        ("#### 2 3/4", "11/4"),
        ("So she needs 1 1/2 cups.", "3/2"),
        ("The answer is -1 1/2", "-3/2"),
        ("She ate 2 1/2 pies, so 5 are left.", "5"),
        ("3 5/4", "5/4"),  # an improper fraction is no mixed number's part: the numbers as written
        ("1 1/0", "1"),
        ("Due 1 3/4/2024", "2024"),  # a date's slashes
        # superscript powers and other minus signs
        ("There are 10³ cells", "1000"),
        ("The answer is －5", "-5"),
        # a markdown heading is no GSM8K marker; GSM8K's own markers are read as before
        ("#### 2. Add the costs\n5 + 7 = 12", "12"),
        ("#### 1) Setup\nSo the total is 30", "30"),
        ("#### 72", "72"),
        ("#### 72.", "72"),
        # boxed answers with units, fonts and a plus sign
        (r"\boxed{16 \text{ cm}^2}", "16"),
        (r"\boxed{5 \text{ m/s}^{2}}", "5"),
        (r"\boxed{\mathbf{12}}", "12"),
        (r"\boxed{+5}", "5"),
        # a boxed number inside extra braces or parentheses is the number; a tuple or an expression stays text
        (r"\boxed{{12}}", "12"),
        (r"\boxed{(-12)}", "-12"),
        (r"\boxed{\left(\frac{1}{2}\right)}", "1/2"),
        (r"\boxed{ {( 7 )} }", "7"),
        (r"\boxed{(1, 2)}", "(1, 2)"),
        (r"\boxed{(x+1)}", "(x+1)"),
        (r"\boxed{(1)+(2)}", "(1)+(2)"),
        # LaTeX math's `$` before a marker's number
        (r"The answer is $\$18$.", "18"),
        ("The answer is: **$25**", "25"),
        # Chinese: numbers right after Han characters, and the `答案是` marker
        ("所以答案是72。", "72"),
        ("答案：18元，共3天", "18"),
        ("共有72个苹果，吃了5个", "5"),
        ("答案是" * 5_000 + "所以答案是72。", "72"),  # a tail without spaces past MAX_SCAN_CHARS is kept
        ("x2", None),  # a Latin letter still starts a word
    ],
)
def test_extract_answer_reads_mixed_numbers_units_headings_and_chinese(text, expected):
    """Wrong answers the verifier review of 2026-12-02 listed as left: `1\\frac{1}{2}` gave 11/2, `2½` and `10³` gave
    2 and 10, `#### 2. Step` was read as GSM8K's answer, boxed units in LaTeX, `\\mathbf` and `+5` were text, and
    `答案是72` gave nothing (a number after a Han character was taken for part of a word)."""
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a numbered list after a marker that ends its line is the working, not the answer
        ("Let's work out the answer:\n1. Janet's ducks lay 16 eggs.\n2. She keeps 7: 16 - 7 = 9.\n"
         "3. At $2 each: 9 * 2 = $18.\nSo she makes $18 every day.", "18"),
        ("Steps to get the answer:\n\n1) 16 - 3 - 4 = 9\n2) 9 * 2 = 18\n\nShe makes 18 dollars.", "18"),
        ("The answer is:\n  2. Then 5 more makes 7", "7"),
        ("Final answer:\n18.", "18"),  # a number alone on its line still is the answer
        # a sign spaced from its number in a box: the MATH grader compares without spaces
        (r"\boxed{- 5}", "-5"),
        (r"\boxed{ + 5 }", "5"),
        (r"\boxed{- \frac{1}{2}}", "-1/2"),
        (r"\boxed{x = - 3}", "-3"),
    ],
)
def test_extract_answer_skips_a_list_after_a_marker_and_reads_a_spaced_boxed_sign(text, expected):
    """Wrong answers of the verifier review of 2026-12-04: the list label `1.` after `answer:` was the answer
    (a right completion marked wrong, a wrong `1` marked right), and `\\boxed{- 5}` was the text `- 5`."""
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        # a gold answer read as an extracted one is: math-mode dollars, bold, an equation's right-hand side
        ("The answer is $18$.", "$18$"),
        ("$18$", "$18$"),
        (r"\boxed{\frac{1}{2}}", r"$\frac{1}{2}$"),
        ("So the answer is 18.", "**18**"),
        (r"\boxed{x=5}", "x=5"),
        (r"\boxed{y=2x+3}", "y = 2x+3"),
        ("The answer is x=5.", "x = 5"),
        ("The answer is 0.5", "$.5$"),  # the period a number starts with stays
        # MATH-style text answers: no spaces, \left/\right, one spelling of \frac, `\sqrt2` is `\sqrt{2}`
        (r"\boxed{(3, \frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)"),  # MATH-500's first gold
        (r"\boxed{(1, 2)}", "(1,2)"),
        (r"\boxed{2\sqrt{3}}", r"2 \sqrt{3}"),
        (r"\boxed{\dfrac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),
        (r"\boxed{\sqrt2}", r"\sqrt{2}"),
    ],
)
def test_gold_answers_are_read_like_extracted_ones(completion, gold):
    """Verifier review of 2026-12-04: each of these completions, some the gold written out, scored 0."""
    assert is_correct(completion, gold)


def test_maj_at_k_votes_one_text_answer_written_with_and_without_spaces():
    assert maj_at_k([["(1, 2)", "(1,2)", "(1, 2)", "(1,2)", "(3,4)", "(3,4)", "(3,4)"]], ["(1,2)"], 7).tolist() == [1.0]
    assert not is_correct(r"\boxed{(1, 3)}", "(1,2)") and not is_correct(r"\boxed{\sqrt{3}}", r"\sqrt2")
    assert not is_correct("The answer is 5", "$.5$")


def test_answers_spelled_differently_are_one_value():
    assert is_correct("The answer is 2½", "2.5") and is_correct(r"\boxed{\frac{5}{2}}", r"2\frac12")
    assert answer_value("x²") == answer_value("x^{2}")
    assert answer_value("+5") == answer_value("5") == 5



# ---- an `A:` label, a `####` heading and a clock time, read as a user would (third verifier review, 2026-12-04)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # `A:` after a word names a part or a choice, not the answer (all gave the first part's number)
        ("Part A: 12 apples. Part B: 6 apples. Total: 18", "18"),
        ("Option A: 5\nOption B: 7\nSo the total is 12", "12"),
        ("Step A: 3 + 4 = 7. Step B: 7 * 2 = 14", "14"),
        # ...but at the start of a line or after a sentence's end it is the Q/A format's answer label, as before
        ("Q: 12+30=?\nA: 42\nQ: 5+5=?", "42"),
        ("Q: How many eggs are left? A: 9, since 16 - 7 = 9", "9"),
        ("We add them. A: 12 apples, not 6", "12"),
        ("**A:** 42 (6 x 7)", "42"),
        ("  A: 8\nCheck: 4 + 4 = 8 of 10", "8"),
        # a `####` heading whose number goes on with words and has text below it is no GSM8K answer (all gave 3)
        ("#### 3 Steps to Solve\n1. 16 - 3 - 4 = 9\n2. 9 * 2 = 18\nThe answer is 18.", "18"),
        ("#### 3 Steps to Solve\nShe sells 9 eggs.\n\\boxed{18}", "18"),
        ("#### 3 Steps to Solve\nShe sells 9 eggs at $2: 9 * 2 = 18", "18"),
        # ...but a `####` line holding only its number counts wherever it is, and one with a unit ending the text
        ("Janet sells 9 eggs.\n#### 72", "72"),
        ("#### $1,080.\n\nI hope this helps! The answer is 3 dollars off.", "1080"),
        ("#### 72\nThe answer is 70", "72"),
        ("####\n72\nDone in 2 steps.", "72"),
        ("She makes 9 * 2 = 18.\n#### 18 dollars\n\n", "18"),
        ("#### 18 dollars\nThe answer is 20", "20"),
        # a clock time is text, never its hour or its minutes (gave 3, 0 and 45)
        ("The answer is 3:00 PM", "3:00 PM"),
        ("The answer is 3:00 p.m. sharp.", "3:00 PM"),
        ("The answer is:\n11:30am", "11:30 AM"),
        ("The answer is 12:30:45.", "12:30:45"),
        (r"\boxed{3:00pm}", "3:00 PM"),
        ("The meeting is at 3:00 PM", "3:00 PM"),
        ("The train leaves at 5 and arrives at 7:45.", "7:45"),
        # ...while numbers next to colons read as before: no two-digit minutes, no hour, or no colon
        ("The ratio is 3:2, so she gets 2", "2"),
        ("Day 1: 50 eggs, day 2: 100", "100"),
        ("It took 90:15 minutes", "15"),
        ("The answer is 3.", "3"),
        ("It starts at 3 PM", "3"),
        # an unclosed box is no box: the marker before it or the last number, as before
        ("\\boxed{12", "12"),
        ("\\boxed{12 apples and 3", "3"),
        ("The answer is 5. \\boxed{12", "5"),
    ],
)
def test_extract_answer_reads_answer_labels_headings_and_clock_times(text, expected):
    """Wrong answers of the third verifier review (2026-12-04): `Part A: 12 ...` gave 12 (`A:` read as the Q/A label),
    `#### 3 Steps to Solve ... The answer is 18` gave 3 (a heading read as GSM8K's answer line), and
    `The answer is 3:00 PM` gave 3."""
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Part A: 12 apples. Part B: 6 apples. Total: 18", "18"),
        ("#### 3 Steps to Solve\n1. 16 - 3 - 4 = 9\nThe answer is 18.", "18"),
        ("The answer is 3:00 PM", None),  # a time is no number: no numeric answer
        ("The meeting is at 3:00 PM", None),
        ("He drove 5 miles and arrived at 3:45.", "5"),
        ("Q: How many? A: 42", "42"),
        ("\\boxed{12", "12"),
    ],
)
def test_numeric_extraction_skips_labels_headings_and_clock_times(text, expected):
    assert extract_answer(text, numeric=True) == expected


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("The answer is 3:00 PM", "3:00 PM", True),
        ("The answer is 3:00 p.m.", "3:00 pm", True),
        ("The answer is 3:00.", "3:00", True),
        ("The meeting is at 3:00 PM.", "3:00 PM", True),
        ("The answer is 3:00 PM", "3", False),  # read as 3 before: a false positive
        ("The answer is 3:00", "3", False),
        ("The answer is 3", "3:00", False),
        ("The answer is 3:00 PM", "3:00 AM", False),
        ("Part A: 12 apples. Part B: 6 apples. Total: 18", "18", True),  # a false negative before
        ("Part A: 12 apples. Part B: 6 apples. Total: 18", "12", False),  # a false positive before
        ("#### 3 Steps to Solve\nThe answer is 18.", "18", True),
        ("#### 3 Steps to Solve\nThe answer is 18.", "3", False),
    ],
)
def test_is_correct_reads_answer_labels_headings_and_clock_times(completion, gold, expected):
    assert is_correct(completion, gold) is expected


# ---- signs spaced from their number, unfinished expressions, the fallback's reach, `~` and dashes as minus
# (fourth verifier review, 2026-12-05)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a sign spaced from the number that starts an answer is its sign (all gave 5: the sign flipped)
        ("The answer is - 5", "-5"),
        ("x = - 5", "-5"),
        ("The answer is $- 5$", "-5"),
        ("The answer is: - 5.", "-5"),
        ("#### - 5", "-5"),
        ("The answer is 10 - 15 = - 5", "-5"),
        # unfinished expressions after a marker are no number (gave their first number: 5, 2, 10, 3, 3, 6)
        ("The answer is 5 + 7.", None),
        ("The answer is 2x + 1", None),
        ("The answer is 10-3", None),
        ("The answer is 3 * 4 dollars", None),
        (r"The answer is $3 \times 4$", None),
        ("The answer is 6 * (2 + 3)", None),
        ("The answer is 5 + 7.\nSo 12 apples.", None),  # the stated answer is the expression: no later number
        # ...an equation's result is the answer (gave 50 and 3)
        ("The answer is 50% of 10 = 5", "5"),
        (r"The answer is $3 \times 4 = 12$", "12"),
        # the fallback reads no number before the last marker with one after it (gave 2 and 42)
        ("He leaves at 3 and drives 2 hours. The answer is 5:30", None),
        ("A: 42\nThe answer is 5:30", None),
        ("Q: How many? A: 5 apples. Hmm, the answer is not obvious; recount: 6", "6"),
        # LaTeX's `~` is a space (gave the text `72~dollars` and `72 ~cm`)
        (r"\boxed{72~\text{dollars}}", "72"),
        (r"\boxed{72 \mathrm{~cm}}", "72"),
        # hyphens and dashes that start a number are its minus (gave 5, or the text `–5`)
        ("The answer is \u20135", "-5"),
        ("The answer is \ufe635", "-5"),
        ("The answer is \u2010 5", "-5"),
        ("The temperature is \u20125 degrees.", "-5"),
        ("\\boxed{\u20115}", "-5"),
    ],
)
def test_extract_answer_reads_spaced_signs_expressions_fallback_tilde_and_dashes(text, expected):
    """Wrong answers of the fourth verifier review (2026-12-05): each gave another number (or text) before."""
    assert extract_answer(text, numeric=True) == expected


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("The answer is - 5", "5", False),  # a false positive before
        ("The answer is - 5", "-5", True),
        ("The answer is 5 + 7.", "5", False),
        ("The answer is 5 + 7.", "7", False),
        ("The answer is 50% of 10 = 5", "5", True),
        ("He leaves at 3 and drives 2 hours. The answer is 5:30", "2", False),
        (r"\boxed{72~\text{dollars}}", "72", True),
        ("The answer is \u20135", "5", False),
        ("- 5", "-5", False),  # a gold answer with a spaced sign reads as the number
        ("-5", "- 5", True),
        ("x = -5", "x = - 5", True),
        ("72", "72~cm", True),
    ],
)
def test_is_correct_reads_spaced_signs_expressions_fallback_tilde_and_dashes(completion, gold, expected):
    assert is_correct(completion, gold) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a spaced minus anywhere else stays a subtraction, never a sign
        ("He had 10 - 5 apples", "5"),
        ("x = 10 - 5", "5"),
        ("16 - 3 - 4 = 9", "9"),
        # units, exponents, fractions and percents after a marker's number still read as before
        ("The answer is 12 apples.", "12"),
        ("The answer is 5 dollars", "5"),
        ("The answer is 3 km/h", "3"),
        ("The answer is 5m/s", "5"),
        ("The answer is 1e3", "1000"),
        ("The answer is -3/4.", "-3/4"),
        (r"The answer is \frac{3}{4}", "3/4"),
        ("The answer is 25%.", "25"),
        ("The answer is 25% = 0.25", "25"),  # `%` alone is no operator
        ("The answer is 20% of the total", "20"),
        # a dash or a word after the number is no operand
        ("The answer is 18 - a nice number", "18"),
        ("The answer is 12 - that's the total", "12"),
        ("The answer is 5-year", "5"),
        ("The answer is 12 dollars (6 * 2).", "12"),
        # a marker followed by words alone states no answer: the fallback reads the whole text, as before
        ("Answer: 18.\n\nI hope this answer is helpful.", "18"),
        ("The answer is wrong. Let me redo it: 3*4 = 12", "12"),
        # a dash between two numbers is no minus (`5–7` is a range)
        ("She read 5\u20137 pages", "7"),
        ("between 3 \u2013 5", "5"),
    ],
)
def test_spaced_minus_units_and_ranges_read_as_before(text, expected):
    assert extract_answer(text, numeric=True) == expected


def test_spaced_signs_expressions_and_dashes_stay_fast_on_long_inputs():
    for text in ("= - " * 250_000, "The answer is " + "5 + " * 250_000, "1\u2013" * 500_000,
                 "The answer is 50%" + " " * 1_000_000 + "o", "~" * 1_000_000,
                 "I hope this answer is clear. " * 40_000):
        start = time.perf_counter()
        extract_answer(text)
        extract_answer(text, numeric=True)
        assert time.perf_counter() - start < 0.5
