"""Shared loop helpers: schedule values, the NaN guard, clipping, seeded resumable data order, atomic
checkpoints with RNG state, the final model dir."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import random
import warnings
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pytest
import torch
import transformers
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn

from pipeline_lib.config import ConfigError, SFTConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.logfns import LogFn, no_log
from pipeline_lib.model_dirs import model_dir_complete
from pipeline_lib.models import RewardModel, build_tiny_model, load_policy, load_tokenizer
from pipeline_lib.train.common import (
    CHECKPOINT_DIR,
    FINAL_MARKER,
    CheckpointWriteError,
    Dist,
    NonFiniteLossError,
    OtherRunError,
    autocast,
    batches,
    check_finite,
    check_in_sync,
    clip_gradients,
    deterministic_kernels,
    epoch_order,
    finished_final,
    init_distributed,
    load_checkpoint,
    make_optimizer,
    make_scheduler,
    mean_over_ranks,
    packing_saves,
    reserve_deterministic_cublas,
    save_checkpoint,
    save_final,
    seed_everything,
    visited,
)
from pipeline_lib.train.sft import train_sft


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


def test_make_optimizer_is_fused_adamw_with_per_group_lr():
    """The fused kernel on CPU, each param group at its own lr, and the step torch's reference AdamW takes."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))
    ref_a, ref_b = nn.Parameter(a.detach().clone()), nn.Parameter(b.detach().clone())
    start = a.detach().clone()
    optimizer = make_optimizer([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.01}], lr=0.5, weight_decay=0.1)
    reference = torch.optim.AdamW([{"params": [ref_a], "lr": 0.1}, {"params": [ref_b], "lr": 0.01}],
                                  lr=0.5, weight_decay=0.1, fused=False, foreach=False)
    assert optimizer.defaults["fused"] is True
    assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.01]
    for _ in range(3):
        for opt, (x, y) in ((optimizer, (a, b)), (reference, (ref_a, ref_b))):
            ((x ** 2).sum() + (y ** 3).sum()).backward()
            opt.step()
            opt.zero_grad()
    assert torch.allclose(a, ref_a, atol=1e-6) and torch.allclose(b, ref_b, atol=1e-6)
    assert (a - start).abs().min() > 0.1  # three steps of lr 0.1 moved every entry


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
    ctx = init_distributed("cpu")
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



def test_visited_is_what_the_first_steps_of_batches_yield():
    rng = random.Random(0)
    for _ in range(300):
        n, batch = rng.randrange(1, 40), rng.randrange(1, 8)
        if batch > n:
            continue
        steps, seed = rng.randrange(0, 3 * n), rng.randrange(10)
        stream = batches(n, batch, seed=seed)
        expected = {i for _ in range(steps) for i in next(stream)[1]}
        assert visited(n, batch, seed=seed, steps=steps) == expected, (n, batch, steps, seed)
    assert visited(10 ** 6 + 3, 8, seed=0, steps=10 ** 7) == set(range(10 ** 6 + 3))  # stops once all are seen
    with pytest.raises(AlignflowError, match="batch_size 11 is larger than the training set"):
        visited(10, 11, seed=0, steps=1)

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
    save_checkpoint(tmp_path, step=2, model=model, optimizer=optimizer, scheduler=scheduler, extra={"eval": 0.5},
                    run_key="run")
    expected_next = (torch.rand(2), random.random())
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_DIR]  # temp dirs renamed away

    fresh, fresh_opt, fresh_sched = _trained_state(seed=1)
    torch.manual_seed(99)
    random.seed(99)
    step, extra = load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, run_key="run")
    assert (step, extra) == (2, {"eval": 0.5})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], fresh_opt.state_dict()["state"][0]["exp_avg"])
    assert fresh_sched.last_epoch == scheduler.last_epoch == 2
    restored_next = (torch.rand(2), random.random())
    assert torch.equal(restored_next[0], expected_next[0]) and restored_next[1] == expected_next[1]


