"""Shared loop helpers: schedule values, the NaN guard, clipping, seeded resumable data order, atomic
checkpoints with RNG state, the final model dir."""

from __future__ import annotations

import contextlib
import json
import math
import random

import pytest
import torch
from torch import nn

from pipeline_lib.errors import AlignflowError
from pipeline_lib.models import RewardModel, build_tiny_model, load_tokenizer
from pipeline_lib.train.common import (
    CHECKPOINT_DIR,
    FINAL_MARKER,
    Dist,
    NonFiniteLossError,
    autocast,
    batches,
    check_finite,
    check_in_sync,
    clip_gradients,
    epoch_order,
    init_distributed,
    load_checkpoint,
    make_optimizer,
    make_scheduler,
    mean_over_ranks,
    save_checkpoint,
    save_final,
    seed_everything,
)


def lr_factors(kind: str, *, warmup: int, total: int, steps: int) -> list[float]:
    optimizer = make_optimizer([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler(optimizer, warmup_steps=warmup, total_steps=total, kind=kind)
    factors = []
    for _ in range(steps):
        factors.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return factors


def test_schedules_warm_up_linearly_then_decay():
    """warmup 2: steps 0, 1 -> 1/2, 2/2. total 6 leaves 4 decay steps: progress (s - 2) / 4.
    linear 1 - p: 1, .75, .5, .25; cosine 0.1 + 0.45 (1 + cos πp): 1, 0.1 + 0.45 (1 + √½) = .86820, .55, .23180."""
    assert lr_factors("constant", warmup=2, total=6, steps=6) == pytest.approx([0.5, 1, 1, 1, 1, 1])
    assert lr_factors("linear", warmup=2, total=6, steps=7) == pytest.approx([0.5, 1, 1, 0.75, 0.5, 0.25, 0])
    cosine = lr_factors("cosine", warmup=2, total=6, steps=8)
    assert cosine == pytest.approx([0.5, 1, 1, 0.86820, 0.55, 0.23180, 0.1, 0.1], abs=1e-5)


def test_make_optimizer_skips_frozen_parameters():
    frozen, trained = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    frozen.requires_grad_(False)
    optimizer = make_optimizer([frozen, trained], lr=0.1, weight_decay=0.01)
    assert [p.shape for p in optimizer.param_groups[0]["params"]] == [torch.Size([3])]
    assert optimizer.param_groups[0]["weight_decay"] == 0.01


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_check_finite_names_the_step(bad):
    check_finite(torch.tensor(0.7), step=3)
    with pytest.raises(NonFiniteLossError, match=r"train/loss is .* at step 12; stopping, no final model written"):
        check_finite(torch.tensor(bad), step=12)


def test_clip_gradients_returns_the_norm_before_clipping():
    """grads (3, 4) -> norm 5; clipped to 1 -> (0.6, 0.8)."""
    layer = nn.Linear(2, 1, bias=False)
    layer.weight.grad = torch.tensor([[3.0, 4.0]])
    assert clip_gradients(layer, None) == pytest.approx(5.0)
    assert layer.weight.grad.tolist() == [[3.0, 4.0]]
    assert clip_gradients(layer, 1.0) == pytest.approx(5.0)
    assert layer.weight.grad[0].tolist() == pytest.approx([0.6, 0.8], abs=1e-6)
    assert clip_gradients(nn.Linear(2, 1), 1.0) == 0.0  # no gradients yet


def test_single_process_distributed_context(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = init_distributed()
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.enabled) == (0, 1, True, False)
    assert Dist(rank=1, world_size=2).shard([10, 11, 12, 13]) == [11, 13]
    assert Dist(rank=0, world_size=2).shard([10, 11, 12, 13]) == [10, 12]
    value = torch.tensor(2.5)
    assert ctx.all_reduce_mean(value) is value
    assert mean_over_ranks(ctx, {"b": torch.tensor(2.0), "a": torch.tensor([1.5])}) == {"a": 1.5, "b": 2.0}
    check_in_sync(nn.Linear(2, 2), ctx)  # one rank is always in sync
    assert isinstance(autocast(torch.device("cpu")), contextlib.nullcontext)  # no bf16 autocast on CPU


def test_batches_are_seeded_resumable_and_drop_the_tail():
    """10 items, batch 3 -> 3 full batches per epoch (item left over each epoch)."""
    stream = batches(10, 3, seed=5)
    first = [next(stream) for _ in range(7)]
    assert [step for step, _ in first] == list(range(7))
    epoch0 = epoch_order(10, seed=5, epoch=0)
    assert sorted(epoch0) == list(range(10))
    assert [idx for _, idx in first[:3]] == [epoch0[0:3], epoch0[3:6], epoch0[6:9]]
    assert first[3][1] == epoch_order(10, seed=5, epoch=1)[0:3]
    resumed = batches(10, 3, seed=5, start_step=4)
    assert [next(resumed) for _ in range(3)] == first[4:7]
    assert epoch_order(10, seed=6, epoch=0) != epoch0
    with pytest.raises(AlignflowError, match="batch_size 11 is larger than the training set"):
        next(batches(10, 11, seed=0))


def test_seed_everything_fixes_torch_and_python_streams():
    seed_everything(3)
    a = (torch.rand(3), random.random())
    seed_everything(3)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


def _trained_state(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optimizer = make_optimizer(model.parameters(), lr=0.1)
    scheduler = make_scheduler(optimizer, warmup_steps=1, total_steps=10)
    for _ in range(2):
        model(torch.randn(4, 3)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, optimizer, scheduler


def test_checkpoint_round_trip_restores_everything(tmp_path):
    model, optimizer, scheduler = _trained_state()
    random.seed(11)
    torch.manual_seed(12)
    save_checkpoint(tmp_path, step=2, model=model, optimizer=optimizer, scheduler=scheduler, extra={"eval": 0.5})
    expected_next = (torch.rand(2), random.random())
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_DIR]  # temp dirs renamed away

    fresh, fresh_opt, fresh_sched = _trained_state(seed=1)
    torch.manual_seed(99)
    random.seed(99)
    step, extra = load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched)
    assert (step, extra) == (2, {"eval": 0.5})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], fresh_opt.state_dict()["state"][0]["exp_avg"])
    assert fresh_sched.last_epoch == scheduler.last_epoch == 2
    restored_next = (torch.rand(2), random.random())
    assert torch.equal(restored_next[0], expected_next[0]) and restored_next[1] == expected_next[1]


