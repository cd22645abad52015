"""Sampling: `Sampler` protocol + `Completion` (base.py), in-process transformers (hf.py), vLLM's server in its
own venv (vllm.py, vllm_env.py), and the sampling stage writing the `samples` table (stage.py).

Kept light (no torch import) so `alignflow vllm-env` and the server client start fast; import the backends
from their modules."""

from pipeline_lib.sampling.base import Completion, Sampler, SamplingError

__all__ = ["Completion", "Sampler", "SamplingError"]
