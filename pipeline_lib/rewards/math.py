"""Answer extraction and equivalence for verifiable problems (GSM8K, arithmetic), with regexes and Fraction only.

Model text is never evaluated: a number token's own power (`2^10`, `2**10`) is computed from its digits, nothing else.
Every scan is bounded: only the last MAX_SCAN_CHARS characters are read,
a number longer than MAX_NUMBER_CHARS characters (MAX_ANSWER_CHARS in an extracted or gold answer, whose
canonical text can be longer) or with a power or exponent beyond 10**±MAX_EXPONENT is ignored."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from functools import lru_cache

MAX_SCAN_CHARS = 10_000
MAX_NUMBER_CHARS = 100
MAX_EXPONENT = 100
# An answer (extracted or gold) is read as a number up to this length: the canonical text of a number written in
# MAX_NUMBER_CHARS can be longer (1e100 is 101 digits, 1e-100/2**308 has 410 decimal places), and it must read back
# as the same value. Far below the 4300 digits Python's int() accepts, so parsing stays cheap.
MAX_ANSWER_CHARS = 1_000
# Between a repeating value and a decimal (1/3 vs 0.333333) only: |a-b| <= tol * (1 + max(|a|, |b|)), six decimal
# places, and |a-b| <= rel_tol * max(|a|, |b|), four significant digits (half a unit of the fourth of 1.000: 0.0001667
# is 1/6000; 1/3000000 is not 0, nor 0.000001)
TOLERANCE = Fraction(1, 10**6)
REL_TOLERANCE = Fraction(5, 10**4)

# A space inside a number token: any whitespace but a line break (str.splitlines' boundaries), so a number ending
# one line never joins a markdown bullet or a `/` starting the next (`12\n* 10^2` is 12 and 10^2, not 1200).
_INLINE_SPACE = r"[^\S\n\r\v\f\x1c-\x1e\x85\u2028\u2029]"
# Han, kana and Hangul: written without spaces, so a number right after them starts a token
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
# One number token: optional sign and `$` (the sign before or after it: `-$5`, `$-5`); digits with optional thousands
# separators (commas, or the no-break, thin and narrow no-break spaces of `1 000 000`, one kind per number; a plain
# space is not one: `2 100-dollar bills` are 2) and decimals (or `.5`); then an optional integer power (`2^10`,
# `10^{-2}`, Python's `2**10`: see `_POWER_SIGN`) or exponent (`2e3`, or a power of ten: `2 × 10^3`, `2 \times 10^{3}`,
# `2\cdot10^3`, `2 x 10^3`, braces optional); then an optional `/denominator`, itself with an optional power. An
# exponent the token cannot read (`2^x`, `4^0.5`, `(3/2)^2`, `2^10^2`, `2**n`) is captured as `unread`: the token is
# then no number, and the scan goes on after it. An exponent with no number before it (`cm^{2}`, `x^-2`, `e^{10}`,
# `x**2`) is matched whole (no `body`), so its digits are never a number. The lookbehind keeps tokens from starting
# inside a word (`x2`; a CJK character is no such word: `答案是72`) or after a minus that belongs to an expression (`16-3`
# yields 16 and 3, not -3). Every repetition is over a character class disjoint from what follows it and no lookahead
# rejects a whole token: no catastrophic backtracking, one pass over the text. A readable power: an integer exponent, in
# braces or not followed by a decimal part or a letter (`4^0.5`, `2^10x`). A clock time is one token and no number
# (`time`, below).
# `^`, or Python's `**` written without spaces or with one on each side (`2**10`, `2 ** 10`). A `**` with a space on
# one side only is markdown bold's (`**42** 7`, `5 **6 apples**`: CommonMark's flanking rules), never a power; and
# only a digit, `(`, `{`, a sign or a one-letter variable after a `**` makes it an exponent (`2**n`), so a bold number
# followed by punctuation or a word stays a number (`**42**.`, `**5**th`).
_POWER_SIGN = rf"(?:{_INLINE_SPACE}?\^{_INLINE_SPACE}?|\*\*|{_INLINE_SPACE}\*\*{_INLINE_SPACE})"
_POWER = (rf"{_POWER_SIGN}"
          r"(?P<{0}_brace>\{{)?(?P<{0}>[-+]?\d+)(?({0}_brace)\}}|(?!\.\d|\w))")
_CARET_EXPONENT = rf"{_INLINE_SPACE}?\^{_INLINE_SPACE}?(?:\{{[^{{}}]*\}}|\([^()]*\)|[-+]?[\w.]+)"
_STAR_EXPONENT = (rf"(?:\*\*|{_INLINE_SPACE}\*\*{_INLINE_SPACE})"
                  r"(?:\{[^{}]*\}|\([^()]*\)|[-+]?(?:\d[\w.]*|[A-Za-z](?!\w)))")
_EXPONENT = rf"(?:{_CARET_EXPONENT}|{_STAR_EXPONENT})"
# A `**` exponent alone only after a one-letter variable or a bracket (`x**2`, `f(x)**2`): after a word or elsewhere it
# is markdown bold's (`答案是**42**`, `is**42**`)
_BARE_STAR_EXPONENT = r"(?:(?<=[A-Za-z])(?<![A-Za-z]{2})|(?<=[)\]]))"
# A clock time: hour 0-23, minutes and optional seconds 00-59, an optional am/pm (`3:00 PM`, `12:30:45`, `8:00 a.m.`).
# Tried before a number at the same place, so `3:00` is neither 3 nor 00 (a ratio written like a time, `10:45`, is
# read as one too: text, as a ratio answer is).
_TIME = (r"(?P<time>(?:[01]?\d|2[0-3]):[0-5]\d(?::[0-5]\d)?)(?!\d|:\d)"
         rf"(?:{_INLINE_SPACE}?(?P<meridiem>[AaPp])\.?[Mm]\b\.?)?")
_NUMBER = re.compile(
    rf"(?<![^\W{_CJK}]|[.^])(?:{_TIME}|(?P<sign>-)?(?:\${_INLINE_SPACE}?(?P<dollar_sign>-)?)?"
    r"(?P<body>\d{1,3}(?P<group>[,\u00a0\u2009\u202f])\d{3}(?:(?P=group)\d{3})*(?!\d)(?:\.\d+)?"
    r"|\d+(?:\.\d+)?|\.\d+)"
    rf"(?:{_POWER.format('body_pow')}|[eE](?P<exp>[-+]?\d+)"
    rf"|{_INLINE_SPACE}?(?:[×·⋅x*]|\\times|\\cdot){_INLINE_SPACE}?10{_POWER.format('pow')})?"
    rf"(?:{_INLINE_SPACE}?/{_INLINE_SPACE}?(?P<den_sign>-)?(?P<den>\d+(?:\.\d+)?)(?:{_POWER.format('den_pow')})?)?"
    rf"(?P<unread>[)\]]?{_EXPONENT})?)"
    rf"|{_CARET_EXPONENT}|{_BARE_STAR_EXPONENT}{_STAR_EXPONENT}"
)
_GROUP_SEPARATORS = re.compile("[,\u00a0\u2009\u202f]")
# The characters a number token or clock time can hold (ASCII: a cut through CJK text keeps it)
_CUT_TOKEN = re.compile(r"[0-9A-Za-z_.,:^*{}\\$/+\-\u00a0\u2009\u202f]*")
_UNSIGNED_START = frozenset("0123456789.$")
# GSM8K's `#### 72`, not a markdown heading whose line goes on after its number (`#### 2. Add the costs`)
_HASHES = re.compile(r"####(?![ \t]*\d+[.)][ \t]+[^\W\d_])")
# An item label starting a line (`1. Janet's ducks...`, `2) 9 * 2 = 18`): no answer after a marker ending its line
_LIST_ITEM = re.compile(r"[ \t]*\d+[.)][ \t]+\S")
# A sign the writer spaced from its number where an answer starts (`\boxed{- 5}`, `The answer is - 5`, `#### - 5`,
# `x = - 5`): the number's sign, as the MATH grader compares without spaces. Anywhere else a spaced minus is a
# subtraction (`10 - 5` is 10 and 5), so it joins only at the start of an answer or right after an `=`.
_SPACED_SIGN = re.compile(r"^\s*([-+])\s+(?=[\d.$\\])")
_EQUALS_SPACED_SIGN = re.compile(rf"(={_INLINE_SPACE}*)-{_INLINE_SPACE}+(?=[\d.$\\])")
# `\boxed{...}`, or MATH's `\boxed 5` without braces (its box ends at the next `$`, or here at the line's end): a
# number, a sign or a command after it (`\boxed \frac12`), never a word (`I put it in \boxed as asked`)
_BOXED = re.compile(r"\\(?:boxed|fbox)(?:\s*(?P<brace>\{)|[ \t]+(?=[-+.(\d\\]))")
_ANSWER_IS = re.compile(r"\banswer\s{0,10}(?:is\b|:|=)|答案\s{0,10}(?:是|为|為|：|:|=)", re.IGNORECASE)
# `A:` as the answer label of the Q/A format: at the start of the text or of a line, or right after a sentence's end
# (`Q: How many? A: 42`), spaces and markdown bold allowed before it (`**A:** 42`); never after a word, where it names
# a part or a choice (`Part A: 12 apples. Part B: 6 apples.`, `Option A: 5`)
_A_COLON = re.compile(r"(?:^|(?<=[.?!]))[ \t*]*A:", re.MULTILINE)
# Unit words after a number: `dollars`, `square feet`, `cm^2`, `m/s^{2}`
_UNIT = r"[A-Za-z]+(?:\^\{?-?\d+\}?)?"
_UNITS = re.compile(rf"{_UNIT}(?:(?:\s+|/){_UNIT})*")
_SPACES = re.compile(r"\s+")
_CLAUSE_END = re.compile(r"[.,;!?]")
_CHOICE = re.compile(r"\(([A-Za-z])\)")  # a multiple-choice letter in parentheses
# Arithmetic operators, `50% of 10` included. `/` is none: `2/3 = 0.667` keeps the fraction, whose value is the answer.
_OPERATORS = rf"[+\-*×·÷x]|\\(?:times|cdot|div)(?![A-Za-z])|%{_INLINE_SPACE}*of(?![A-Za-z])"
_OPERATOR = re.compile(_OPERATORS)
# The arithmetic a marker may be followed by (`The answer is 5 + 7 = 12`, `50% of 10 = 5`): digits, operators, `=`,
# `%`, brackets, `$`, spaces within the line and a `.` only before a digit (a sentence end stops it). Each repetition
# is one character or an operator that starts with its own character: one linear pass.
_EQUATION = re.compile(rf"(?:{_OPERATORS}|[\d,/()$=%]|\.(?=\d)|{_INLINE_SPACE})*")
# What makes a marker's number the start of an expression, so no answer: an operator and an operand after it (`5 + 7`,
# `10-3`, `3 * 4 dollars`, `6 * (2 + 3)`, `2 + \sqrt{3}`), also after a letter glued to it (`2x + 1`), or a glued
# `\sqrt` or `\pi` (`2\sqrt{3}`). An operand is a number, a LaTeX command or a one-letter variable, not the words
# `a` and `I` (`18 - a nice number`, `12 - I think`) nor a longer word; so units stay (`12 apples`, `3 km/h`, `5m/s`).
_UNFINISHED = re.compile(
    rf"\\(?:sqrt|pi)(?![A-Za-z])|[A-Za-z]?{_INLINE_SPACE}*(?:{_OPERATORS}){_INLINE_SPACE}*"
    r"\(?\$?(?:\d|\.\d|\\[A-Za-z]|[B-HJ-Zb-z](?![\w']))")
_DIGIT = re.compile(r"\d")
# What may stand between a marker and its answer: `The answer is: **$\$18$**` (the `$` of LaTeX math before the
# number's own; a sign after it stays: `$-5$`)
_LEAD = " \t:*$"

# Unicode spellings of signs and numbers: the minus signs, superscript powers (`10³` -> `10^{3}`), vulgar fractions
# (`2½` -> `5/2`, `¾` -> `3/4`) and the fraction slash.
_UNICODE_SIGNS = (("\u2212", "-"), ("\uff0d", "-"), ("\u2044", "/"))
# a fullwidth comma or full stop between digits (`１，０００`, `３．５`, CJK text's): the ASCII one, read as that is
_FULLWIDTH_IN_NUMBER = re.compile(r"(?<=\d)[\uff0c\uff0e](?=\d)")
# Hyphens and dashes written for a minus (`–5`, `﹣5`, `‐ 5`): a minus where they start a number, never between two
# numbers (`5–7` and `5 – 7` are ranges, not 5 and -7), matched with the number before them to leave those as
# written
_DASH_MINUS = re.compile(rf"(\d{_INLINE_SPACE}*)?[\u2010-\u2013\ufe63](?={_INLINE_SPACE}*[\d.$\\])")
_SUPERSCRIPT = re.compile("[⁺⁻]?[⁰¹²³⁴⁵⁶⁷⁸⁹]+")
_SUPERSCRIPT_DIGITS = str.maketrans("⁺⁻⁰¹²³⁴⁵⁶⁷⁸⁹", "+-0123456789")
_VULGAR = {"½": (1, 2), "⅓": (1, 3), "⅔": (2, 3), "¼": (1, 4), "¾": (3, 4), "⅕": (1, 5), "⅖": (2, 5), "⅗": (3, 5),
           "⅘": (4, 5), "⅙": (1, 6), "⅚": (5, 6), "⅐": (1, 7), "⅛": (1, 8), "⅜": (3, 8), "⅝": (5, 8), "⅞": (7, 8),
           "⅑": (1, 9), "⅒": (1, 10)}
_VULGAR_TEXT = {char: f"{numerator}/{denominator}" for char, (numerator, denominator) in _VULGAR.items()}
_VULGAR_CHAR = f"[{''.join(_VULGAR)}]"
_INTEGER = rf"\d{{1,{MAX_NUMBER_CHARS}}}"
# a whole number that starts a token (not the exponent of `2**10` or `2 ** 10`)
_WHOLE = rf"(?<![^\W{_CJK}]|[.,^])(?<!\d\*\*)(?<!\d{_INLINE_SPACE}\*\*{_INLINE_SPACE})({_INTEGER})"
_MIXED_VULGAR = re.compile(rf"(?:{_WHOLE} ?)?({_VULGAR_CHAR})")
# A mixed number in LaTeX: a whole number right before a fraction of integers (`1\frac{1}{2}`, `2 \frac34`) is
# their sum, as it is read, not the digits run together (`11/2`)
_MIXED_FRAC = re.compile(
    rf"{_WHOLE}[ ]*\\[dt]?frac\s*(?:\{{\s*({_INTEGER})\s*\}}\s*\{{\s*({_INTEGER})\s*\}}|(\d)(\d))")
# A mixed number in plain text: a whole number, one space and a proper fraction (`1 1/2`, `2 3/4 cups`) is their sum,
# as GSM8K-style answers write it (not 1 and then 1/2)
_MIXED_PLAIN = re.compile(rf"{_WHOLE} ({_INTEGER})/({_INTEGER})(?![\d/]|[.,]\d)")
# LaTeX that wraps numbers: \frac{a}{b} -> a/b, \text{..} -> .. (and the other text and font commands), spacing,
# \left/\right and the math delimiters \( \) \[ \] dropped (`The answer is \(1234\).` reads like
# `The answer is $1234$.`).
_LATEX_SUBS = (
    (re.compile(r"\\[()\[\]]"), ""),
    (re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}"), r"\1/\2"),
    (re.compile(r"\\[dt]?frac(\d)(\d)"), r"\1/\2"),
    (re.compile(r"\\[dt]frac\b"), r"\\frac"),  # one spelling for what is left (`\dfrac{\sqrt{3}}{2}`)
    (re.compile(r"\\sqrt\s*([0-9A-Za-z])"), r"\\sqrt{\1}"),  # `\sqrt2` is `\sqrt{2}`, as LaTeX reads it
    (re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|boldsymbol|bm|mbox|emph|operatorname)\s*"
                r"\{([^{}]*)\}"), r"\1"),
    (re.compile(r"\^\s*\{?\\circ\}?"), ""),
    (re.compile(r"\\(?:left|right)\b|\\[!,;: ]"), ""),
    (re.compile(r"\\([%$])"), r"\1"),
)


def _mixed_fraction(match: re.Match[str]) -> str:
    """A LaTeX mixed number as a fraction (`1\\frac{1}{2}` -> `3/2`); with a zero denominator, the text as written."""
    numerator, denominator = int(match[2] or match[4]), int(match[3] or match[5])
    if denominator == 0:
        return match[0]
    return f"{int(match[1]) * denominator + numerator}/{denominator}"


def _plain_mixed_number(match: re.Match[str]) -> str:
    """`1 1/2` -> `3/2`; an improper or zero-denominator fraction after a number is left as written (`3 5/4`)."""
    whole, numerator, denominator = int(match[1]), int(match[2]), int(match[3])
    if not 0 < numerator < denominator:
        return match[0]
    return f"{whole * denominator + numerator}/{denominator}"


def _vulgar_number(match: re.Match[str]) -> str:
    """A vulgar fraction and the whole number before it as a fraction: `2½` -> `5/2`, `¾` -> `3/4`."""
    if match[1] is None:
        return _VULGAR_TEXT[match[2]]
    numerator, denominator = _VULGAR[match[2]]
    return f"{int(match[1]) * denominator + numerator}/{denominator}"


def _normalize(text: str) -> str:
    """Unicode signs and numbers in ASCII, LaTeX unwrapped, a sign spaced after `=` joined: the text the number scan
    reads."""
    # `1{,}000`: LaTeX's plain comma; `~`: LaTeX's no-break space, a space (`72~\text{cm}`, `72 \mathrm{~cm}`)
    text = text.replace("{,}", ",").replace("~", " ")
    if not text.isascii():  # str.replace and a search first: a sub that matches nothing still costs on 1 M characters
        for sign, ascii_sign in _UNICODE_SIGNS:
            text = text.replace(sign, ascii_sign)
        text = _FULLWIDTH_IN_NUMBER.sub(lambda m: "," if m[0] == "\uff0c" else ".", text)
        text = _DASH_MINUS.sub(lambda m: m[0] if m[1] else "-", text)
        text = _SUPERSCRIPT.sub(lambda m: f"^{{{m[0].translate(_SUPERSCRIPT_DIGITS)}}}", text)
        if re.search(_VULGAR_CHAR, text):
            text = _MIXED_VULGAR.sub(_vulgar_number, text)
    text = _EQUALS_SPACED_SIGN.sub(r"\1-", text)
    if "/" in text:
        text = _MIXED_PLAIN.sub(_plain_mixed_number, text)
    if "\\" not in text:
        return text
    if "frac" in text:
        text = _MIXED_FRAC.sub(_mixed_fraction, text)
    for pattern, replacement in _LATEX_SUBS:
        text = pattern.sub(replacement, text)
    return text


def _decimal(digits: str) -> Fraction:
    """'1,234.50' or '1 234.50' -> 2469/2, built from ints (the caller has bounded the length)."""
    whole, _, frac = _GROUP_SEPARATORS.sub("", digits).partition(".")
    scale = 10 ** len(frac)
    return Fraction(int(whole or "0") * scale + int(frac or "0"), scale)


def _power(base: Fraction, exponent_text: str | None) -> Fraction | None:
    """base ** exponent, or None when the exponent is beyond ±MAX_EXPONENT, the result beyond 10**±MAX_EXPONENT or
    its numerator or denominator longer than 4 * MAX_EXPONENT digits (`1.001^100` has 300 decimal places, and
    `1.0001^100` is refused), or it divides by zero. All checked before any power is built."""
    if exponent_text is None:
        return base
    exponent = int(exponent_text)
    if base == 0:
        return None if exponent < 0 else Fraction(exponent == 0)
    digits = len(str(max(abs(base.numerator), base.denominator)))
    magnitude = math.log10(abs(base.numerator)) - math.log10(base.denominator)
    if abs(exponent) > MAX_EXPONENT or abs(exponent) * digits > 4 * MAX_EXPONENT or \
            abs(exponent * magnitude) > MAX_EXPONENT:
        return None
    return base**exponent


def _token_value(match: re.Match[str], max_chars: int = MAX_NUMBER_CHARS) -> tuple[Fraction, bool] | None:
    """(value, written_as_fraction) of a number token, or None when it is no number (an exponent alone, or a
    number with an exponent it cannot read), longer than `max_chars`, a power or exponent is out of range, its
    denominator is zero, or its canonical text would be longer than MAX_ANSWER_CHARS (so it reads back)."""
    if match["body"] is None or match["unread"] is not None or match.end() - match.start() > max_chars:
        return None
    value = _power(_decimal(match["body"]), match["body_pow"])  # `2^10`
    exponent = match["exp"] or match["pow"]  # `2e3` or `2 × 10^3`
    if value is not None and exponent is not None:
        scale = _power(Fraction(10), exponent)
        value = None if scale is None else value * scale
    if value is not None and match["den"] is not None:
        denominator = _power(_decimal(match["den"]), match["den_pow"])
        value = None if not denominator else value / (-denominator if match["den_sign"] else denominator)
    if value is None or len(format_number(value, match["den"] is not None)) > MAX_ANSWER_CHARS:
        return None
    return (-value if match["sign"] or match["dollar_sign"] else value), match["den"] is not None


def format_number(value: Fraction, as_fraction: bool = False) -> str:
    """Canonical text of a number: `72`, `-1234.5`, or `3/4` (for fraction input or a non-terminating decimal)."""
    if value.denominator == 1:
        return str(value.numerator)
    den, twos, fives = value.denominator, 0, 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    if as_fraction or den != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator  # exact: the denominator divides 10**places
    sign = "-" if value < 0 else ""
    whole, frac = divmod(scaled, 10**places)
    return f"{sign}{whole}.{str(frac).zfill(places).rstrip('0')}"


def _last_answer(text: str, numeric: bool) -> str | None:
    """The last number in the text, or, unless `numeric`, the last number or clock time (`at 3:45.` -> `3:45`)."""
    last: tuple[Fraction, bool] | str | None = None
    for match in _NUMBER.finditer(text):
        if match["time"] is not None:
            if not numeric:
                last = match[0]
        elif (parsed := _token_value(match)) is not None:
            last = parsed
    if isinstance(last, str):
        return _clean_text(last)
    return None if last is None else format_number(*last)


def _clean_text(text: str) -> str:
    """Whitespace collapsed, surrounding punctuation and `$` removed (not a period a number starts with: `$.5$` is
    .5), a choice letter unwrapped (`(B)` -> `B`), a clock time in one spelling (`3:00 p.m.` and `3:00pm` ->
    `3:00 PM`)."""
    text = _SPACES.sub(" ", text).strip().strip("$*").lstrip(" :*").rstrip(" :.*").strip()
    choice = _CHOICE.fullmatch(text)
    if choice is not None:
        return choice[1]
    time = _NUMBER.fullmatch(text)
    if time is None or time["time"] is None or time["meridiem"] is None:
        return text
    return f"{time['time']} {time['meridiem'].upper()}M"


def _text_answer(text: str) -> str | None:
    """A non-numeric answer (`yes`, `x+1`): the cleaned text, or None if empty or longer than MAX_NUMBER_CHARS."""
    text = _clean_text(text)
    return text if 0 < len(text) <= MAX_NUMBER_CHARS else None


def _join_sign(text: str) -> str:
    """A sign spaced from the number it starts joined to it: `- 5` -> `-5` (see `_SPACED_SIGN`)."""
    return _SPACED_SIGN.sub(r"\1", text, count=1)


def _segment_answer(segment: str, numeric: bool) -> tuple[str | None, bool]:
    """(answer, final) for the text right after a marker. The answer: the number it starts with (a spaced sign
    joined: `- 5` is -5; after the last `=` when it starts with arithmetic: `5 + 7 = 12.` gives 12); else, unless
    `numeric`, the clock time it starts with as text (`3:00 PM`: never 3) or its first clause as text (`yes`, `B`) if
    that clause has no digit; else None (`A: Janet has 16 eggs...` is reasoning). `final`: the answer is decided,
    None included, when that number starts an unfinished expression (`5 + 7.`, `2x + 1`, `3 * 4 dollars`): what the
    writer gave is no number, and no other number is theirs."""
    segment = _join_sign(segment.lstrip(_LEAD))
    equation = _EQUATION.match(segment)[0]
    result = equation.rfind("=")
    if result > 0 and _OPERATOR.search(equation, 0, result):  # `5 + 7 = 12`: what the working comes to
        segment = segment[result + 1:].lstrip()
    match = _NUMBER.match(segment)
    if match is not None and match["time"] is not None:
        return (None if numeric else _text_answer(match[0])), False
    if match is not None and _UNFINISHED.match(segment, match.end()) is not None:
        return None, True
    if match is not None:
        parsed = _token_value(match)
        return (None if parsed is None else format_number(*parsed)), False
    if numeric:
        return None, False
    clause = _CLAUSE_END.split(segment, maxsplit=1)[0]
    if _DIGIT.search(clause):
        return None, False
    return _text_answer(clause), False


def _last_end(pattern: re.Pattern[str], text: str) -> int:
    """Where the last match of `pattern` ends, or -1 if it does not occur."""
    end = -1
    for match in pattern.finditer(text):
        end = match.end()
    return end


def _answer_line(after_marker: str) -> str:
    """The line a marker's answer is on: the rest of the marker's line. When that is blank (`Final answer:` ends its
    line), the next non-blank line instead, if it starts with a number or clock time that is no list item's label
    (`Here is the answer:\n1. First, ...` is working to come)."""
    line, _, rest = after_marker.partition("\n")
    if line.strip(_LEAD):
        return line
    following = next((candidate for candidate in rest.split("\n") if candidate.strip()), "")
    if _LIST_ITEM.match(following):
        return line
    number = _NUMBER.match(following.lstrip(_LEAD))
    if number is None or (number["time"] is None and _token_value(number) is None):
        return line
    return following


def _gsm8k_line(after_marker: str) -> str | None:
    """The line of GSM8K's final answer (`#### 72`) in the text after the last `####`, or None. It is that marker's
    answer line when the line holds only a number (`#### 1,080`, `#### $18.`, `#### - 5`), as every GSM8K solution's
    does, or when nothing but blank lines follow it (`#### 18 dollars` ends the text). A `####` whose number has more
    after it on its line and text below it is a markdown heading (`#### 3 Steps to Solve`): its number is no answer,
    and the other rules apply."""
    line = _answer_line(after_marker)
    alone = _NUMBER.fullmatch(_join_sign(line.strip(_LEAD + ".%")))
    if (alone is not None and alone["body"] is not None) or after_marker.strip() == line.strip():
        return line
    return None


def boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces matched (nested braces allowed), or of the last `\\boxed 5`
    (MATH's solutions write some so: up to the next `$` or the line's end), or None."""
    last = None
    for last in _BOXED.finditer(text):
        pass
    if last is None:
        return None
    if last.group("brace") is None:
        return re.split(r"[$\n]", text[last.end():], maxsplit=1)[0].strip() or None
    depth, start = 1, last.end()
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def _boxed_answer(content: str) -> str | None:
    """A boxed answer: a number (units stripped; braces or parentheses around it alone dropped: `{12}`, `(-12)`,
    `\\left(\\frac{1}{2}\\right)`), the right-hand side of `x = 5`, or short text (`x+1`, `(1, 2)`)."""
    content = _join_sign(content.rsplit("=", 1)[-1])
    start, end = 0, len(content)  # indices, not slices: a hostile box nests 100,000 braces
    while True:
        while start < end and content[start].isspace():
            start += 1
        while end > start and content[end - 1].isspace():
            end -= 1
        if end - start <= 2 or content[start] + content[end - 1] not in ("{}", "()"):
            break
        start, end = start + 1, end - 1
    parsed = _parse_number(_join_sign(content[start:end]))
    if parsed is not None:
        return format_number(*parsed)
    return _text_answer(content)


