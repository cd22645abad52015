"""Fixtures shared by the training-loop tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline_lib.models import RewardModel, load_tokenizer


@pytest.fixture
def one_thread():
    """Bit-exact comparisons run on one thread: with several, MKL may pick its thread count by machine load,
    which changes the summation order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def collect():
    """`logged, log = collect()`: a LogFn for the training loops that records (step, metrics) into `logged`."""

    def sink():
        logged: list[tuple[int, dict]] = []
        return logged, lambda metrics, step: logged.append((step, dict(metrics)))

    return sink


@pytest.fixture(scope="module")
def reward_model(tiny, tmp_path_factory) -> Path:
    """A reward model on the module's `tiny` backbone with a seeded random head: scores differ between
    completions, which is all the loop mechanics need (the slow learning tests train real ones)."""
    return RewardModel.from_policy(tiny, device="cpu", seed=1).save_pretrained(tmp_path_factory.mktemp("rm") / "rm",
                                                                               load_tokenizer(tiny))
