"""Damaged and hostile model dirs (issue #8): truncated safetensors weights or heads, a broken head config ->
one-line ModelLoadError (an AlignflowError, so the CLI and `python -m pipeline_lib.train.*` print one line);
every stage config keeps trust_remote_code off by default."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
from pydantic import BaseModel
from safetensors.torch import save_file

from pipeline_lib import config as config_module
from pipeline_lib.config import SFTConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.models import RewardModel, ValueModel, build_tiny_model, load_policy, load_tokenizer
from pipeline_lib.models.loading import ModelLoadError
from pipeline_lib.train.data import write_run_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", ["12+34=46", "no idea"], hidden_size=64,
                            num_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def rm_dir(tiny_dir, tmp_path_factory) -> Path:
    return RewardModel.from_policy(tiny_dir, device="cpu", seed=1).save_pretrained(
        tmp_path_factory.mktemp("rm") / "rm", load_tokenizer(tiny_dir))


def damaged_copy(src: Path, dst: Path, name: str, keep: float | int) -> Path:
    """A copy of `src` whose file `name` keeps its first `keep` bytes (a fraction: of its size)."""
    shutil.copytree(src, dst)
    data = (dst / name).read_bytes()
    (dst / name).write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    return dst


CUTS = [0, 7, 100, 0.5, -1]  # empty, inside the 8-byte header length, inside the JSON header, half, last byte


@pytest.mark.parametrize("keep", CUTS)
def test_truncated_policy_weights_are_one_line_error(tiny_dir, tmp_path, keep):
    model_dir = damaged_copy(tiny_dir, tmp_path / "cut", "model.safetensors", keep)
    with pytest.raises(ModelLoadError) as err:
        load_policy(model_dir, device="cpu")
    message = str(err.value)
    assert isinstance(err.value, AlignflowError) and "\n" not in message
    assert message.startswith(f"model dir {model_dir}: AutoModelForCausalLM could not load it (SafetensorError: "
                              "Error while deserializing header: ")


@pytest.mark.parametrize("name", ["model.safetensors", "reward_head.safetensors"])
@pytest.mark.parametrize("keep", CUTS)
def test_truncated_reward_model_files_are_one_line_error(rm_dir, tmp_path, name, keep):
    model_dir = damaged_copy(rm_dir, tmp_path / "cut", name, keep)
    with pytest.raises(ModelLoadError) as err:
        RewardModel.from_pretrained(model_dir, device="cpu")
    message = str(err.value)
    assert "\n" not in message and "SafetensorError: Error while deserializing header" in message
    expected = f"{model_dir / name}: cannot load the reward head" if name.startswith("reward") else \
        f"model dir {model_dir}: AutoModel could not load it"
    assert message.startswith(expected)


def test_broken_head_config_and_a_wrong_shaped_head_are_one_line_errors(rm_dir, tiny_dir, tmp_path):
    broken = damaged_copy(rm_dir, tmp_path / "json", "reward_config.json", 0.5)
    with pytest.raises(ModelLoadError, match=r"reward_config\.json: not valid JSON"):
        RewardModel.from_pretrained(broken, device="cpu")
    value_dir = ValueModel.from_policy(tiny_dir, device="cpu").save_pretrained(tmp_path / "value")
    shutil.copy(rm_dir / "reward_head.safetensors", value_dir / "value_head.safetensors")  # a (1, 64) head, fine
    ValueModel.from_pretrained(value_dir, device="cpu")
    save_file({"weight": torch.zeros(1, 32), "bias": torch.zeros(1)}, str(value_dir / "value_head.safetensors"))
    with pytest.raises(ModelLoadError, match=r"value_head\.safetensors: cannot load the value head \(RuntimeError: "):
        ValueModel.from_pretrained(value_dir, device="cpu")


@pytest.mark.slow  # a subprocess importing torch + transformers: ~8 s on 2 busy cores
def test_training_entry_point_reports_a_truncated_model_in_one_line(tiny_dir, tmp_path):
    """`python -m pipeline_lib.train.sft --config run.json` (what torchrun launches) on a truncated model:
    exit 2 and one `error:` line; before ModelLoadError was an AlignflowError this was a traceback."""
    model_dir = damaged_copy(tiny_dir, tmp_path / "cut", "model.safetensors", 0.5)
    rows = pl.DataFrame({"prompt": ["1+1="] * 4, "completion": ["2"] * 4})
    run_file = write_run_file(tmp_path / "run.json", SFTConfig(model_path=str(model_dir), max_steps=1,
                                                                batch_size=2, device="cpu"),
                              {"rows": rows}, tmp_path / "out")
    result = subprocess.run([sys.executable, "-m", "pipeline_lib.train.sft", "--config", str(run_file)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: model dir {model_dir}: AutoModelForCausalLM could "
                                                   "not load it (SafetensorError:"), result.stderr
    assert not (tmp_path / "out" / "final").exists()


@pytest.mark.parametrize("where", ["attn_implementation", "_attn_implementation", "text_config"])
def test_an_attention_implementation_from_the_hub_is_refused_without_trust_remote_code(tiny_dir, tmp_path, where):
    """`attn_implementation: kernels-community/flash-attn` in config.json made transformers load that Hub repo's
    kernel code with trust_remote_code off (it stopped here only because the `kernels` package is missing)."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    key = "attn_implementation" if where == "text_config" else where
    setting = {key: "kernels-community/flash-attn"}
    hostile = config | ({where: setting} if where == "text_config" else setting)
    (model_dir / "config.json").write_text(json.dumps(hostile))
    with pytest.raises(ModelLoadError) as refused:
        load_policy(model_dir, device="cpu")
    assert str(refused.value) == (f"model dir {model_dir}: config.json's {key} 'kernels-community/flash-attn' is a "
                                  "Hub kernel repo, whose code transformers would run; remove it, or trust the dir's "
                                  "code (trust_remote_code)")
    with pytest.raises(ModelLoadError, match="could not load it"):  # trusted: transformers' own error, offline
        load_policy(model_dir, device="cpu", trust_remote_code=True)
    (model_dir / "config.json").write_text(json.dumps(config | {"attn_implementation": "eager"}))
    assert load_policy(model_dir, device="cpu").config._attn_implementation == "eager"


def test_every_stage_config_keeps_remote_code_off_by_default():
    configs = [obj for obj in vars(config_module).values()
               if isinstance(obj, type) and issubclass(obj, BaseModel) and "trust_remote_code" in obj.model_fields]
    names = {cls.__name__ for cls in configs}
    assert {"SFTConfig", "RMConfig", "DPOConfig", "GRPOConfig", "DAPOConfig", "PPOConfig", "SampleConfig", "EvalConfig",
            "PipelineEvalConfig"} <= names
    assert all(cls.model_fields["trust_remote_code"].default is False for cls in configs)
    # no config can allow pickle weights at all: only a caller of the library can
    assert not [cls for cls in vars(config_module).values()
                if isinstance(cls, type) and issubclass(cls, BaseModel) and "allow_pickle" in cls.model_fields]
