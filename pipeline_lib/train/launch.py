"""Where a training stage (SFT, RM, DPO) runs: in this process, or in `processes` torchrun processes whose rank 0
hands its metrics back to the caller's `log` while it trains."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import polars as pl
import torch
import torch.distributed as dist
import torch.distributed.run as torchrun
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from pipeline_lib.config import REPO_ROOT, DPOConfig, RMConfig, SFTConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.logfns import LogFn
from pipeline_lib.train.data import FINAL_LINE, die_with_parent, write_run_file
from pipeline_lib.workspace import LOOPBACK_INTERFACES

TrainConfig = SFTConfig | RMConfig | DPOConfig
POLL_SECONDS = 0.2  # how often the metrics file is read while torchrun trains
STOP_SECONDS = 30  # how long an interrupted torchrun gets to stop its workers before it is killed
RUN_DIR_PREFIX = ".torchrun-"  # the launch's temp dir in the stage's out_dir
KEPT_LINES = 200  # the end of torchrun's output kept for the error and the final line (its failure report is ~40)
LOOPBACK = "127.0.0.1"


class TrainLaunchError(AlignflowError):
    """A stage that failed under torchrun, in one line: its workers' own `error: ...` line, else the end of what
    torchrun wrote to stderr."""


def stage_processes(cfg: TrainConfig) -> int:
    """The processes `cfg.processes` asks for: `auto` is every visible CUDA GPU when the device may be CUDA
    (`auto`, `cuda`) and more than one is visible, else 1."""
    if cfg.processes != "auto":
        return cfg.processes
    gpus = torch.cuda.device_count()
    return gpus if cfg.device in ("auto", "cuda") and gpus > 1 else 1


def train_stage(train: Callable[..., Path], cfg: TrainConfig, frames: Mapping[str, pl.DataFrame | None],
                out_dir: Path, log: LogFn, **options: str | Path) -> Path:
    """`train(cfg, **frames, out_dir=, log=, **options)` (a frame that is None left out) in this process when
    `stage_processes(cfg)` is 1, else under torchrun (`train_in_processes` of `train`'s module). Returns the final
    model dir."""
    given = {name: frame for name, frame in frames.items() if frame is not None}
    processes = stage_processes(cfg)
    if processes == 1:
        return train(cfg, **given, out_dir=out_dir, log=log, **options)
    return train_in_processes(train.__module__, cfg, given, out_dir, log, processes=processes, **options)


def train_in_processes(module: str, cfg: TrainConfig, frames: Mapping[str, pl.DataFrame], out_dir: Path,
                       log: LogFn, *, processes: int, **options: str | Path) -> Path:
    """`torchrun --standalone --nproc_per_node <processes> -m <module> --config run.json --metrics metrics.jsonl`
    (`run_torchrun`), the run file (config, frames, options) and the metrics file in a temp dir of their own in
    `out_dir` (`.torchrun-*`: a launcher SIGKILLed cannot remove it, and the next launch into `out_dir` does).
    Rank 0's metrics go to `log` as they come, at full precision; the workers' other output passes through to this
    process's. torchrun runs with this process's `pipeline_lib` first on its path (the same code trains), in a
    session of its own (a Ctrl-C reaches this process alone), and dies with this thread (PR_SET_PDEATHSIG; its
    workers die with it); an interrupt here (KeyboardInterrupt, a failing `log`) stops it before it propagates. A
    non-zero exit is a one-line TrainLaunchError. Returns the final model dir that the workers printed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(f"{RUN_DIR_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX, dir=out_dir) as tmp:
        run_file = write_run_file(Path(tmp) / "run.json", cfg, frames, out_dir, **options)
        metrics = Path(tmp) / "metrics.jsonl"
        metrics.touch()
        paths = [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        out_lines: deque[str] = deque(maxlen=KEPT_LINES)
        err_lines: deque[str] = deque(maxlen=KEPT_LINES)
        with subprocess.Popen(
                [sys.executable, "-m", __name__, "--standalone", "--local-addr", LOOPBACK, "--nproc_per_node",
                 str(processes), "-m", module, "--config", str(run_file), "--metrics", str(metrics)],
                env={**LOOPBACK_INTERFACES, **os.environ, "PYTHONPATH": os.pathsep.join(paths)}, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=die_with_parent()) as agent:
            relays = [_relay(agent.stdout, sys.stdout, out_lines), _relay(agent.stderr, sys.stderr, err_lines)]
            try:
                with open(metrics) as handle:
                    _log_while_running(agent, handle, log)
            except BaseException:
                _stop(agent)
                raise
            finally:  # the pipes close when the `with` ends
                for relay in relays:
                    relay.join(timeout=STOP_SECONDS)
    if agent.returncode != 0:
        errors = [line.removeprefix("error: ") for line in err_lines if line.startswith("error: ")]
        tail = " | ".join([line.strip() for line in err_lines if line.strip()][-5:])[-400:]
        raise TrainLaunchError(f"{module} in {processes} torchrun processes failed: "
                               + (errors[0] if errors else f"exit code {agent.returncode}: {tail}"))
    finals = [line.removeprefix(FINAL_LINE) for line in out_lines if line.startswith(FINAL_LINE)]
    if not finals:
        raise TrainLaunchError(f"{module} in {processes} torchrun processes ended without printing its final model")
    return Path(finals[-1])


def _relay(pipe: IO[str], target: IO[str], kept: deque[str]) -> threading.Thread:
    """A thread copying `pipe` to `target` line by line as it comes, keeping the last lines in `kept`. The ranks'
    `FINAL_LINE`s are for the launcher alone: every rank prints one, and a CLI's stdout holds its output dir once."""

    def copy() -> None:
        for line in pipe:
            if not line.startswith(FINAL_LINE):
                target.write(line)
                target.flush()
            kept.append(line.rstrip("\n"))

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def _log_while_running(agent: subprocess.Popen, handle: IO[str], log: LogFn) -> None:
    """Pass each complete `jsonl_log` line of `handle` to `log` until `agent` has ended and its last line is read."""
    pending = ""
    while True:
        running = agent.poll() is None  # before the read: what was written before the exit is read below
        pending += handle.read()
        *lines, pending = pending.split("\n")
        for line in lines:
            record = json.loads(line)
            log(record["metrics"], record["step"])
        if not running:
            return
        time.sleep(POLL_SECONDS)


def _stop(agent: subprocess.Popen) -> None:
    """SIGTERM torchrun (it stops its workers), SIGKILL it after STOP_SECONDS (its workers die with it), reap it."""
    agent.terminate()
    try:
        agent.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()


class LoopbackStore(dist.TCPStore):
    """A TCPStore whose server listens on 127.0.0.1 alone. torchrun's (the rendezvous' and the one its workers meet
    at) listen on every interface, with no bind address to give: unauthenticated key-value stores anyone on the
    network could read and write (a helper did, through eth0). Its server is handed a socket bound to loopback
    instead (`master_listen_fd`); a stage's torchrun runs on one machine (`--standalone`, `--local-addr`)."""

    def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                 *args: object, **kwargs: object):
        if is_master and kwargs.get("master_listen_fd") is None:
            listener = socket.create_server((LOOPBACK, port), backlog=2048)
            host_name, port = LOOPBACK, listener.getsockname()[1]
            kwargs["master_listen_fd"] = listener.detach()  # the store's to close
        super().__init__(host_name, port, world_size, is_master, *args, **kwargs)


def run_torchrun(argv: Sequence[str] | None = None) -> None:
    """torchrun (`torch.distributed.run`) with its stores on loopback (`LoopbackStore`), less the traceback of the
    exception that ends it when a worker failed or a signal stopped it (after it stopped its workers): the workers
    print their own `error: ...` line and torchrun logs each failed rank's exit code, so the traceback of torchrun's
    own code only hid them. Exit 1, or 128 + the signal."""
    dist.TCPStore = c10d_rendezvous_backend.TCPStore = LoopbackStore
    try:
        torchrun.run(torchrun.parse_args(argv))
    except ChildFailedError:
        sys.exit(1)
    except SignalException as exc:
        sys.exit(128 + exc.sigval)


if __name__ == "__main__":
    run_torchrun()