def extract_answer(text: str | None, *, numeric: bool = False) -> str | None:
    """The final answer in a completion (or a GSM8K gold solution), normalized; None if there is none.

    Priority: the last `#### x` (GSM8K; see `_gsm8k_line` for a markdown heading), then the last `\\boxed{x}`, then
    the last `answer is x` / `answer: x`, then the last `A: x` label (at the start of a line or after a sentence's
    end, not `Part A: 12`). A marker counts only when a number follows it directly (or, for non-numeric answers, a
    clock time or a clause without digits: `The answer is 3:00 PM.`, `The answer is yes.`); otherwise the next rule
    applies. Arithmetic right after a marker gives what it comes to (`The answer is 5 + 7 = 12.` -> 12); an unfinished
    expression there gives None (`The answer is 5 + 7.`, `2x + 1`, `10-3`: never 5, 2 or 10); a sign spaced from the
    number it starts is its sign (`The answer is - 5`, `x = - 5` -> -5; `10 - 5` stays a subtraction), and a marker
    ending its line takes the number starting the next non-blank line (`Final answer:\n18`).
    `numeric` (the gold answer is a number) drops the text cases: `A: Let me think. 5+7 = 12` gives 12.
    When no marker gives an answer: the last number (or clock time, unless `numeric`) after the last marker with a
    digit after it, the writer's stated answer area; a marker before that one is not read either (`He left at 3. The
    answer is 5:30` gives no number, never 3). Without such a marker (`18. I hope this answer is clear.`): the last
    number in the text. A clock time is never a number (`3:00` is not 3). Numbers come back
    canonical: commas, `$`, `%`, units and trailing zeros/periods stripped (`$1,234.50` -> `1234.5`,
    `1{,}000` and `1 000` with a thin or no-break space -> `1000`), powers evaluated (`1.2 \\times 10^{3}` ->
    `1200`, `2^10` and `2**10` -> `1024`), fractions as `p/q` (`\\frac{3}{4}` -> `3/4`). Only the last MAX_SCAN_CHARS
    characters are read."""
    if not isinstance(text, str):
        return None
    if len(text) > MAX_SCAN_CHARS:
        text = text[-MAX_SCAN_CHARS:]
        text = text[_CUT_TOKEN.match(text).end():]  # drop what the cut may have left of a number token
    text = _normalize(text)
    start = 0  # the fallback reads after the last marker whose answer could not be read
    for marker in (_HASHES, _BOXED, _ANSWER_IS, _A_COLON):  # by priority
        end = _last_end(marker, text)
        if end < start:  # absent, or before a later marker without an answer
            continue
        if marker is _BOXED:  # a box holds its answer, or is no marker: never the fallback's start
            content = boxed_content(text)
            if content is not None and (found := _boxed_answer(content)) is not None:
                return found
            continue
        line = _gsm8k_line(text[end:]) if marker is _HASHES else _answer_line(text[end:])
        if line is None:  # a markdown heading
            continue
        found, final = _segment_answer(line, numeric)
        if found is not None or final:
            return found
        if _DIGIT.search(text, end):  # words alone after it state no answer: `I hope this answer is clear.`
            start = end
    return _last_answer(text[start:], numeric)