def test_checkpoint_survives_a_crash_between_renames(tmp_path, monkeypatch):
    model, optimizer, scheduler = _trained_state()
    save_checkpoint(tmp_path, step=4, model=model, optimizer=optimizer, run_key="run")
    (tmp_path / CHECKPOINT_DIR).rename(tmp_path / f".{CHECKPOINT_DIR}.old")  # old moved aside, new not yet in place
    (tmp_path / f".{CHECKPOINT_DIR}.tmp").mkdir()  # a half-written new one
    fresh, fresh_opt, _ = _trained_state(seed=1)
    assert load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, run_key="run")[0] == 4
    assert torch.equal(fresh.weight, model.weight)
    assert load_checkpoint(tmp_path / "empty", model=fresh, optimizer=fresh_opt, run_key="run") is None

    # the next save must not drop that only good checkpoint before its own is in place
    real_rename = Path.rename

    def crash_on_the_second_rename(self, target):
        if self.name == f".{CHECKPOINT_DIR}.tmp":
            raise OSError("killed")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", crash_on_the_second_rename)
    with pytest.raises(CheckpointWriteError):
        save_checkpoint(tmp_path, step=5, model=model, optimizer=optimizer, run_key="run")
    assert load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, run_key="run")[0] == 4


def _record_sha256(ckpt: Path) -> None:
    """trainer_state.json's digests made to match the files again, as if they had been written so."""
    recorded = json.loads((ckpt / "trainer_state.json").read_text())
    recorded["files"] = {name: hashlib.sha256((ckpt / name).read_bytes()).hexdigest() for name in recorded["files"]}
    (ckpt / "trainer_state.json").write_text(json.dumps(recorded))


def _resume_warnings(out_dir: Path) -> list[str]:
    """The warnings of resuming a fresh model from `out_dir`'s checkpoint, which must exist."""
    fresh, fresh_opt, fresh_sched = _trained_state(seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_checkpoint(out_dir, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, run_key="run")
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(("change", "written_by", "resumed_with"), [
    ("2 processes", "1 process on cpu", "2 processes on cpu"),
    ("written on cuda", "1 process on cuda", "1 process on cpu"),
])
def test_a_resume_under_another_topology_warns_once_from_rank_0(tmp_path, monkeypatch, change, written_by,
                                                                 resumed_with):
    """A single-process checkpoint resumed under torchrun trained on silently to a final ~2e-5 from either
    uninterrupted run's (a CUDA one on CPU too): it still resumes, with one warning naming both topologies."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    model, optimizer, scheduler = _trained_state()
    ckpt = save_checkpoint(tmp_path, step=4, model=model, optimizer=optimizer, scheduler=scheduler, run_key="run")
    trainer_state = json.loads((ckpt / "trainer_state.json").read_text())
    assert (trainer_state["world_size"], trainer_state["device"]) == (1, "cpu")
    if change == "2 processes":
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
    else:  # no GPU needed: the file says what a CUDA run writes
        (ckpt / "trainer_state.json").write_text(json.dumps(trainer_state | {"device": "cuda"}))
    assert _resume_warnings(tmp_path) == [f"resuming {ckpt} (step 4) written by {written_by} with {resumed_with}: "
                                          "training continues, but the final will not equal an uninterrupted "
                                          "run's bit for bit"]


@pytest.mark.parametrize("case", ["same topology", "rank 1 of 2", "older alignflow"])
def test_a_resume_under_the_same_topology_on_another_rank_or_from_an_older_checkpoint_is_silent(
        tmp_path, monkeypatch, case):
    """The warning is rank 0's alone, and a checkpoint of an older alignflow, which records no topology, resumes
    as it did."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    model, optimizer, scheduler = _trained_state()
    ckpt = save_checkpoint(tmp_path, step=4, model=model, optimizer=optimizer, scheduler=scheduler, run_key="run")
    if case == "rank 1 of 2":  # rank 0 warns for every rank
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")
    elif case == "older alignflow":
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": 4, "run_key": "run"}))
        monkeypatch.setenv("WORLD_SIZE", "2")
    assert _resume_warnings(tmp_path) == []


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "base", ["12+34=46", "no answer!"],
                            hidden_size=64, num_heads=2, intermediate_size=128)


