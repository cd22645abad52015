"""Reward functions by name (`REWARDS`) and their weighted sum (`combined_reward`), which configs build from
`[{name, weight, **options}]` specs: the verifier, DAPO overlong shaping, a reward model's scores."""

from __future__ import annotations

import difflib
import inspect
import math
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from pipeline_lib.errors import AlignflowError
from pipeline_lib.losses.dapo import overlong_penalty
from pipeline_lib.rewards.math import is_correct


class RewardFn(Protocol):
    """The one signature of every reward function.

    `prompts[i]`, `completions[i]` are one sample; `answers[i]` is its gold answer (None when the prompt has
    none); `lengths[i]` is the completion's length in tokens. `options` are the spec's keyword arguments,
    fixed per config (`max_len`, `scorer`). Returns one float per sample."""

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        *,
        answers: list[str | None],
        lengths: list[int],
        **options: Any,
    ) -> list[float]: ...


CombinedReward = Callable[..., tuple[list[float], dict[str, list[float]]]]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to REWARDS under `name` (a second function with that name is an error)."""

    def add(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = fn
        return fn

    return add


@register_reward("verifier")
def verifier(
    prompts: list[str],
    completions: list[str],
    *,
    answers: list[str | None],
    lengths: list[int],
    incorrect: float = 0.0,
) -> list[float]:
    """1.0 when the extracted answer is equivalent to the gold answer, else `incorrect` (a None answer too):
    0 by default, -1 for DAPO's R(ŷ, y) = ±1 (DAPO §2.4)."""
    if not float(incorrect) < 1.0:
        raise ValueError(f"verifier incorrect={incorrect}: expected a score below a correct answer's 1")
    return [1.0 if is_correct(completion, answer) else incorrect for completion, answer in zip(completions, answers)]


@register_reward("overlong")
def overlong(
    prompts: list[str],
    completions: list[str],
    *,
    answers: list[str | None],
    lengths: list[int],
    max_len: int,
    cache_len: int,
) -> list[float]:
    """DAPO §3.4 soft overlong punishment: 0 up to max_len - cache_len tokens, a ramp to -1 at max_len, -1 beyond."""
    return overlong_penalty(list(lengths), max_len=max_len, cache_len=cache_len).tolist()


@register_reward("reward_model")
def reward_model(
    prompts: list[str],
    completions: list[str],
    *,
    answers: list[str | None],
    lengths: list[int],
    scorer: Callable[[list[str]], Sequence[float]],
) -> list[float]:
    """A reward model's score of prompt + completion; `scorer` maps texts to scores (e.g. RewardModelScorer)."""
    scores = [float(score) for score in scorer([p + c for p, c in zip(prompts, completions)])]
    if len(scores) != len(completions):
        raise ValueError(f"reward_model: scorer returned {len(scores)} scores for {len(completions)} texts")
    return scores


