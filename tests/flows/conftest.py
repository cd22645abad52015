"""Flows run under one session-scoped Prefect test harness, each test in its own workspace."""

from __future__ import annotations

import pytest
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    with prefect_test_harness(server_startup_timeout=60):
        yield


@pytest.fixture
def flow_workspace(workspace, monkeypatch):
    """The workspace the tasks resolve through ALIGNFLOW_HOME."""
    monkeypatch.setenv("ALIGNFLOW_HOME", str(workspace.root))
    return workspace
