"""vLLM's NCCL weight transfer from the trainer: the /update_weights payload matches the broadcast order, the
server is put on a GPU apart from the policy's, NCCL load failures are one line; on two GPUs (marked gpu) a
pushed policy serves exactly what the policy itself generates."""

from __future__ import annotations

import sys

import pytest
import torch

from pipeline_lib.config import SampleConfig
from pipeline_lib.models import load_policy, load_tokenizer
from pipeline_lib.sampling.stage import open_sampler
from pipeline_lib.sampling.hf import HFSampler
from pipeline_lib.sampling.vllm import PYTHON_ENV, VLLMServer, VLLMServerError, find_vllm_python, memory_share
from pipeline_lib.sampling.weight_transfer import (
    NCCL_LIB_ENV,
    NcclWeightTransfer,
    WeightTransferError,
    load_nccl,
    server_gpu,
    update_info,
)
from pipeline_lib.train.rollout import open_policy_sampler

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


def test_a_server_on_a_gpu_this_process_uses_asks_for_what_is_free(tiny_model_dir, monkeypatch):
    """vLLM's default share (0.92 of the GPU's memory, which must be free at its start) failed beside anything: a
    server on the trainer's GPU (one GPU, GRPO's rollouts) or after an in-process stage (the pipeline's SFT leaves its
    blocks in torch's cache). The share is 90% of what is free once the cache is released, at most 0.3 beside a
    trainer; None (vLLM's default) where this process never used CUDA, as on CPU. A GPU's answers are simulated: 71
    GiB of 79.2 free."""
    assert memory_share(beside_trainer=True) is None and memory_share(beside_trainer=False) is None  # CPU
    released = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (71 * 2**30, int(79.2 * 2**30)))
    assert memory_share(beside_trainer=False) == 0.80 and released == [True]
    assert memory_share(beside_trainer=True) == 0.3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 2**30, 80 * 2**30))
    assert memory_share(beside_trainer=True) == 0.11
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**29, 80 * 2**30))  # under 1/90 free
    with pytest.raises(VLLMServerError, match=r"^GPU 0 has 0.5 GiB free of 80.0: too little for a vLLM server"):
        memory_share(beside_trainer=False)
    server = VLLMServer(tiny_model_dir, python=sys.executable, gpu_memory_utilization=0.11)
    server.cuda = True  # the command a GPU machine builds
    command = server.command()
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.11"
    assert "--gpu-memory-utilization" not in VLLMServer(tiny_model_dir, python=sys.executable).command()


def test_a_memory_share_set_in_the_config_reaches_the_server_of_a_stage_and_of_rollouts(tiny_model_dir, tmp_path,
                                                                                         monkeypatch):
    """`vllm_gpu_memory_utilization` is passed whatever memory_share would pick (here on CPU, where it picks vLLM's
    default), and becomes the flag on a GPU machine. The servers are stopped at their start: the test reads the
    command they would run."""
    monkeypatch.setenv(PYTHON_ENV, sys.executable)  # any python: no server is run
    commands = []

    class NotStarted(Exception):
        pass

    def record(server):
        server.cuda = True  # the command a GPU machine builds
        commands.append(server.command())
        raise NotStarted

    monkeypatch.setattr(VLLMServer, "__enter__", record)
    cfg = SampleConfig(model_path=str(tiny_model_dir), backend="vllm", vllm_gpu_memory_utilization=0.45)
    with pytest.raises(NotStarted), open_sampler(cfg):
        pass
    policy = load_policy(tiny_model_dir, device="cpu")
    with pytest.raises(NotStarted), open_policy_sampler("vllm", policy, load_tokenizer(tiny_model_dir),
                                                        sync_dir=tmp_path / "sync", vllm_gpu_memory_utilization=0.2):
        pass
    with pytest.raises(NotStarted), open_policy_sampler("vllm", policy, load_tokenizer(tiny_model_dir),
                                                        sync_dir=tmp_path / "sync"):
        pass
    shares = [command[command.index("--gpu-memory-utilization") + 1] if "--gpu-memory-utilization" in command
              else None for command in commands]
    assert shares == ["0.45", "0.2", None]  # the last: memory_share's None on a CPU policy


