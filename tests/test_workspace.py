"""The workspace run lock: a second process gets a one-line error naming the holder, a SIGKILLed holder
blocks nobody, children never inherit it; end to end, a second `alignflow run pipeline` on a busy workspace
fails at once and the first run's store stays whole."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import psutil
import pytest
import yaml

from pipeline_lib.store.db import TABLE_KEYS, TABLES, open_store
from pipeline_lib.workspace import Workspace, WorkspaceError, WorkspaceLockedError, process_alive, workspace_lock

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"


def test_a_second_process_gets_a_one_line_error_naming_the_holder(workspace, lock_holder):
    holder = lock_holder(workspace, "alignflow run pipeline --config demo.yaml")
    try:
        with pytest.raises(WorkspaceLockedError) as err:
            with workspace_lock(workspace, "alignflow run sft"):
                pytest.fail("took a lock another process holds")
        message = str(err.value)
        assert "\n" not in message
        assert message == (f"workspace {workspace.root} is in use by alignflow process {holder.pid} "
                           "(alignflow run pipeline --config demo.yaml); wait for it to finish or pass another "
                           "--workspace")
    finally:
        holder.kill()
        holder.wait()


def test_a_sigkilled_holder_leaves_a_file_that_blocks_nobody(workspace, lock_holder):
    holder = lock_holder(workspace, "victim")
    holder.send_signal(signal.SIGKILL)
    assert holder.wait() == -signal.SIGKILL
    assert workspace.lock_path.read_text() == f"{holder.pid} victim\n"  # the stale file is still there
    with workspace_lock(workspace, "next run"):
        assert workspace.lock_path.read_text() == f"{os.getpid()} next run\n"


def test_reentrant_in_one_process_and_free_after_the_outer_exit(workspace, lock_holder):
    with workspace_lock(workspace, "alignflow run pipeline"):
        with workspace_lock(workspace, "pipeline demo"):  # the pipeline flow inside the CLI command
            pass
        # still held by the outer block after the inner one exits
        probe = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from pathlib import Path
            from pipeline_lib.workspace import Workspace, workspace_lock
            with workspace_lock(Workspace(Path({str(workspace.root)!r})), "probe"):
                pass
        """)], cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert probe.returncode == 1 and f"in use by alignflow process {os.getpid()}" in probe.stderr
    holder = lock_holder(workspace, "after")  # released: another process takes it
    holder.kill()
    holder.wait()


def test_a_child_process_does_not_inherit_the_lock(workspace, lock_holder):
    """A vLLM server or torchrun child started during a run must not keep the workspace locked after it."""
    with workspace_lock(workspace, "parent"):
        # close_fds=False: the child gets every inheritable descriptor; only the lock's O_CLOEXEC keeps it out
        child = subprocess.Popen(["sleep", "60"], close_fds=False)
    try:
        holder = lock_holder(workspace, "next")
        holder.kill()
        holder.wait()
    finally:
        child.kill()
        child.wait()


# ---- end to end: two `alignflow run pipeline` on one workspace


def pipeline_config(path: Path) -> Path:
    """Ingest + tiny base model + 40 SFT steps + sampling: long enough to be caught running, and it writes
    to every table a second run could have corrupted."""
    config = {
        "name": "lock-test",
        "ingest": [{"path": str(DEMO / "problems.jsonl"), "source": "demo"},
                   {"path": str(DEMO / "pairs.jsonl"), "source": "demo"}],
        "base": {"corpus_sources": ["demo"]},
        "sft": {"model_path": "from:base", "source": "demo", "max_steps": 40, "batch_size": 16, "save_every": 10},
        "sample": {"model_path": "from:sft", "problems_source": "demo", "split": "test", "max_problems": 16,
                   "n": 4, "max_new_tokens": 6, "batch_size": 4},
        "eval_models": [],
    }
    path.write_text(yaml.safe_dump(config))
    return path


def check_store_invariants(store_path: Path) -> dict[str, int]:
    """Every table readable, keys unique, and the rows the first run was meant to write all there."""
    with open_store(store_path, read_only=True) as store:
        counts = {table: store.count(table) for table in TABLES}
        for table, key in TABLE_KEYS.items():
            cols = ", ".join(key)
            distinct = store.con.sql(f"SELECT count(*) FROM (SELECT DISTINCT {cols} FROM {table})").fetchall()[0][0]
            assert distinct == counts[table], f"{table}: duplicate keys"
    return counts