def test_checkpoint_and_final_files_reach_the_disk_before_their_rename(tmp_path, tiny_dir, monkeypatch):
    """Every file of the temp dir, and the dir, is fsynced while it still has its temp name; after the rename
    the parent dir is fsynced, so the new name is durable too (the real fsync runs; this records its order)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    model = load_policy(tiny_dir, device="cpu")
    save_checkpoint(tmp_path, step=1, model=model, optimizer=make_optimizer(model.parameters(), lr=0.1), run_key="run")
    tmp, out = str(tmp_path / f".{CHECKPOINT_DIR}.tmp"), str(tmp_path)
    assert {f"{tmp}/state.pt", f"{tmp}/trainer_state.json", f"{tmp}/python_rng.json", tmp} <= set(synced)
    assert synced.index(tmp) > synced.index(f"{tmp}/state.pt") and synced[-1] == out
    synced.clear()
    save_final(model, load_tokenizer(tiny_dir), tmp_path, run_key="run")
    tmp = str(tmp_path / ".final.tmp")
    assert {f"{tmp}/model.safetensors", f"{tmp}/{FINAL_MARKER}", tmp} <= set(synced) and synced[-1] == out


def test_save_final_writes_safetensors_and_drops_the_checkpoint(tmp_path, tiny_dir):
    reward = RewardModel.from_policy(tiny_dir, device="cpu")
    optimizer = make_optimizer(reward.parameters(), lr=0.1)
    save_checkpoint(tmp_path, step=1, model=reward, optimizer=optimizer, run_key="run")
    final = save_final(reward, load_tokenizer(tiny_dir), tmp_path, metrics={"eval/rm_accuracy": 0.9}, run_key="run")
    assert final == tmp_path / "final"
    names = {p.name for p in final.iterdir()}
    assert {"model.safetensors", "reward_head.safetensors", "tokenizer.json", FINAL_MARKER} <= names
    marker = json.loads((final / FINAL_MARKER).read_text())
    assert marker["metrics"] == {"eval/rm_accuracy": 0.9} and marker["run_key"] == "run"
    assert marker["files"] == {name: (final / name).stat().st_size for name in names - {FINAL_MARKER}}
    assert not (tmp_path / CHECKPOINT_DIR).exists() and not (tmp_path / ".final.tmp").exists()
    (final / "stale.txt").write_text("of the earlier final")  # replaced whole (renamed away, then deleted)
    save_final(reward, load_tokenizer(tiny_dir), tmp_path, metrics={"eval/rm_accuracy": 0.9}, run_key="run")
    assert not (final / "stale.txt").exists() and not (tmp_path / ".final.old").exists()
    loaded = RewardModel.from_pretrained(final, device="cpu")
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert math.isclose(float(loaded(ids, torch.ones_like(ids))), float(reward(ids, torch.ones_like(ids))),
                            rel_tol=1e-6)


# ---- failing and corrupted checkpoint writes (issue #8: no corrupt checkpoint, the previous one stays usable)


REAL_TORCH_SAVE = torch.save


def torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    REAL_TORCH_SAVE(obj, buffer)
    return buffer.getvalue()


def full_disk_after_half(serialize: Callable[[object], bytes]):
    """A writer (torch.save, safetensors' save_file) that puts the first half of the real bytes on disk, then
    fails as a full disk does."""

    def write(obj, path, *args, **kwargs):
        data = serialize(obj)
        if hasattr(path, "write"):  # save_checkpoint hands torch.save a file of its own
            path.write(data[: len(data) // 2])
        else:
            Path(path).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    return write


def test_failed_checkpoint_write_keeps_the_previous_one_in_one_line(tmp_path, monkeypatch):
    model, optimizer, scheduler = _trained_state()
    save_checkpoint(tmp_path, step=1, model=model, optimizer=optimizer, scheduler=scheduler, run_key="run")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer.step()  # the state moves on, then its checkpoint fails half-written
    monkeypatch.setattr(torch, "save", full_disk_after_half(torch_bytes))
    with pytest.raises(CheckpointWriteError) as err:
        save_checkpoint(tmp_path, step=2, model=model, optimizer=optimizer, scheduler=scheduler, run_key="run")
    assert str(err.value) == (f"{tmp_path}: cannot write the step 2 checkpoint (OSError: [Errno 28] No space left "
                              "on device); the previous checkpoint is kept")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_DIR]  # the half-written temp dir is gone
    fresh, fresh_opt, fresh_sched = _trained_state(seed=1)
    assert load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, run_key="run")[0] == 1
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())


def _flip_byte(path: Path, at: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["empty state.pt", "half state.pt", "garbage state.pt", "no state.pt",
                                    "bad trainer_state.json", "bad python_rng.json", "no trainer_state.json",
                                    "a flipped byte in state.pt", "a flipped bit in the optimizer state",
                                    "python_rng.json refused by random", "torch RNG state refused by torch",
                                    "RNG states of two ranks in one file, one in the other"])
def test_unreadable_checkpoint_is_skipped_with_a_warning(tmp_path, damage):
    """A checkpoint damaged after its rename (disk corruption, a power cut before the data reached the disk)
    is ignored: the loop starts over, which costs time but gives the same seeded result. Before: a flipped byte
    in state.pt loaded as other weights or optimizer moments (torch's zip reader checks no CRC; trainer_state.json
    now holds each file's sha256), RNG states that parsed but the generators refused raised a traceback after the
    weights were loaded, and a checkpoint without trainer_state.json was dropped without a warning."""
    model, optimizer, _ = _trained_state()
    ckpt = save_checkpoint(tmp_path, step=3, model=model, optimizer=optimizer, run_key="run")
    state = ckpt / "state.pt"
    if damage == "empty state.pt":
        state.write_bytes(b"")
    elif damage == "half state.pt":
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    elif damage == "garbage state.pt":
        state.write_bytes(b"not a checkpoint at all" * 10)
    elif damage == "no state.pt":
        state.unlink()
    elif damage == "no trainer_state.json":
        (ckpt / "trainer_state.json").unlink()
    elif damage == "a flipped byte in state.pt":
        _flip_byte(state, 0.2)
    elif damage == "a flipped bit in the optimizer state":
        _flip_byte(state, 0.5)
    elif damage == "python_rng.json refused by random":
        (ckpt / "python_rng.json").write_text("[[3, [1, 2, 3], null]]")
        _record_sha256(ckpt)  # parses, and matches its digest: random.setstate still refuses it
    elif damage == "torch RNG state refused by torch":
        saved = torch.load(state, weights_only=True)
        torch.save(saved | {"rng": [{"torch": saved["rng"][0]["torch"].float(), "cuda": []}]}, state)
        _record_sha256(ckpt)
    elif damage == "RNG states of two ranks in one file, one in the other":
        saved = torch.load(state, weights_only=True)
        torch.save(saved | {"rng": saved["rng"] * 2}, state)
        _record_sha256(ckpt)
    else:
        (ckpt / damage.split()[1]).write_text('{"step": ')
    fresh, fresh_opt, _ = _trained_state(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.warns(RuntimeWarning, match=rf"checkpoint {ckpt} is unreadable \(\w+: .*\); ignoring it"):
        assert load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, run_key="run") is None
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # nothing half-applied

    # the previous checkpoint, still aside after a crash between save_checkpoint's renames, is used instead
    older, older_opt, _ = _trained_state(seed=2)
    save_checkpoint(tmp_path / "aside", step=2, model=older, optimizer=older_opt, run_key="run")
    (tmp_path / "aside" / CHECKPOINT_DIR).rename(tmp_path / f".{CHECKPOINT_DIR}.old")
    with pytest.warns(RuntimeWarning, match="is unreadable"):
        assert load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, run_key="run")[0] == 2
    assert torch.equal(fresh.weight, older.weight)


def test_a_final_whose_metrics_hold_nan_is_finished_and_whole(tmp_path, tiny_dir):
    """The marker is written by json (NaN allowed); reading it with orjson refused it, so a finished stage trained
    again on every rerun and its cached dir counted as incomplete."""
    final = save_final(load_policy(tiny_dir, device="cpu"), load_tokenizer(tiny_dir), tmp_path,
                       metrics={"eval/loss": float("nan")}, run_key="run")
    logged = []
    assert finished_final(tmp_path, lambda metrics, step: logged.append(metrics), 1, "run") == final
    assert math.isnan(logged[0]["eval/loss"]) and model_dir_complete(final)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device that is always full)")
def test_a_checkpoint_written_to_a_full_device_says_no_space_left(tmp_path, monkeypatch):
    """The real torch.save on a real full device (/dev/full: every write fails with ENOSPC): the error says so, not
    torch's `unexpected pos 576 vs 534`."""
    import pipeline_lib.train.common as common

    def full_device_for_the_state(path, mode="r", *args, **kwargs):
        return open("/dev/full" if Path(path).name == "state.pt" and "w" in mode else path, mode, *args, **kwargs)

    model, optimizer, scheduler = _trained_state()
    monkeypatch.setattr(common, "open", full_device_for_the_state, raising=False)
    with pytest.raises(CheckpointWriteError) as err:
        save_checkpoint(tmp_path, step=1, model=model, optimizer=optimizer, scheduler=scheduler, run_key="run")
    assert str(err.value) == (f"{tmp_path}: cannot write the step 1 checkpoint (OSError: [Errno 28] No space left "
                              "on device); the previous checkpoint is kept")
    assert list(tmp_path.iterdir()) == []


def test_failed_final_write_leaves_no_final_dir_and_keeps_the_checkpoint(tmp_path, tiny_dir, monkeypatch):
    import transformers.modeling_utils

    policy = load_policy(tiny_dir, device="cpu")
    optimizer = make_optimizer(policy.parameters(), lr=0.1)
    save_checkpoint(tmp_path, step=5, model=policy, optimizer=optimizer, run_key="run")
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk_after_half(safetensors_bytes))
    with pytest.raises(CheckpointWriteError) as err:
        save_final(policy, load_tokenizer(tiny_dir), tmp_path, run_key="run")
    assert str(err.value) == (f"{tmp_path / 'final'}: cannot write the final model (OSError: [Errno 28] No space "
                              "left on device); the last checkpoint is kept, rerun the stage to resume")
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_DIR]  # no final, no half-written temp dir
    monkeypatch.undo()
    assert load_checkpoint(tmp_path, model=policy, optimizer=optimizer, run_key="run")[0] == 5
    final = save_final(policy, load_tokenizer(tiny_dir), tmp_path, run_key="run")  # the rerun's save succeeds
    assert torch.equal(load_policy(final, device="cpu").lm_head.weight, policy.lm_head.weight)


