"""What every sampler returns (`Completion`) and the `Sampler` protocol the HF and vLLM backends share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pipeline_lib.errors import AlignflowError

FinishReason = Literal["stop", "length"]


class SamplingError(AlignflowError, ValueError):
    """Bad sampling arguments or a failed backend, in one line."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled continuation of a prompt.

    `token_ids` are the generated tokens only, including the eos token when the model emitted one
    (RL losses need its log-prob); `text` is their decoding without that eos (other special tokens
    stay, so a verifier reads what the model wrote), cut before a stop string when one ended the
    sample. `logprobs[i]` is log π(token_ids[i]) under the raw (temperature 1, unfiltered)
    distribution, present when asked for."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


class Sampler(Protocol):
    """N samples per prompt; `generate(...)[i][j]` is sample j of prompt i.

    `temperature=0` is greedy decoding. `seed` makes a call reproducible (the same seed and prompts
    give the same completions); `None` draws fresh randomness. `stop` strings end a sample early."""

    def generate(
        self,
        prompts: Sequence[str],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        logprobs: bool = False,
    ) -> list[list[Completion]]: ...


MIN_TEMPERATURE = 0.01  # logits / T overflow below it; vLLM raises such temperatures to 0.01 itself


def check_sampling_args(prompts: Sequence[str], *, n: int, max_new_tokens: int, temperature: float,
                        top_p: float, stop: Sequence[str] = ()) -> None:
    """Both backends reject the same bad arguments with the same one-line errors."""
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise SamplingError("prompts: expected a list of strings")
    if n < 1:
        raise SamplingError(f"n={n}: expected at least 1 sample per prompt")
    if max_new_tokens < 1:
        raise SamplingError(f"max_new_tokens={max_new_tokens}: expected at least 1")
    if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise SamplingError(f"temperature={temperature}: expected 0 (greedy) or >= {MIN_TEMPERATURE}")
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise SamplingError(f"stop={stop!r}: expected a list of non-empty strings")
    if not 0 < top_p <= 1:
        raise SamplingError(f"top_p={top_p}: expected a value in (0, 1]")