def test_a_server_side_failure_keeps_the_servers_log_and_names_its_error(tiny_model_dir, tmp_path):
    """An engine that dies mid-run answers "HTTP 500: EngineCore encountered an issue. See stack trace (above)", a
    trace only its log holds, and the log was removed when the server stopped (the GSM8K audit's head_dim=24 model).
    (The exit is run on a server not started.)"""
    server = VLLMServer(tiny_model_dir, python=sys.executable)
    server.log_path = tmp_path / "server.log"
    server.log_path.write_text("INFO start\nRuntimeError: Unsupported CPU attention configuration: head_dim=24\n"
                               "WARNING 12-07 10:40:01 Found ulimit of 20000 and failed to automatically increase it "
                               "(OSError: [Errno 24] Too many open files)\n")  # every start warns so, on some machines
    failure = VLLMServerError("vLLM server http://127.0.0.1:1/v1/completions: HTTP 500: EngineCore encountered an "
                              "issue. See stack trace (above) for the root cause.", status=500, transient=True)
    with pytest.raises(VLLMServerError) as raised:
        server.__exit__(VLLMServerError, failure, None)
    assert str(raised.value) == (f"{failure}; the server's log says: RuntimeError: Unsupported CPU attention "
                                 f"configuration: head_dim=24 (log: {server.log_path})")
    assert raised.value.transient and raised.value.status == 500 and server.log_path.is_file()
    assert not server._remove_log  # stop() keeps it (removed after a clean run, or a 4xx: the request's own fault)
    refused = VLLMServer(tiny_model_dir, python=sys.executable)
    refused.__exit__(VLLMServerError, VLLMServerError("HTTP 400: prompt too long", status=400), None)
    assert refused._remove_log


def test_the_servers_cpu_kv_cache_is_1_gib_unless_the_user_set_it(tiny_model_dir, monkeypatch):
    """The server's environment overwrote a user's $VLLM_CPU_KVCACHE_SPACE with 1 (GiB); telemetry stays off."""
    server = VLLMServer(tiny_model_dir, python=sys.executable)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert server.environment()["VLLM_CPU_KVCACHE_SPACE"] == "1"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    monkeypatch.setenv("VLLM_NO_USAGE_STATS", "0")
    assert server.environment()["VLLM_CPU_KVCACHE_SPACE"] == "8" and server.environment()["VLLM_NO_USAGE_STATS"] == "1"


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(find_vllm_python() is None, reason="needs the vLLM env")
def test_a_server_starts_on_the_gpu_a_trainer_holds(tiny_model_dir):
    """One GPU: the server beside a policy and a quarter of the GPU's memory held by this process, as GRPO's rollouts
    run it, starts and samples (vLLM's default share refused to start)."""
    policy = load_policy(tiny_model_dir, device="cuda")
    held = torch.empty(torch.cuda.mem_get_info(0)[1] // 4, dtype=torch.uint8, device="cuda")
    share = memory_share(beside_trainer=True)
    with VLLMServer(tiny_model_dir, max_model_len=256, gpu_memory_utilization=share) as server:
        sampler = server.sampler()
        assert len(sampler.generate(PROMPTS, n=2, max_new_tokens=4, temperature=1.0)) == len(PROMPTS)
        sampler.close()
    del held, policy


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


def test_the_servers_gloo_and_nccl_sockets_are_on_loopback_unless_the_user_names_an_interface(tiny_model_dir,
                                                                                             monkeypatch):
    """NCCL's bootstrap (the weight transfer's unique id included) and gloo's pairs listen on the first interface that
    is not loopback by default, reachable from the network; the server and the trainer meet on one machine."""
    server = VLLMServer(tiny_model_dir, python=sys.executable, nccl_weight_transfer=True)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    assert {server.environment()[name] for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")} == {"lo"}
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert server.environment()["NCCL_SOCKET_IFNAME"] == "ib0"