def sft_run(tiny_dir: Path, out_dir: Path, log: LogFn = no_log, **overrides) -> Path:
    rows = pl.DataFrame({"prompt": [f"{a}+{a}=" for a in range(16)], "completion": [str(2 * a) for a in range(16)]})
    cfg = SFTConfig(**{"model_path": str(tiny_dir), "max_steps": 6, "batch_size": 4, "save_every": 2, "lr": 1e-3,
                       "device": "cpu", **overrides})
    return train_sft(cfg, rows, out_dir, log)


def same_weights(final_a: Path, final_b: Path) -> bool:
    a, b = load_file(str(final_a / "model.safetensors")), load_file(str(final_b / "model.safetensors"))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("failing", ["checkpoint", "final"])
def test_sft_stage_with_a_failing_write_reruns_to_the_uninterrupted_weights(one_thread, tiny_dir, tmp_path,
                                                                           monkeypatch, failing):
    """The step-4 checkpoint (or the final model) fails half-written: the stage stops with the one-line error,
    no `final` exists, and the rerun resumes from the step-2 checkpoint to the uninterrupted run's weights."""
    import transformers.modeling_utils

    uninterrupted = sft_run(tiny_dir, tmp_path / "full")
    if failing == "checkpoint":
        calls = []

        def second_save_fails(obj, path, *args, **kwargs):
            calls.append(path)
            if len(calls) == 2:
                return full_disk_after_half(torch_bytes)(obj, path)
            return REAL_TORCH_SAVE(obj, path, *args, **kwargs)

        monkeypatch.setattr(torch, "save", second_save_fails)
    else:
        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk_after_half(safetensors_bytes))
    with pytest.raises(CheckpointWriteError, match="the (previous|last) checkpoint is kept"):
        sft_run(tiny_dir, tmp_path / "failed")
    monkeypatch.undo()
    assert not (tmp_path / "failed" / "final").exists()
    expected_step = 2 if failing == "checkpoint" else 4
    assert json.loads((tmp_path / "failed" / CHECKPOINT_DIR / "trainer_state.json").read_text())["step"] == \
        expected_step
    assert same_weights(uninterrupted, sft_run(tiny_dir, tmp_path / "failed"))