def test_checkpoint_survives_a_crash_between_renames(tmp_path):
    model, optimizer, scheduler = _trained_state()
    save_checkpoint(tmp_path, step=4, model=model, optimizer=optimizer)
    (tmp_path / CHECKPOINT_DIR).rename(tmp_path / f".{CHECKPOINT_DIR}.old")  # old moved aside, new not yet in place
    (tmp_path / f".{CHECKPOINT_DIR}.tmp").mkdir()  # a half-written new one
    fresh, fresh_opt, _ = _trained_state(seed=1)
    assert load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt)[0] == 4
    assert torch.equal(fresh.weight, model.weight)
    assert load_checkpoint(tmp_path / "empty", model=fresh, optimizer=fresh_opt) is None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "base", ["12+34=46", "no answer!"],
                            hidden_size=64, num_heads=2, intermediate_size=128)


def test_save_final_writes_safetensors_and_drops_the_checkpoint(tmp_path, tiny_dir):
    reward = RewardModel.from_policy(tiny_dir, device="cpu")
    optimizer = make_optimizer(reward.parameters(), lr=0.1)
    save_checkpoint(tmp_path, step=1, model=reward, optimizer=optimizer)
    final = save_final(reward, load_tokenizer(tiny_dir), tmp_path, metrics={"eval/rm_accuracy": 0.9})
    assert final == tmp_path / "final"
    names = {p.name for p in final.iterdir()}
    assert {"model.safetensors", "reward_head.safetensors", "tokenizer.json", FINAL_MARKER} <= names
    assert json.loads((final / FINAL_MARKER).read_text()) == {"metrics": {"eval/rm_accuracy": 0.9}}
    assert not (tmp_path / CHECKPOINT_DIR).exists() and not (tmp_path / ".final.tmp").exists()
    loaded = RewardModel.from_pretrained(final, device="cpu")
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert math.isclose(float(loaded(ids, torch.ones_like(ids))), float(reward(ids, torch.ones_like(ids))),
                            rel_tol=1e-6)
