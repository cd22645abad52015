"""Where a training stage runs (train/launch.py): `processes: auto` without several GPUs trains in this process; a
stage that fails under torchrun is one error line with its workers' own message; torchrun and its workers end when
the process that launched them is killed or interrupted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import polars as pl
import psutil
import pytest
import torch

from pipeline_lib.config import DPOConfig, RMConfig, SFTConfig
from pipeline_lib.logfns import no_log
from pipeline_lib.models import build_tiny_model
from pipeline_lib.train.common import FINAL_MARKER
from pipeline_lib.train.launch import TrainLaunchError, stage_processes, train_stage
from pipeline_lib.train.sft import train_sft

ROOT = Path(__file__).resolve().parents[2]
ROWS = pl.DataFrame({"prompt": [f"{i:02d}+01=" for i in range(16)], "completion": [str(i + 1) for i in range(16)]})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "base", ["0123456789+="], hidden_size=64, num_heads=2,
                            intermediate_size=128)


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="auto takes every GPU where several are visible")
def test_auto_without_several_gpus_trains_in_this_process(tiny, tmp_path, capfd):
    for config in (SFTConfig(model_path="m"), RMConfig(model_path="m", device="cuda"), DPOConfig(policy_path="m")):
        assert config.processes == "auto" and stage_processes(config) == 1
    assert stage_processes(SFTConfig(model_path="m", processes=3, device="cpu")) == 3  # as given, CPU too
    cfg = SFTConfig(model_path=str(tiny), max_steps=1, batch_size=4, device="auto")
    final = train_stage(train_sft, cfg, {"rows": ROWS, "eval_rows": None}, tmp_path / "out", no_log)
    assert json.loads((final / FINAL_MARKER).read_text())["topology"]["world_size"] == 1
    assert "final model:" not in capfd.readouterr().out  # no torchrun worker printed its final


def test_a_stage_failing_under_torchrun_is_one_line_with_the_workers_message(tiny, tmp_path, capfd):
    """5 rows per update do not split over 2 ranks: every worker stops with check_batch_split's error line, and the
    launcher raises it alone, without a chained traceback; torchrun's output passed through holds none either."""
    cfg = SFTConfig(model_path=str(tiny), max_steps=2, batch_size=5, device="cpu", processes=2)
    with pytest.raises(TrainLaunchError) as raised:
        train_stage(train_sft, cfg, {"rows": ROWS}, tmp_path / "out", no_log)
    message = str(raised.value)
    assert message == ("pipeline_lib.train.sft in 2 torchrun processes failed: batch_size 5: expected a multiple of "
                       "world size 2 x grad_accum_steps 1")
    assert raised.value.__context__ is None and raised.value.__cause__ is None
    assert not (tmp_path / "out" / "final").exists()
    relayed = capfd.readouterr().err
    assert "error: batch_size 5: expected a multiple of world size 2" in relayed and "Traceback" not in relayed


def test_a_stage_under_torchrun_prints_no_rank_s_final_line(tiny, tmp_path, capfd):
    """Each rank printed `final model: DIR` through to the CLI's stdout, which then held three paths where the
    README promises one (the CLI's `output: DIR`)."""
    cfg = SFTConfig(model_path=str(tiny), max_steps=1, batch_size=4, device="cpu", processes=2)
    final = train_stage(train_sft, cfg, {"rows": ROWS, "eval_rows": None}, tmp_path / "out", no_log)
    assert json.loads((final / FINAL_MARKER).read_text())["topology"]["world_size"] == 2
    assert "final model:" not in capfd.readouterr().out


LAUNCHER = textwrap.dedent("""
    import sys
    import time
    from pathlib import Path
    import polars as pl
    from pipeline_lib.config import SFTConfig
    from pipeline_lib.logfns import print_log
    from pipeline_lib.train.launch import train_stage
    from pipeline_lib.train.sft import train_sft
    cfg = SFTConfig(model_path=sys.argv[1], max_steps=1_000_000, batch_size=4, log_every=1, save_every=1_000_000,
                    device="cpu", processes=2)
    rows = pl.DataFrame({"prompt": [f"{i:02d}+01=" for i in range(16)], "completion": [str(i + 1) for i in range(16)]})
    try:
        train_stage(train_sft, cfg, {"rows": rows}, Path(sys.argv[2]), print_log)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        time.sleep(600)  # this process lives on: what it launched must not
""")


@pytest.mark.parametrize("ending", [signal.SIGKILL, signal.SIGINT])
def test_torchrun_and_its_workers_end_with_the_process_that_launched_them(tiny, tmp_path, ending):
    """The stage's processes listen on loopback alone. A launcher SIGKILLed takes torchrun along (PR_SET_PDEATHSIG)
    and torchrun its workers; one interrupted (Ctrl-C: SIGINT, KeyboardInterrupt) that lives on has stopped torchrun
    and its workers. Either way no process of the stage is left. The run dir that a SIGKILLed launcher cannot remove
    is in the stage's out_dir (it was in $TMPDIR, for good), where the next launch removes it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tiny), str(tmp_path / "out")], env=env, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stage: list[psutil.Process] = []
    watchdog = threading.Timer(150, launcher.kill)  # a launcher that hangs ends its output: the reads below end
    watchdog.start()
    try:
        for line in launcher.stdout:
            if line.startswith("step 1 |"):  # rank 0's metrics reached the launcher: every process is up
                break
        stage = psutil.Process(launcher.pid).children(recursive=True)
        commands = [" ".join(process.cmdline()) for process in stage]
        agents = [command for command in commands if "-m pipeline_lib.train.launch" in command]
        assert len(agents) == 1 and len(stage) == 3  # torchrun and its 2 workers
        # torchrun's stores listened on every interface (anyone on the network could read and write them), gloo's
        # pairs where the hostname resolves: all on loopback now
        listening = [conn.laddr for process in stage for conn in process.net_connections(kind="inet")
                     if conn.status == psutil.CONN_LISTEN]
        assert len(listening) >= 2 and {address.ip for address in listening} == {"127.0.0.1"}, listening
        launcher.send_signal(ending)
        if ending == signal.SIGINT:
            assert "interrupted\n" in launcher.stdout  # reads on to the line, after the stop
        _, alive = psutil.wait_procs(stage, timeout=30)
        assert not alive
        assert (launcher.poll() is None) == (ending == signal.SIGINT)
        left = [path.name for path in (tmp_path / "out").iterdir()]
        if ending == signal.SIGKILL:
            assert len(left) == 1 and left[0].startswith(".torchrun-"), left
            cfg = SFTConfig(model_path=str(tiny), max_steps=1, batch_size=4, device="cpu", processes=2)
            train_stage(train_sft, cfg, {"rows": ROWS}, tmp_path / "out", no_log)
            assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["final"]
        else:
            assert not [name for name in left if name.startswith(".torchrun-")], left
    finally:  # a failed check leaves nothing running either
        watchdog.cancel()
        for process in stage:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