def _parse_number(text: str, max_chars: int = MAX_NUMBER_CHARS) -> tuple[Fraction, bool] | None:
    """(value, as_fraction) if the whole of `text` is one number of at most `max_chars` characters, optionally with
    `%` or unit words after it."""
    if len(text) > MAX_SCAN_CHARS:
        return None
    if text.isascii() and text.isdigit() and len(text) <= max_chars:
        return Fraction(int(text)), False  # the common case, `72`, without regexes
    text = _join_sign(_normalize(text).strip().rstrip(".").strip())
    if text[:1] == "+" and text[1:2] in _UNSIGNED_START:  # `+5`: an explicit plus sign
        text = text[1:]
    match = _NUMBER.match(text)
    if match is None:
        return None
    rest = text[match.end():].strip()
    if rest and rest != "%" and _UNITS.fullmatch(rest) is None:
        return None
    return _token_value(match, max_chars)


def answer_value(answer: str) -> Fraction | str:
    """The comparable value of an answer: a Fraction if it is a number, else casefolded text without spaces.

    Equal values are the same answer (Maj@K votes on them); `is_equivalent` adds the tolerance for repeating values.
    Numbers up to MAX_ANSWER_CHARS are read, so the canonical text `extract_answer` gives reads back as its value."""
    if len(answer) > MAX_SCAN_CHARS:  # never a number, nor any extracted answer: as written, kept out of the cache
        return _SPACES.sub("", answer).casefold()
    return _cached_answer_value(answer)


