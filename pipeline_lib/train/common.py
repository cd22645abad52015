"""What every training loop shares: seeding, deterministic kernels, device/dtype, which groups run packed (DPO's
pairs, a reward model's pairs and rankings), optimizer and schedule, DDP, seeded data order, atomic checkpoint
save/resume, the NaN guard and the final atomic model save.

Loops stay explicit, one per algorithm; these helpers only remove copies of the same plumbing."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import pickle
import random
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from pipeline_lib.config import ConfigError
from pipeline_lib.errors import AlignflowError, one_line
from pipeline_lib.logfns import LogFn
from pipeline_lib.model_dirs import FINAL_MARKER, missing_files, read_marker
from pipeline_lib.models.loading import resolve_device
from pipeline_lib.models.logprobs import packs_pairs

CHECKPOINT_DIR = "checkpoint"
CHECKPOINT_FILES = ("state.pt", "python_rng.json")  # their sha256 is in trainer_state.json, written last


class NonFiniteLossError(AlignflowError):
    """Loss became NaN/inf: the stage stops without writing a final model."""


class CheckpointWriteError(AlignflowError):
    """A checkpoint or the final model could not be written (disk full, read-only dir); the previous one is kept."""


class OtherRunError(AlignflowError):
    """The stage dir holds a checkpoint or final model of another run (config, models or data differ)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# what torch's deterministic mode needs of cuBLAS, read at the process's first cuBLAS call
DETERMINISTIC_CUBLAS = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def reserve_deterministic_cublas() -> None:
    """Before a process's first CUDA matmul, where a later stage in it trains with `deterministic` (an in-process
    pipeline): cuBLAS reads its workspace setting once. The user's own value wins."""
    for key, value in DETERMINISTIC_CUBLAS.items():
        os.environ.setdefault(key, value)


@contextmanager
def deterministic_kernels(enabled: bool, device: str = "auto") -> Iterator[None]:
    """With `enabled`, torch's deterministic kernels inside the block, what transformers' `enable_full_determinism`
    sets for torch; the process-global settings before it are restored at its end (the stages of an in-process
    pipeline each get their own config's mode). CPU training is deterministic without it.

    cuBLAS reads CUBLAS_WORKSPACE_CONFIG once, at its first call: the loops enter this block before they load a
    model (`with_deterministic_kernels`), and a pipeline sets it before its first stage
    (`reserve_deterministic_cublas`); a stage on CUDA (`device`) in a process that used CUDA without it gets a
    one-line ConfigError here, not torch's error at the first matmul. torch raises on an op that has no deterministic
    kernel."""
    if not enabled:
        yield
        return
    unset = [key for key in DETERMINISTIC_CUBLAS if key not in os.environ]
    if unset and torch.cuda.is_initialized() and resolve_device(device).type == "cuda":
        raise ConfigError(f"deterministic: true in a process that used CUDA before without {unset[0]} (cuBLAS reads "
                          "it once, at its first call): run the stage in a process of its own, or export "
                          f"{unset[0]}={DETERMINISTIC_CUBLAS[unset[0]]} before starting")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    reserve_deterministic_cublas()  # torch refuses cuBLAS calls without it
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def with_deterministic_kernels(train: Callable[..., Path]) -> Callable[..., Path]:
    """The training loop `train(cfg, ...)` run inside `deterministic_kernels(cfg.deterministic, cfg.device)`: on
    before it loads any model, the settings before it back when it returns or raises."""

    @functools.wraps(train)
    def run(cfg, *args, **kwargs) -> Path:
        with deterministic_kernels(cfg.deterministic, cfg.device):
            return train(cfg, *args, **kwargs)

    return run


