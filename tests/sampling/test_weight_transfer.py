"""vLLM's NCCL weight transfer from the trainer: the /update_weights payload matches the broadcast order, the
server is put on a GPU apart from the policy's, NCCL load failures are one line; on two GPUs (marked gpu) a
pushed policy serves exactly what the policy itself generates."""

from __future__ import annotations

import pytest
import torch

from pipeline_lib.models import load_policy, load_tokenizer
from pipeline_lib.sampling.hf import HFSampler
from pipeline_lib.sampling.vllm import VLLMServer, find_vllm_python
from pipeline_lib.sampling.weight_transfer import (
    NCCL_LIB_ENV,
    NcclWeightTransfer,
    WeightTransferError,
    load_nccl,
    server_gpu,
    update_info,
)

PROMPTS = ["12+34=", "5+6=", "97+70="]


def test_update_info_lists_every_tensor_in_state_dict_order(tiny_model_dir):
    model = load_policy(tiny_model_dir, device="cpu")
    model.lm_head.to(torch.bfloat16)
    info = update_info(model)
    state = model.state_dict()
    assert info["names"] == list(state)
    assert info["shapes"] == [list(t.shape) for t in state.values()]
    # vLLM's worker rebuilds each dtype with getattr(torch, name)
    assert [getattr(torch, name) for name in info["dtype_names"]] == [t.dtype for t in state.values()]
    assert info["dtype_names"][info["names"].index("lm_head.weight")] == "bfloat16"


def test_no_server_gpu_for_a_cpu_policy():
    assert server_gpu(torch.device("cpu")) is None


def test_missing_nccl_library_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv(NCCL_LIB_ENV, str(tmp_path / "libnccl.so.2"))
    with pytest.raises(WeightTransferError) as caught:
        load_nccl()
    assert NCCL_LIB_ENV in str(caught.value) and "\n" not in str(caught.value)


def test_server_command_enables_nccl_transfer_only_when_asked(tiny_model_dir):
    python = find_vllm_python() or tiny_model_dir / "config.json"  # any file: the command is not run
    plain = VLLMServer(tiny_model_dir, python=python, weight_updates=True).command()
    nccl = VLLMServer(tiny_model_dir, python=python, nccl_weight_transfer=True).command()
    assert "--weight-transfer-config" not in plain
    assert nccl[nccl.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or find_vllm_python() is None,
                    reason="needs two CUDA GPUs and the vLLM env")
def test_pushed_policy_generates_like_the_policy(tiny_model_dir):
    policy = load_policy(tiny_model_dir, device="cuda:0")
    with VLLMServer(tiny_model_dir, max_model_len=256, nccl_weight_transfer=True,
                    cuda_devices=server_gpu(policy.device)) as server:
        sampler = server.sampler()
        transfer = NcclWeightTransfer(sampler.post, device=policy.device)
        before = sampler.generate(PROMPTS, n=1, max_new_tokens=6, temperature=0)
        with torch.no_grad():
            policy.lm_head.weight.mul_(-3.0)
        with sampler.paused():
            transfer.push(policy)
        after = sampler.generate(PROMPTS, n=1, max_new_tokens=6, temperature=0)
        expected = HFSampler(policy, load_tokenizer(tiny_model_dir)).generate(
            PROMPTS, n=1, max_new_tokens=6, temperature=0)
        transfer.close()
        sampler.close()
    assert after != before
    assert [g[0].token_ids for g in after] == [g[0].token_ids for g in expected]