@pytest.mark.slow  # a real pipeline subprocess (Prefect start-up, tiny model, SFT, sampling): ~80 s
def test_second_pipeline_run_on_a_busy_workspace_fails_at_once_and_the_store_stays_whole(tmp_path, subprocess_env):
    config = pipeline_config(tmp_path / "pipeline.yaml")
    env = subprocess_env | {"ALIGNFLOW_HOME": str(tmp_path / "ws"), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "flows.cli", "run", "pipeline", "--config", str(config)]
    first_log = tmp_path / "first.log"  # a file, not a pipe: a full pipe would stall the first run
    with first_log.open("w") as log:
        first = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    lock = tmp_path / "ws" / "run.lock"
    deadline = time.monotonic() + 120
    while not (lock.is_file() and lock.read_text().startswith(f"{first.pid} ")) and first.poll() is None:
        assert time.monotonic() < deadline, "the first run never took the lock"
        time.sleep(0.05)
    assert first.poll() is None, "the first run ended before the second could start"

    started = time.monotonic()
    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, first_log.read_text()[-3000:] + "\n----\n" + second.stderr[-3000:]
    assert second.stderr.strip() == (
        f"error: workspace {tmp_path / 'ws'} is in use by alignflow process {first.pid} "
        f"(alignflow run pipeline --config {config}); wait for it to finish or pass another --workspace")
    assert time.monotonic() - started < 30  # refused at once, not after waiting for the store
    assert first.poll() is None, "the refused run disturbed the running one"

    assert first.wait(timeout=600) == 0, first_log.read_text()[-3000:]
    counts = check_store_invariants(tmp_path / "ws" / "store.duckdb")
    assert counts["problems"] == (DEMO / "problems.jsonl").read_text().count("\n")
    assert counts["preference_pairs"] > 0 and counts["samples"] == 16 * 4
    duckdb.connect(str(tmp_path / "ws" / "store.duckdb")).close()  # the lock on the DuckDB file is gone too

    stats = subprocess.run([sys.executable, "-m", "flows.cli", "data", "stats"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert stats.returncode == 0 and "samples" in stats.stdout, stats.stderr  # the workspace is free again


def test_a_zombie_or_a_reused_pid_is_not_the_recorded_process():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = [child.pid, psutil.Process(child.pid).create_time()]
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not reaped yet by its parent
        pass
    assert not process_alive(*identity)
    child.wait()
    me = psutil.Process()
    assert process_alive(me.pid, me.create_time()) and not process_alive(me.pid, me.create_time() - 60)


def test_a_nearly_full_disk_or_a_small_file_size_limit_is_one_line_before_any_database_starts(tmp_path, monkeypatch):
    """Prefect's server could not create its database on either and restarted for 4 minutes: 3,748 lines of
    tracebacks under `ulimit -f 300`. A real limit for a real command; the disk's free space as the OS reports it
    (a full file system cannot be made here)."""
    data = Path(__file__).resolve().parents[1] / "data" / "demo" / "pairs.jsonl"

    def small_limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (300 << 10, resource.RLIM_INFINITY))

    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    result = subprocess.run([sys.executable, "-m", "flows.cli", "-w", str(tmp_path / "ws"), "ingest", str(data)],
                            preexec_fn=small_limit, capture_output=True, text=True, env=env, timeout=120)
    assert (result.returncode, result.stderr) == (2, "error: a file-size limit (ulimit -f) of 300 KiB, under the 64 "
                                                     "MiB the workspace's databases need; raise it (`ulimit -f "
                                                     "unlimited`)\n")
    assert not (tmp_path / "ws" / "prefect" / "prefect.db").exists()
    disk = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk._replace(free=63 << 20))
    with pytest.raises(WorkspaceError) as raised:
        Workspace(tmp_path / "full").create()
    assert str(raised.value) == (f"workspace {tmp_path / 'full'}: 63 MiB free on its disk, under the 64 MiB a "
                                 "command needs for its databases (Prefect's, MLflow's, the store); free some "
                                 "(README: Disk space), or pass another --workspace")
    monkeypatch.undo()
    assert Workspace(tmp_path / "roomy").create().root.is_dir()
