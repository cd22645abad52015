"""Fixtures shared by the training-loop tests."""

from __future__ import annotations

import pytest
import torch


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
