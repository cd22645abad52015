"""The `log(metrics, step)` callables library code receives, without importing mlflow (torchrun workers and
the training loops stay light; tracking.py supplies the MLflow one)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

LogFn = Callable[[Mapping[str, float], int], None]


def no_log(metrics: Mapping[str, float], step: int) -> None:
    """The logger of unit tests and of callers that don't track: drops everything."""


def print_log(metrics: Mapping[str, float], step: int) -> None:
    """One human line per step: `step 120 | train/loss 0.693 | rewards/margins 0.12`."""
    print(f"step {step} | " + " | ".join(f"{k} {float(v):.4g}" for k, v in metrics.items()), flush=True)


def jsonl_log(path: Path) -> LogFn:
    """A logger that appends `{"step": 120, "metrics": {...}}` lines to `path` at full precision (JSON writes a
    float's shortest exact repr): the channel through which a torchrun stage's rank 0 hands its metrics to the
    process that launched it (`train.launch`)."""

    def log(metrics: Mapping[str, float], step: int) -> None:
        with open(path, "a") as handle:
            handle.write(json.dumps({"step": step, "metrics": {k: float(v) for k, v in metrics.items()}}) + "\n")

    return log