# ---- a stage dir holds only its own run's checkpoint and final model (run_key: config + models + data)


def test_a_checkpoint_or_final_of_another_run_is_a_one_line_error(one_thread, tiny_dir, tmp_path):
    """The run-file entry point and the library take any out_dir: a checkpoint left by another config resumed
    silently (neither run's result), and its final was returned as this run's."""
    out = tmp_path / "out"
    sft_run(tiny_dir, out)
    with pytest.raises(OtherRunError) as err:
        sft_run(tiny_dir, out, seed=1)
    assert str(err.value) == (f"{out / 'final'} was written by another run (its config, models or data differ from "
                              "this one's); delete it or pass another out_dir")
    (out / "final").rename(tmp_path / "aside")
    model = load_policy(tiny_dir, device="cpu")
    save_checkpoint(out, step=4, model=model, optimizer=make_optimizer(model.parameters(), lr=1e-3), run_key="other")
    with pytest.raises(OtherRunError, match=f"^{out / CHECKPOINT_DIR} was written by another run"):
        sft_run(tiny_dir, out)
    assert not (out / "final").exists()


def test_a_checkpoint_that_does_not_fit_the_model_is_a_one_line_error(tiny_dir, tmp_path):
    other = build_tiny_model(tmp_path / "other", ["12+34=46"], hidden_size=64, num_heads=2, intermediate_size=128)
    small = load_policy(other, device="cpu")
    save_checkpoint(tmp_path, step=2, model=small, optimizer=make_optimizer(small.parameters(), lr=0.1), run_key="k")
    model = load_policy(tiny_dir, device="cpu")
    with pytest.raises(OtherRunError, match=r"does not fit this model \(RuntimeError: Error\(s\) in loading state_dict for "
                                            r"LlamaForCausalLM: size mismatch for ") as err:
        load_checkpoint(tmp_path, model=model, optimizer=make_optimizer(model.parameters(), lr=0.1), run_key="k")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("damage", ["cut weights", "weights gone", "marker only, old format", "marker unreadable"])
