"""Models: safe HF loading/saving, the tiny offline model factory, reward/value heads, chunked log-probs."""

from pipeline_lib.models.heads import POOLINGS, RewardModel, ValueModel
from pipeline_lib.models.loading import (
    ModelLoadError,
    load_policy,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    save_model,
)
from pipeline_lib.models.logprobs import completion_logprob_sums, position_ids_from_mask, sequence_logprobs
from pipeline_lib.models.tiny import build_tiny_model, build_tokenizer

__all__ = [
    "POOLINGS",
    "ModelLoadError",
    "RewardModel",
    "ValueModel",
    "build_tiny_model",
    "build_tokenizer",
    "completion_logprob_sums",
    "load_policy",
    "load_tokenizer",
    "position_ids_from_mask",
    "resolve_device",
    "resolve_dtype",
    "save_model",
    "sequence_logprobs",
]
