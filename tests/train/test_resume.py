"""Checkpoint/resume: `python -m pipeline_lib.train.<stage> --config run.json` killed with SIGKILL once a
checkpoint exists, then rerun, ends with the same weights as an uninterrupted run (CPU: within 1e-6).
Stages: sft, rm, dpo, dapo, ppo here; grpo's own SIGKILL test is in test_grpo.py. The same runs, shortened, are
this suite's CUDA check of every stage (`gpu`)."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from pipeline_lib.config import DAPOConfig, DPOConfig, PPOConfig, RMConfig, SFTConfig
from pipeline_lib.models import build_tiny_model
from pipeline_lib.train.data import write_run_file
from pipeline_lib.train.dpo import train_dpo
from pipeline_lib.train.grpo import train_grpo
from pipeline_lib.train.ppo import train_ppo
from pipeline_lib.train.rm import train_rm
from pipeline_lib.train.sft import train_sft

ROOT = Path(__file__).resolve().parents[2]
# one thread in every run: the same kernels in the same order, so floats match bit for bit
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("resume") / "base", ["0123456789+=", "no idea!"],
                            hidden_size=64, num_heads=2, intermediate_size=128)


def pairs(n: int) -> pl.DataFrame:
    rng = random.Random(0)
    rows = [(rng.randrange(50), rng.randrange(50)) for _ in range(n)]
    return pl.DataFrame({"prompt": [f"{a:02d}+{b:02d}=" for a, b in rows], "chosen": [str(a + b) for a, b in rows],
                         "rejected": [str(a + b + 1) if i % 2 else "no idea!" for i, (a, b) in enumerate(rows)]})


def stage_run(stage: str, model: Path, reward_model: Path) -> tuple[object, dict[str, pl.DataFrame]]:
    loop = dict(max_steps=60, batch_size=8, save_every=3, log_every=1, lr=1e-3, device="cpu")
    data = pairs(48)
    if stage == "sft":
        return SFTConfig(model_path=str(model), **loop), {"rows": data.select("prompt", completion="chosen")}
    if stage == "rm":
        return RMConfig(model_path=str(model), **loop), {"data": data}
    if stage == "dpo":
        return DPOConfig(policy_path=str(model), **loop), {"pairs": data}
    online = dict(max_steps=8, save_every=1, log_every=1, lr=1e-3, max_new_tokens=2, device="cpu")
    if stage == "dapo":
        # The random tiny model answers "4" in about 1 of 9 samples: with every gold answer "4", groups of 4
        # are mixed often enough that dynamic sampling keeps some and refills the rest (data_step moves on).
        cfg = DAPOConfig(policy_path=str(model), prompts_per_step=4, group_size=4, mini_batch_size=8,
                         warmup_steps=0, rewards=({"name": "verifier"}, {"name": "overlong", "max_len": 2,
                                                                        "cache_len": 1}), **online)
        return cfg, {"problems": data.select("prompt", answer=pl.lit("4"))}
    cfg = PPOConfig(policy_path=str(model), reward_model_path=str(reward_model), prompts_per_step=8,
                    mini_batch_size=4, ppo_epochs=2, critic_lr=1e-3, **online)
    return cfg, {"prompts": data.select("prompt")}


def command(stage: str, run_file: Path) -> list[str]:
    module = "grpo" if stage == "dapo" else stage  # DAPO is train_grpo with DAPOConfig's settings
    return [sys.executable, "-m", f"pipeline_lib.train.{module}", "--config", str(run_file)]


@pytest.mark.slow  # three subprocesses per stage: ~17 s each on 2 cores
@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "dapo", "ppo"])
def test_sigkilled_run_resumes_to_the_uninterrupted_weights(stage, tiny, reward_model, tmp_path):
    cfg, frames = stage_run(stage, tiny, reward_model)
    save_every = cfg.save_every
    full_file = write_run_file(tmp_path / "full.json", cfg, frames, tmp_path / "full")
    killed_file = write_run_file(tmp_path / "killed.json", cfg, frames, tmp_path / "killed")
    full = subprocess.Popen(command(stage, full_file), env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    victim = subprocess.Popen(command(stage, killed_file), env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    checkpoint = tmp_path / "killed" / "checkpoint" / "trainer_state.json"
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL, "the run ended before it could be killed mid-way"
    assert not (tmp_path / "killed" / "final").exists()

    resumed = subprocess.run(command(stage, killed_file), env=ENV, cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    # every step logs (log_every 1); a DAPO step whose groups were all filtered out logs no train/loss
    train_steps = [int(line.split()[1]) for line in resumed.stdout.splitlines()
                   if line.startswith("step ") and "eval/" not in line]
    assert train_steps[0] > save_every and train_steps[0] % save_every == 1 % save_every, \
        "the rerun did not start from a checkpoint"
    assert train_steps[-1] == cfg.max_steps
    output, _ = full.communicate(timeout=300)
    assert full.returncode == 0, output.decode()
    if stage == "dapo":  # refills before the kill point moved the prompt stream, which the checkpoint must restore
        logged = [dict(part.rsplit(" ", 1) for part in line.split(" | ")) for line in output.decode().splitlines()
                  if line.startswith("step ")]  # "step 3 | rollout/refill_rounds 1 | ..."
        refills = [int(row["step"]) for row in logged if float(row.get("rollout/refill_rounds", 0)) > 0]
        assert refills and refills[0] < train_steps[0], "no refill round before the resume point"

    files = sorted(p.name for p in (tmp_path / "full" / "final").glob("*.safetensors"))
    assert files == sorted(p.name for p in (tmp_path / "killed" / "final").glob("*.safetensors"))
    for name in files:  # model.safetensors (+ reward_head.safetensors for the RM)
        a = load_file(str(tmp_path / "full" / "final" / name))
        b = load_file(str(tmp_path / "killed" / "final" / name))
        assert a.keys() == b.keys()
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6, name
    if stage in ("dapo", "ppo"):  # the online loops really updated the policy, so the equality says something
        start = load_file(str(tiny / "model.safetensors"))
        final = load_file(str(tmp_path / "full" / "final" / "model.safetensors"))
        assert any(not torch.equal(start[k], final[k]) for k in start)


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model dir's safetensors files, named without a causal LM's `model.` prefix (an RM's
    backbone is saved without it)."""
    return {name.removeprefix("model."): tensor for file in sorted(model_dir.glob("*.safetensors"))
            for name, tensor in load_file(str(file)).items()}