def test_an_incomplete_final_is_trained_again(one_thread, tiny_dir, tmp_path, damage):
    """A final dir with its marker but missing or cut files (a partial copy) counted as finished."""
    uninterrupted = sft_run(tiny_dir, tmp_path / "full")
    out = tmp_path / "out"
    final = sft_run(tiny_dir, out)
    weights = final / "model.safetensors"
    if damage == "cut weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "weights gone":
        weights.unlink()
    elif damage == "marker unreadable":
        (final / FINAL_MARKER).write_text('{"metrics": ')
    else:
        for file in final.iterdir():
            if file.name != FINAL_MARKER:
                file.unlink()
        (final / FINAL_MARKER).write_text(json.dumps({"metrics": {}}))
    with pytest.warns(RuntimeWarning, match="training again"):
        rerun = sft_run(tiny_dir, out)
    assert same_weights(uninterrupted, rerun)


def test_a_checkpoint_without_a_run_key_resumes_with_a_warning(tiny_dir, tmp_path):
    """Checkpoints written before run keys were recorded still resume (an upgrade does not lose a run)."""
    model = load_policy(tiny_dir, device="cpu")
    optimizer = make_optimizer(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path, step=3, model=model, optimizer=optimizer, run_key="k")
    state = tmp_path / CHECKPOINT_DIR / "trainer_state.json"
    state.write_text(json.dumps({"step": 3}))
    with pytest.warns(RuntimeWarning, match="records no run key"):
        assert load_checkpoint(tmp_path, model=model, optimizer=optimizer, run_key="new")[0] == 3


# ---- deterministic kernels (`deterministic: true`): process-global torch settings, on only inside a stage


def determinism_settings() -> tuple[bool, bool, bool, bool]:
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)


@pytest.fixture
def global_determinism():
    """torch's process-global determinism settings (and CUBLAS_WORKSPACE_CONFIG) as before the test, restored at
    its end however it ends: a test failing inside a deterministic block must not leave the next ones in it."""
    before = determinism_settings()
    workspace = os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    yield before
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    if workspace is not None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