def autocast(device: torch.device):
    """bf16 autocast on CUDA; nothing on CPU (tiny fp32 models are faster without it)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def packing_costs(config: PretrainedConfig) -> Callable[[Sequence[int], int], tuple[float, float]]:
    """`costs(rows, width)`: multiply-adds per layer of texts of `rows` tokens each run as its own row, and packed
    into one row of `width` columns, for a model of `config`. A row of L tokens costs about L (4h^2 + 3hi) in its
    projections and MLP (h `hidden_size`, i `intermediate_size` of the text model) and 2 L^2 h in its attention scores
    and sums, of which a causal kernel computes about half; a packed row's explicit mask has them all computed, masked
    or not. So where the shared prefix is short next to the texts (long answers; texts cut from the left differently),
    the packed row's attention costs more than the prefix saves. A config without a hidden size: packing costs
    infinitely much."""
    text = config.get_text_config()
    hidden = getattr(text, "hidden_size", None)
    if not hidden:
        return lambda rows, width: (0.0, math.inf)
    inner = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    per_token = 4 * hidden ** 2 + 3 * hidden * inner

    def costs(rows: Sequence[int], width: int) -> tuple[float, float]:
        return (sum(length * per_token + length ** 2 * hidden for length in rows),
                width * per_token + 2 * width ** 2 * hidden)

    return costs


def packing_saves(config: PretrainedConfig, rows: Sequence[Sequence[int]], widths: Sequence[int]) -> list[bool]:
    """For each group of `rows` (token counts of its rows): whether packing it into one row of `widths[g]` columns
    costs fewer multiply-adds (`packing_costs`)."""
    costs = packing_costs(config)
    return [packed < unpacked for unpacked, packed in (costs(group, width) for group, width in zip(rows, widths))]


def choose_packed(model: nn.Module, inner: PreTrainedModel, rows: Sequence[Sequence[int]], widths: Sequence[int],
                  values: Callable[[list[int], bool], Tensor], *, unit: str, fallback: str, ctx: Dist | None = None,
                  checked: int = 8) -> frozenset[int]:
    """The groups (DPO's pairs, a reward model's pairs or rankings) that run packed: those where packing saves compute
    (`packing_saves`) and whose packed row `packs_pairs` allows `inner` (the transformers model in `model`: a window
    or a position limit narrower than a row keeps that group's rows), provided `packed_values_hold` on every rank of
    `ctx`; none otherwise. A model in train mode (dropout on) keeps the rows, without a check: packed, a group's texts
    would share one dropout draw over their shared prefix."""
    fits = functools.cache(functools.partial(packs_pairs, inner))  # of a width
    saving = [g for g, saves in enumerate(packing_saves(inner.config, rows, widths)) if saves and fits(widths[g])]
    holds = not model.training and bool(saving) and packed_values_hold(inner, saving, widths, values, unit=unit,
                                                                       fallback=fallback, checked=checked)
    # the same on every rank (the set is the data's; the check could differ), so the ranks read one reference file
    return frozenset(saving) if (ctx or Dist()).all_true(holds, inner.device) else frozenset()


def packed_values_hold(inner: PreTrainedModel, saving: Sequence[int], widths: Sequence[int],
                       values: Callable[[list[int], bool], Tensor], *, unit: str, fallback: str,
                       checked: int = 8) -> bool:
    """Whether on the `checked` widest of the `saving` groups `values(groups, True)` (packed) are `values(groups,
    False)` (rows) within the rounding of `inner`'s dtype: fp32's 1e-4 + 1e-5 relative (run without autocast, so the
    check is of the layout, not of bf16 autocast's rounding); for weights held in half precision (a reward model
    scoring in bf16), 4 eps of that dtype, absolute and relative (a correct layout measured within 1.5 eps; MPT's
    ALiBi off by ~0.7 of the scores; a layout error below 4 eps goes unseen). A transformers model whose forward
    ignores the 4D mask or the position ids (ALiBi's biases, encoder-decoder heads), or refuses the packed row, keeps
    the rows, with a note saying `fallback`: it would otherwise train on or score with wrong values, silently."""
    widest = sorted(saving, key=lambda g: -widths[g])[:checked]
    tolerance = 4 * torch.finfo(inner.dtype).eps if torch.finfo(inner.dtype).bits < 32 else None
    name = type(inner).__name__
    with torch.no_grad():
        unpacked = values(widest, False).cpu()
        try:
            packed = values(widest, True).cpu()
        except Exception as exc:  # noqa: BLE001 - whatever a forward raises on a packed row, the rows ran
            print(f"note: {name}'s forward refuses packed rows ({one_line(exc)}): {fallback}", file=sys.stderr,
                  flush=True)
            return False
    if torch.allclose(packed, unpacked, atol=tolerance or 1e-4, rtol=tolerance or 1e-5):
        return True
    print(f"note: {name}'s packed rows do not give the rows' values (max difference "
          f"{float((packed - unpacked).abs().max()):.3g} on the {len(widest)} widest {unit}): {fallback}",
          file=sys.stderr, flush=True)
    return False


def make_optimizer(params, *, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999)) -> torch.optim.Optimizer:
    """AdamW over the trainable tensors of `params` (tensors, or param-group dicts that may set their own lr).

    The fused kernel (one op for every tensor, HF Trainer's default `adamw_torch_fused`) runs on CPU and CUDA;
    without it, torch's CPU AdamW loops over the tensors one op at a time."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    groups = [{**group, "params": [p for p in group["params"] if p.requires_grad]} for group in groups]
    tensors = [p for group in groups for p in group["params"]]
    fused = bool(tensors) and all(p.device.type in ("cpu", "cuda") for p in tensors)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)


def make_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, kind: str = "cosine"
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then `constant`, `linear` decay to 0 or `cosine` decay to 10%."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if kind == "constant":
            return 1.0
        if kind == "linear":
            return 1.0 - progress
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def check_finite(loss: Tensor | float, step: int, name: str = "train/loss") -> None:
    """The NaN guard: one-line error naming the step, counted from 1 as the metrics are logged. Each loop checks
    its loss, and its gradient norm before the update: a finite loss can still have inf/NaN gradients, which would
    step every weight to NaN (in the last step, unseen by any later loss, into the final model)."""
    value = torch.as_tensor(loss)
    if not torch.isfinite(value).all():
        raise NonFiniteLossError(f"{name} is {value.item()} at step {step}; stopping, no final model written")


def clip_gradients(model: nn.Module, max_norm: float | None) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm is None:
        return float(torch.norm(torch.stack([p.grad.detach().norm() for p in params])))
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


# ---- distributed (torchrun); a single process is world_size 1


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def shard(self, indices: list[int]) -> list[int]:
        """This rank's slice of a global batch (every rank sees a disjoint, equal-sized part)."""
        return indices[self.rank :: self.world_size]

    def all_reduce_mean(self, value: Tensor) -> Tensor:
        if not self.enabled:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world_size

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_true(self, flag: bool, device: torch.device) -> bool:
        """Whether `flag` holds on every rank (a choice every rank must make alike)."""
        return bool(self.all_reduce_mean(torch.tensor(float(flag), device=device)) == 1.0)


def check_batch_split(ctx: Dist, batch_size: int, grad_accum_steps: int) -> None:
    """The global batch splits evenly over ranks and micro-batches, else one ConfigError line (every rank)."""
    if batch_size % (ctx.world_size * grad_accum_steps):
        raise ConfigError(f"batch_size {batch_size}: expected a multiple of world size {ctx.world_size} x "
                          f"grad_accum_steps {grad_accum_steps}")


def mean_over_ranks(ctx: Dist, values: dict[str, Tensor]) -> dict[str, float]:
    """Scalar stats averaged over ranks with one all-reduce (every rank gets the same numbers)."""
    keys = sorted(values)
    stacked = torch.stack([values[k].detach().float().reshape(()) for k in keys])
    return dict(zip(keys, ctx.all_reduce_mean(stacked).tolist()))


def torchrun_world_size() -> int:
    """The number of processes torchrun started (its WORLD_SIZE); 1 for a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# how long a rank waits in a collective for the others: rank 0 alone computes DPO's reference log-probs and writes
# checkpoints between two of them, longer on a large dataset than torch's default of 10 minutes for NCCL
COLLECTIVE_TIMEOUT = timedelta(hours=2)


def init_distributed(device: str) -> Dist:
    """Join the torchrun process group when launched under torchrun: NCCL, each rank on the GPU of its local rank,
    where the stage's `device` resolves to CUDA; gloo where it is the CPU (`device: cpu` on a GPU machine too)."""
    world_size = torchrun_world_size()
    if world_size == 1:
        return Dist()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_cuda = resolve_device(device).type == "cuda"
    if on_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if on_cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return Dist(rank=dist.get_rank(), world_size=world_size, local_rank=local_rank)


def wrap_model(model: nn.Module, ctx: Dist) -> nn.Module:
    """DDP under torchrun; the model itself otherwise.

    broadcast_buffers=False: with it every forward is a collective, and the loops run a different number of
    forwards per rank (one per length bucket), which deadlocks; the buffers (rotary tables) never change."""
    if not ctx.enabled:
        return model
    device = next(model.parameters()).device
    device_ids = [device] if device.type == "cuda" else None  # a CPU module on a GPU machine takes none
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def check_in_sync(model: nn.Module, ctx: Dist) -> None:
    """Raise if the ranks' parameters differ: DDP keeps them bit-identical, so any gap is a bug, not noise."""
    if not ctx.enabled:
        return
    params = [p.detach().double() for p in unwrap(model).parameters()]
    checksum = torch.stack([sum(p.sum() for p in params), sum(p.abs().sum() for p in params)])
    gathered = [torch.zeros_like(checksum) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, checksum)
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        sums = ", ".join(f"rank {r}: {float(g[0]):.17g}" for r, g in enumerate(gathered))
        raise AlignflowError(f"ranks out of sync after training (parameter sums {sums})")


# ---- seeded data order


def epoch_order(n_items: int, *, seed: int, epoch: int) -> list[int]:
    """The permutation of an epoch: a pure function of (seed, epoch), so a resumed run replays it."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n_items, generator=generator).tolist()


def steps_per_epoch(n_items: int, batch_size: int) -> int:
    """Full batches in an epoch (the tail is dropped); a batch larger than the set is one line."""
    per_epoch = n_items // batch_size
    if per_epoch == 0:
        raise AlignflowError(f"batch_size {batch_size} is larger than the training set ({n_items} rows): lower "
                             "batch_size or add data")
    return per_epoch


def batches(n_items: int, batch_size: int, *, seed: int, start_step: int = 0) -> Iterator[tuple[int, list[int]]]:
    """Endless (step, indices) over seeded epochs, starting at `start_step` (the resume point).

    Incomplete tail batches are dropped so every step has the same size."""
    per_epoch = steps_per_epoch(n_items, batch_size)
    step = start_step
    while True:
        epoch, offset = divmod(step, per_epoch)
        order = epoch_order(n_items, seed=seed, epoch=epoch)
        yield step, order[offset * batch_size : (offset + 1) * batch_size]
        step += 1


def visited(n_items: int, batch_size: int, *, seed: int, steps: int) -> set[int]:
    """The indices `batches` yields in its first `steps` steps: what a run of `steps` steps trains on (every one
    once its epochs have covered them)."""
    per_epoch = steps_per_epoch(n_items, batch_size)
    seen: set[int] = set()
    epoch = 0
    while epoch * per_epoch < steps and len(seen) < n_items:
        in_epoch = min(steps - epoch * per_epoch, per_epoch)
        seen.update(epoch_order(n_items, seed=seed, epoch=epoch)[:in_epoch * batch_size])
        epoch += 1
    return seen


# ---- checkpoints


def _fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then `path` itself: the rename that follows publishes data already on disk,
    so a power cut right after it cannot leave a checkpoint whose files hold unwritten blocks."""
    for file in sorted(path.rglob("*")):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(path)


def replace_durably(tmp: Path, path: Path) -> None:
    """`os.replace(tmp, path)` once tmp's data is on disk, then the rename made durable: a power cut cannot leave
    `path` holding unwritten blocks."""
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    """fsync a directory: makes the renames inside it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _other_run(what: Path, recorded: str | None, run_key: str) -> None:
    """Refuse `what` (a checkpoint or final dir) when its recorded run key is not this run's; one written before
    keys were recorded is accepted with a warning."""
    if recorded is None:
        warnings.warn(f"{what} records no run key (written by an older alignflow); taking it as this run's",
                      RuntimeWarning, stacklevel=3)
    elif recorded != run_key:
        raise OtherRunError(f"{what} was written by another run (its config, models or data differ from this "
                            f"one's); delete it or pass another out_dir")


def _topology(model: nn.Module) -> dict:
    """Where a run trains: torchrun's world size and the device type of the model's parameters."""
    return {"world_size": torchrun_world_size(), "device": next(unwrap(model).parameters()).device.type}


def _describe(topology: dict) -> str:
    """`2 processes on cuda`: a topology as the resume warning names it."""
    processes = topology["world_size"]
    return f"{processes} process{'es' if processes != 1 else ''} on {topology['device']}"


def _write_failure(exc: BaseException) -> str:
    """A failed write in one line: the OSError under torch's RuntimeError where there is one ("No space left on
    device" rather than "unexpected pos 576 vs 534")."""
    cause = exc.__context__
    return one_line(cause if isinstance(exc, RuntimeError) and isinstance(cause, OSError) else exc)


def _rng_states(ctx: Dist) -> list[dict]:
    """Every rank's RNG states (torch, CUDA, Python), by rank: under torchrun each rank draws its own numbers (dropout
    on rows of other lengths), so a resume restores each rank's own. A collective: every rank calls it."""
    version, internal, gauss = random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    mine = {"torch": torch.get_rng_state(), "cuda": cuda, "python": [version, list(internal), gauss]}
    if not ctx.enabled:
        return [mine]
    states: list = [None] * ctx.world_size
    dist.all_gather_object(states, mine)
    return states


def save_checkpoint(out_dir: Path, *, step: int, model: nn.Module, optimizer, scheduler=None,
                    extra: dict | None = None, run_key: str, ctx: Dist = Dist()) -> Path:
    """Write model, optimizer, scheduler, every rank's RNG states and the step to `out_dir/checkpoint` atomically,
    with `run_key` (`train.data.run_key`: config + models + data), so only the same run resumes from it, and the
    world size and device type it trains on (`_topology`), so a resume elsewhere says it will not be bit-exact.
    Every rank calls it (the RNG states are gathered); rank 0 writes.

    The checkpoint is written to a temp dir, fsynced and renamed over the previous one: a crash (or power cut)
    mid-write leaves the previous checkpoint intact, and a failed write (disk full) is a one-line
    CheckpointWriteError. trainer_state.json records the sha256 of the other files (torch's zip reader checks no
    CRC: a flipped byte in state.pt loaded as other weights)."""
    final = out_dir / CHECKPOINT_DIR
    tmp = out_dir / f".{CHECKPOINT_DIR}.tmp"
    old = out_dir / f".{CHECKPOINT_DIR}.old"
    rng = _rng_states(ctx)
    if not ctx.is_main:
        return final
    state = {
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": [{"torch": ranks["torch"], "cuda": ranks["cuda"]} for ranks in rng],  # by rank
        "extra": extra or {},
    }
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # to a file object of ours: given a path, torch.save reports a full disk as "unexpected pos ..." alone; through
        # a Python file its RuntimeError keeps the OSError (ENOSPC) it came from, which `_write_failure` reports
        with open(tmp / "state.pt", "wb") as file:
            torch.save(state, file)
        (tmp / "python_rng.json").write_text(json.dumps([ranks["python"] for ranks in rng]))
        files = {name: _sha256(tmp / name) for name in CHECKPOINT_FILES}
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "run_key": run_key, "files": files,
                                                            **_topology(model)}))
        _fsync_tree(tmp)
        if final.exists():  # else `old` may be the only good checkpoint (a crash between the renames): keep it
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(out_dir)
    except (OSError, RuntimeError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"{out_dir}: cannot write the step {step} checkpoint ({_write_failure(exc)}); "
                                   "the previous checkpoint is kept") from exc
    shutil.rmtree(old, ignore_errors=True)
    return final


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _read_checkpoint(ckpt: Path, run_key: str) -> tuple[int, dict, dict, list] | None:
    """(step, trainer_state.json, state, Python RNG states by rank) of a complete checkpoint dir; None when there is
    none or it is unreadable (a file missing, cut or changed since it was written: disk corruption, a power cut after
    the rename; RNG states the generators refuse), with a warning naming it. Another run's is an OtherRunError."""
    if not ckpt.exists():
        return None
    try:
        trainer_state = json.loads((ckpt / "trainer_state.json").read_text())
        step = int(trainer_state["step"])
        _other_run(ckpt, trainer_state.get("run_key"), run_key)
        digests = trainer_state.get("files")  # an older alignflow's checkpoint records none: it resumes unchecked
        changed = [name for name in CHECKPOINT_FILES if digests and _sha256(ckpt / name) != digests.get(name)]
        if changed:
            raise ValueError(f"{', '.join(changed)} changed since it was written")
        python_rng = json.loads((ckpt / "python_rng.json").read_text())
        # weights_only: our own file, but never unpickle arbitrary objects
        state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
        missing = {"model", "optimizer", "scheduler", "rng", "extra"} - set(state)
        if missing:
            raise KeyError(f"state.pt lacks {sorted(missing)}")
        if not state["rng"] or len(python_rng) != len(state["rng"]):
            raise ValueError(f"RNG states of {len(state['rng'])} rank(s) in state.pt, {len(python_rng)} in "
                             "python_rng.json")
        # states the generators take, tried on throwaway ones: load_checkpoint sets them after the weights
        for (version, internal, gauss), ranks in zip(python_rng, state["rng"]):
            random.Random().setstate((version, tuple(internal), gauss))
            torch.Generator().set_state(ranks["torch"])
    except (OSError, RuntimeError, EOFError, ValueError, KeyError, TypeError, AttributeError,
            pickle.UnpicklingError) as exc:
        warnings.warn(f"checkpoint {ckpt} is unreadable ({one_line(exc)}); ignoring it", RuntimeWarning,
                      stacklevel=3)
        return None
    return step, trainer_state, state, python_rng


