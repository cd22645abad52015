"""Shared fixtures: offline settings, a fresh workspace per test, torch kept to the machine's cores."""

from __future__ import annotations

import os

from pipeline_lib.workspace import OFFLINE_ENV

for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402

from pipeline_lib.workspace import Workspace  # noqa: E402


@pytest.fixture
def workspace(tmp_path) -> Workspace:
    """An empty workspace under the test's tmp dir."""
    return Workspace(tmp_path / "ws").create()


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """This process's environment for a child `alignflow`, without the MLFLOW_TRACKING_URI that mlflow
    exported for an earlier test's workspace (the child would take it for the user's server)."""
    return {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly without CUDA."""
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