def test_deterministic_kernels_are_on_inside_the_block_only(global_determinism):
    """What transformers' enable_full_determinism sets for torch, then the settings before it, also after an error;
    disabled, the block leaves the caller's settings alone (here a caller's own warn-only mode)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = True
    caller = determinism_settings()
    with deterministic_kernels(False):
        assert determinism_settings() == caller
    with pytest.raises(NonFiniteLossError), deterministic_kernels(True):
        assert determinism_settings() == (True, False, True, False)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        check_finite(torch.tensor(float("nan")), step=1)
    assert determinism_settings() == caller
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"  # the user's own (also deterministic) value is kept
    with deterministic_kernels(True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_deterministic_kernels_in_a_process_that_used_cuda_without_the_cublas_setting_is_one_line(
        global_determinism, monkeypatch):
    """cuBLAS reads CUBLAS_WORKSPACE_CONFIG at the process's first matmul: set later (a pipeline's deterministic stage
    after one that trained on CUDA), torch raised at the stage's first matmul. Now one ConfigError says what to do;
    a pipeline sets it before its first stage (`reserve_deterministic_cublas`). CUDA's state is simulated."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"^deterministic: true in a process that used CUDA before without "
                                          r"CUBLAS_WORKSPACE_CONFIG .* export CUBLAS_WORKSPACE_CONFIG=:4096:8 before"):
        with deterministic_kernels(True, "cuda"):
            pytest.fail("entered")
    assert determinism_settings() == global_determinism  # nothing switched on
    with deterministic_kernels(True, "cpu"):  # a CPU stage makes no cuBLAS call
        assert torch.are_deterministic_algorithms_enabled()
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG")
    reserve_deterministic_cublas()
    with deterministic_kernels(True):
        assert torch.are_deterministic_algorithms_enabled()


def test_sft_with_deterministic_kernels_trains_to_the_same_weights_on_cpu(one_thread, tiny_dir, tmp_path,
                                                                          global_determinism):
    """CPU kernels are deterministic already: the mode changes no weight. It is on for the stage's steps only."""
    during: list[bool] = []
    plain = sft_run(tiny_dir, tmp_path / "plain")
    deterministic = sft_run(tiny_dir, tmp_path / "deterministic", deterministic=True,
                            log=lambda metrics, step: during.append(torch.are_deterministic_algorithms_enabled()))
    assert during and all(during)
    assert determinism_settings() == global_determinism
    assert same_weights(plain, deterministic)


@pytest.mark.gpu
def test_two_deterministic_sft_runs_on_cuda_give_the_same_weights(tiny_dir, tmp_path, global_determinism):
    """On CUDA, seeding alone leaves the kernels free to sum in any order; with deterministic kernels two
    uninterrupted runs of one config end bit for bit equal."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # as conftest set it before this process's first matmul
    first = sft_run(tiny_dir, tmp_path / "first", device="cuda", deterministic=True)
    second = sft_run(tiny_dir, tmp_path / "second", device="cuda", deterministic=True)
    assert same_weights(first, second)


def test_packing_saves_where_the_shared_prefix_outweighs_the_attention_over_the_packed_row():
    tiny = transformers.LlamaConfig(hidden_size=64, intermediate_size=128)
    large = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008)
    # a 90-token prefix shared by two 10-token answers: 110 columns instead of 2 x 100; and a 100-token prefix with
    # two 300-token texts: 700 columns, whose attention costs a small model more than the 100 tokens it saves
    assert packing_saves(tiny, [[100, 100], [400, 400]], [110, 700]) == [True, False]
    # on a 4096-wide model the projections and MLP dominate: packing saves; sharing nothing, never
    assert packing_saves(large, [[400, 400], [5, 7, 9]], [700, 21]) == [True, False]
    # GPT-2's config names no intermediate_size (n_inner None: 4 x hidden)
    assert packing_saves(transformers.GPT2Config(n_embd=64), [[100, 100], [12, 30]], [110, 41]) == [True, False]
    # a multimodal model's config holds its text model's sizes in a sub-config
    gemma3 = transformers.Gemma3Config(text_config={"hidden_size": 64, "intermediate_size": 128})
    assert not hasattr(gemma3, "hidden_size")
    assert packing_saves(gemma3, [[100, 100], [400, 400]], [110, 700]) == [True, False]