def load_checkpoint(out_dir: Path, *, model: nn.Module, optimizer, scheduler=None,
                    run_key: str) -> tuple[int, dict] | None:
    """Restore the latest readable checkpoint in `out_dir` (if any) into model/optimizer/scheduler and the RNGs.

    Returns (step, extra) — the loop continues at `step` — or None for a fresh start. An unreadable checkpoint
    is skipped: training is seeded, so starting over costs time, never a different result. A checkpoint of
    another run (its run key differs) is a one-line OtherRunError: resuming it would train neither run. One
    written under another world size or device type (`_topology`) resumes with a warning from rank 0 (torchrun's
    RANK): the summation order or precision changes, so the final is not an uninterrupted run's; one that records
    neither (an older alignflow's) resumes without."""
    # .old: a crash between the two renames of save_checkpoint left only the previous checkpoint
    for ckpt in (out_dir / CHECKPOINT_DIR, out_dir / f".{CHECKPOINT_DIR}.old"):
        found = _read_checkpoint(ckpt, run_key)
        if found is not None:
            break
    else:
        return None
    step, trainer_state, state, python_rng = found
    try:
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:  # shapes or parameter groups of another model
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = " ".join(lines[:2])  # load_state_dict's first line names no tensor: its second does
        raise OtherRunError(f"{ckpt} does not fit this model ({type(exc).__name__}: {detail[:300]}); delete it or "
                            "pass another out_dir") from None
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    rank = int(os.environ.get("RANK", "0"))
    mine = rank if rank < len(state["rng"]) else 0  # a rank the writing run lacked: rank 0's (a resume elsewhere)
    torch.set_rng_state(state["rng"][mine]["torch"])
    if torch.cuda.is_available():  # only the GPUs this process sees (a run on 8 resumed on 1)
        for index, cuda_state in enumerate(state["rng"][mine]["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)
    version, internal, gauss = python_rng[mine]
    random.setstate((version, tuple(internal), gauss))
    written, current = {key: trainer_state.get(key) for key in ("world_size", "device")}, _topology(model)
    if None not in written.values() and written != current and rank == 0:
        warnings.warn(f"resuming {ckpt} (step {step}) written by {_describe(written)} with {_describe(current)}: "
                      "training continues, but the final will not equal an uninterrupted run's bit for bit",
                      RuntimeWarning, stacklevel=2)
    return step, state["extra"]


def save_final(model: nn.Module, tokenizer, out_dir: Path, *, metrics: dict | None = None, run_key: str) -> Path:
    """Atomically write the final HF-style model dir (safetensors) as `out_dir/final`; drop the checkpoint.

    Its marker file records the metrics, `run_key`, every file's size (`finished_final` checks them) and where it
    trained (`_topology`: world size and device type). A failed write is a one-line CheckpointWriteError that leaves
    no `final` dir and keeps the last checkpoint, so a rerun resumes from it."""
    final = out_dir / "final"
    tmp = out_dir / ".final.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        # no safe_serialization flag: transformers 5 always writes safetensors, and RewardModel.save_pretrained
        # (a plain nn.Module with the same method) does not take it
        unwrap(model).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        sizes = {str(file.relative_to(tmp)): file.stat().st_size for file in sorted(tmp.rglob("*")) if file.is_file()}
        (tmp / FINAL_MARKER).write_text(json.dumps({"metrics": metrics or {}, "run_key": run_key, "files": sizes,
                                                    "topology": _topology(model)}, indent=2))
        _fsync_tree(tmp)
        # an earlier final is renamed away whole, not deleted file by file: another process reading it (a model dir
        # two workspaces share) sees it whole or gone, never half of it (a helper fingerprinted a half-deleted one)
        old = out_dir / ".final.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"{final}: cannot write the final model ({one_line(exc)}); the last "
                                   "checkpoint is kept, rerun the stage to resume") from exc
    shutil.rmtree(out_dir / CHECKPOINT_DIR, ignore_errors=True)
    return final


def final_metrics(final: Path) -> dict[str, float]:
    """The metrics a finished stage stored beside its final model (empty if the dir is not a final model)."""
    marker = Path(final) / FINAL_MARKER
    return json.loads(marker.read_text())["metrics"] if marker.is_file() else {}


def finished_final(out_dir: Path, log: LogFn, step: int, run_key: str) -> Path | None:
    """The final model of a stage dir that finished earlier, else None. Its stored metrics are logged again at
    `step`: the tracking run of a rerun that finds the work done (its cache entry lost) still shows the result.

    A final of another run (its run key differs) is a one-line OtherRunError; one whose files are missing or cut
    (a partial copy) is not finished: a warning, and the stage trains again and replaces it."""
    final = Path(out_dir) / "final"
    if not (final / FINAL_MARKER).is_file():
        return None
    try:
        marker = read_marker(final)
    except (OSError, ValueError) as exc:
        warnings.warn(f"{final}: unreadable {FINAL_MARKER} ({one_line(exc)}); training again", RuntimeWarning,
                      stacklevel=2)
        return None
    _other_run(final, marker.get("run_key"), run_key)
    missing = missing_files(final, marker)
    if missing:
        warnings.warn(f"{final} is incomplete ({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                      "missing or cut); training again", RuntimeWarning, stacklevel=2)
        return None
    log(final_metrics(final), step)
    return final