@lru_cache(maxsize=65_536)
def _cached_answer_value(answer: str) -> Fraction | str:
    """A gold answer is read as an extracted one is: `$18$` and `**18**` are 18, `x = 5` is its right-hand side,
    a boxed answer its box's (`\\boxed{x=5}` is 5, `$\\boxed{\\frac{1}{2}}$` 1/2); text compares without spaces,
    as the MATH grader does (`(1, 2)` is `(1,2)`)."""
    content = boxed_content(answer)
    if content is not None and (boxed := _boxed_answer(content)) is not None:
        answer = boxed
    parsed = _parse_number(answer, MAX_ANSWER_CHARS)
    if parsed is not None:
        return parsed[0]
    text = _clean_text(_normalize(answer).rsplit("=", 1)[-1])
    parsed = _parse_number(text, MAX_ANSWER_CHARS)
    if parsed is not None:
        return parsed[0]
    return _SPACES.sub("", text).casefold()


def is_numeric_answer(answer: str | None) -> bool:
    """Whether a (gold) answer is a number, so only a numeric answer can match it."""
    return answer is not None and isinstance(answer_value(str(answer)), Fraction)


def terminates(value: Fraction) -> bool:
    """Whether `value` has a finite decimal expansion (its denominator has no prime factor but 2 and 5)."""
    den = value.denominator
    for prime in (2, 5):
        while den % prime == 0:
            den //= prime
    return den == 1