def _component(spec: Mapping[str, Any], index: int) -> tuple[str, float, dict[str, Any]]:
    """Validate one spec into (name, weight, options); options are checked against the function's signature."""
    where = f"rewards[{index}]"
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise ValueError(f"{where}: expected a mapping with a 'name' string, got {spec!r}")
    options = {key: value for key, value in spec.items() if key not in ("name", "weight")}
    name, weight = spec["name"], _number(spec.get("weight", 1.0))
    if name not in REWARDS:
        raise ValueError(f"{where}.name: unknown reward {name!r}; expected one of {sorted(REWARDS)}")
    if weight is None:
        raise ValueError(f"{where}.weight: expected a finite number, got {spec['weight']!r}")
    signature = inspect.signature(REWARDS[name])
    known = [key for key in signature.parameters if key not in ("prompts", "completions", "answers", "lengths")]
    for key in options:
        if key not in known:  # before binding: a misspelled option would otherwise read as a missing one
            close = difflib.get_close_matches(key, ["weight", *known], n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"expected one of {['weight', *known]}"
            raise ValueError(f"{where}.{key}: unknown option of reward {name!r} ({hint})")
    try:
        signature.bind([], [], answers=[], lengths=[], **options)
    except TypeError as exc:
        raise ValueError(f"{where} ({name}): {exc}") from None
    hints = typing.get_type_hints(REWARDS[name])
    for key, value in options.items():
        if hints.get(key) is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{where}.{key}: expected an integer, got {value!r}")
        if hints.get(key) is int and abs(value) >= 2**63:  # as torch holds it
            raise ValueError(f"{where}.{key}: {value!r} is out of range; expected an integer of magnitude below 2**63")
        if hints.get(key) is float and _number(value) is None:
            raise ValueError(f"{where}.{key}: expected a finite number, got {value!r}")
    return name, weight, options


def _number(value: Any) -> float | None:
    """A finite float from a number or a numeric string (a quoted `weight: '1e-1'`), else None; never a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except (ValueError, OverflowError):  # an integer past a float's range
        return None
    return number if math.isfinite(number) else None


def combined_reward(specs: Sequence[Mapping[str, Any]]) -> CombinedReward:
    """The weighted sum of reward functions named by `specs` (`[{name, weight=1.0, **options}]`).

    The returned callable takes RewardFn's arguments (without options) and returns `(total, components)`:
    total[i] = Σ weight_j * component_j[i], and each component's raw values keyed by name, for logging.
    A component returning a non-finite value or the wrong number of values raises ValueError."""
    if not specs:
        raise ValueError("rewards: expected at least one {name, weight} spec")
    parts = [_component(spec, i) for i, spec in enumerate(specs)]
    names = [name for name, _, _ in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"rewards: each reward may appear once, got {names}")

    def reward(
        prompts: list[str], completions: list[str], *, answers: list[str | None], lengths: list[int]
    ) -> tuple[list[float], dict[str, list[float]]]:
        n = len(completions)
        if not len(prompts) == len(answers) == len(lengths) == n:
            raise ValueError(
                f"rewards: prompts, completions, answers, lengths must have one entry per sample, got "
                f"{len(prompts)}, {n}, {len(answers)}, {len(lengths)}"
            )
        components: dict[str, list[float]] = {}
        for name, _, options in parts:
            values = [float(v) for v in REWARDS[name](prompts, completions, answers=answers, lengths=lengths, **options)]
            if len(values) != n:
                raise ValueError(f"reward {name!r} returned {len(values)} values for {n} samples")
            bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
            if bad is not None:
                raise ValueError(f"reward {name!r} returned a non-finite value {values[bad]} for sample {bad}")
            components[name] = values
        total = [sum(weight * components[name][i] for name, weight, _ in parts) for i in range(n)]
        return total, components

    return reward


def check_reward_specs(specs: Sequence[Mapping[str, Any]]) -> None:
    """A config's reward specs checked as `build_reward` will check them (names, weights, options, each name
    once) and run once on an empty batch, so each function's own option checks (overlong's cache_len) apply
    too; a reward model's scorer, built only when the stage starts, is stood in for."""
    placeholder = {"scorer": lambda texts: [0.0] * len(texts)}
    reward = combined_reward([{**spec, **placeholder} if spec.get("name") == "reward_model" else spec
                              for spec in specs])
    try:
        reward([], [], answers=[], lengths=[])
    except ValueError as exc:
        raise ValueError(f"rewards: {exc}") from None


def build_reward(specs: Sequence[Mapping[str, Any]], *, reward_model_path: str | None = None,
                 device: Any = "cpu", chat_prompts: bool = False, trust_remote_code: bool = False) -> CombinedReward:
    """`combined_reward` of config specs, a `reward_model` component given a scorer of `reward_model_path`
    on `device` (its checkpoint's own code runs only with `trust_remote_code`); a bad spec is a one-line
    AlignflowError naming the rewards. `chat_prompts`: the prompts to score are chat-rendered; a reward model
    trained on the other form gets a warning."""
    specs = [dict(spec) for spec in specs]
    for spec in specs:
        if spec.get("name") == "reward_model":
            from pipeline_lib.models import RewardModel, load_tokenizer
            from pipeline_lib.rewards.model import RewardModelScorer

            model = RewardModel.from_pretrained(reward_model_path, device=device, trust_remote_code=trust_remote_code)
            if model.chat_prompts is not None and model.chat_prompts != chat_prompts:
                forms = ("plain-text", "chat-rendered")
                warnings.warn(f"reward model {reward_model_path} was trained on {forms[model.chat_prompts]} prompts "
                              f"but scores {forms[chat_prompts]} ones here; set chat_template "
                              f"{str(model.chat_prompts).lower()} to match", RuntimeWarning, stacklevel=2)
            tokenizer = load_tokenizer(reward_model_path, trust_remote_code=trust_remote_code)
            spec["scorer"] = RewardModelScorer(model, tokenizer)  # texts cut as the model's training cut them
    try:
        return combined_reward(specs)
    except ValueError as exc:
        raise AlignflowError(f"rewards: {exc}") from None