@pytest.mark.gpu
@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "dapo", "ppo"])
def test_each_stage_trains_on_cuda_under_bf16_autocast(stage, tiny, reward_model, tmp_path):
    """`device: auto` on a CUDA machine: the GPU, bf16 autocast, the fused AdamW, sampling on the device (DAPO, PPO
    with the HF sampler). Three steps end in a final whose weights are finite and moved, every logged train metric
    finite. Not run yet: no GPU machine was lent to the sessions that wrote it."""
    cfg, frames = stage_run(stage, tiny, reward_model)
    cfg = type(cfg).model_validate(cfg.model_dump() | {"device": "auto", "max_steps": 3, "save_every": 3})
    train = {"sft": train_sft, "rm": train_rm, "dpo": train_dpo, "dapo": train_grpo, "ppo": train_ppo}[stage]
    logged: list[dict] = []
    torch.cuda.reset_peak_memory_stats()
    [frame] = frames.values()
    final = train(cfg, frame, tmp_path / "out", log=lambda metrics, step: logged.append(dict(metrics)))
    assert torch.cuda.max_memory_allocated() > 0  # the run was on the GPU
    values = [value for metrics in logged for key, value in metrics.items() if key.startswith("train/")]
    assert values and all(math.isfinite(value) for value in values)
    start, end = weights(tiny), weights(final)
    assert all(torch.isfinite(tensor.float()).all() for tensor in end.values())
    assert any(not torch.equal(start[name], end[name]) for name in start.keys() & end.keys())