def values_equivalent(a: Fraction | str, b: Fraction | str) -> bool:
    """Two `answer_value`s: text exactly equal; numbers exactly equal (`1000001 != 1000000`), or, when one of
    them has no finite decimal expansion (`1/3` vs `0.333333`), within |a-b| <= tol + tol*max(|a|,|b|), tol 1e-6, and
    within |a-b| <= rel_tol*max(|a|,|b|), rel_tol 5e-4 (a value near 0 needs four significant digits, not 0)."""
    if a == b:
        return True
    if not (isinstance(a, Fraction) and isinstance(b, Fraction)) or (terminates(a) and terminates(b)):
        return False
    # The same inequalities multiplied through by both denominators and 1/tol: integers only (fast, exact).
    an, ad, bn, bd = a.numerator, a.denominator, b.numerator, b.denominator
    diff, largest = abs(an * bd - bn * ad), max(abs(an) * bd, abs(bn) * ad)
    return (diff * TOLERANCE.denominator <= TOLERANCE.numerator * (ad * bd + largest)
            and diff * REL_TOLERANCE.denominator <= REL_TOLERANCE.numerator * largest)


def is_equivalent(pred: str | None, gold: str | None) -> bool:
    """Whether an extracted answer matches the gold answer: `1/2 == 0.5`, `72.0 == 72`, `1,000 == 1000`,
    `$5 == 5 dollars`, `50% == 50`; non-numeric answers compare as normalized text. None equals nothing."""
    if pred is None or gold is None:
        return False
    return values_equivalent(answer_value(str(pred)), answer_value(str(gold)))


def is_correct(completion: str | None, answer: str | None) -> bool:
    """The verifier: the completion's extracted answer is equivalent to the gold answer (a numeric gold answer is
    matched against the completion's numeric answer only)."""
    return is_equivalent(extract_answer(completion, numeric=is_numeric_answer(answer)), answer)
