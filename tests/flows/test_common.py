"""Every flow holds the workspace run lock: a stage flow started while another process runs on the workspace
(a deployment run from the Prefect UI beside a CLI run) fails at once with the holder's pid, writing nothing.
And a flow run whose process was killed is marked Crashed by the next run, which stops the Prefect server the
killed process left behind."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import psutil
import pytest

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ParameterTypeError, TerminationSignal
from prefect.flow_engine import run_flow
from prefect.settings import get_current_settings
from prefect.states import Failed, Running

from flows.cli import start_prefect_server
from flows.common import _api, on_record
from flows.ingest import ingest_flow
from pipeline_lib import tracking
from pipeline_lib.config import ConfigError, IngestConfig
from pipeline_lib.sampling.vllm import VLLMServerError
from pipeline_lib.workspace import Workspace, WorkspaceLockedError, host_id
from tasks.common import retry_on_io
from tasks.ingest import ingest_task

ROOT = Path(__file__).resolve().parents[2]


def test_stage_flow_refuses_a_workspace_another_process_runs_on(flow_workspace, lock_holder):
    holder = lock_holder(flow_workspace, "alignflow run pipeline")
    try:
        with pytest.raises(WorkspaceLockedError) as err:  # a deployment's user cannot pass --workspace
            ingest_flow(IngestConfig(path=str(ROOT / "data" / "demo" / "pairs.jsonl"), source="demo"))
        assert str(err.value) == (f"workspace {flow_workspace.root} is in use by alignflow process {holder.pid} "
                                  "(alignflow run pipeline); wait for it to finish, then run this flow again")
        assert not flow_workspace.store_path.exists()
    finally:
        holder.kill()
        holder.wait()
    assert ingest_flow(IngestConfig(path=str(ROOT / "data" / "demo" / "pairs.jsonl"), source="demo"))


def dead_process() -> list:
    """[pid, start time] of a process that has exited and been reaped, as a record names it."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = [child.pid, psutil.Process(child.pid).create_time()]
    child.wait()
    return identity


def test_the_next_flow_crashes_a_dead_processs_runs_and_survives_bad_records(flow_workspace):
    """Under the test harness's Prefect: a record naming a dead process ends its flow run (and its running task
    run) Crashed; an unreadable record is removed with a warning; neither stops the flow that finds them."""
    pairs = IngestConfig(path=str(ROOT / "data" / "demo" / "pairs.jsonl"), source="demo")
    with get_client(sync_client=True) as client:  # what a SIGKILLed process leaves: both runs Running
        killed = client.create_flow_run(ingest_flow, parameters={"cfg": pairs.model_dump()}, state=Running())
        task = client.create_task_run(ingest_task, killed.id, dynamic_key="0", state=Running())
    records = flow_workspace.prefect_home / "flow-runs"
    records.mkdir(parents=True)
    (records / f"{killed.id}.json").write_text(json.dumps({"host": host_id(), "api": _api(),
                                                           "process": dead_process(), "servers": []}))
    (records / "0000.json").write_text('{"host": ')  # a record cut short by an older, non-atomic write

    with pytest.warns(RuntimeWarning, match=r"0000\.json: unreadable flow-run record .*; removed"):
        assert ingest_flow(pairs)["accepted"] == 3000

    with get_client(sync_client=True) as client:
        flow_run, task_run = client.read_flow_run(killed.id), client.read_task_run(task.id)
    assert flow_run.state_type == task_run.state_type == StateType.CRASHED
    assert flow_run.state.message.startswith("alignflow process ") and flow_run.state.message.endswith("(killed)")
    assert not list(records.iterdir())


def test_a_dead_processs_run_recorded_through_another_api_is_ended_where_this_database_holds_it(flow_workspace):
    """`alignflow serve` records its runs through `alignflow ui`'s server, which shares the workspace's database with
    the CLI's temporary server: a CLI flow ends such a run of a Ctrl-C'd serve. A run this database does not hold
    (another server's) keeps its record for a flow of that server."""
    pairs = IngestConfig(path=str(ROOT / "data" / "demo" / "pairs.jsonl"), source="demo")
    with get_client(sync_client=True) as client:
        served = client.create_flow_run(ingest_flow, parameters={"cfg": pairs.model_dump()}, state=Running())
    records = flow_workspace.prefect_home / "flow-runs"
    records.mkdir(parents=True)
    elsewhere = "00000000-0000-0000-0000-000000000000"
    for run_id in (served.id, elsewhere):
        (records / f"{run_id}.json").write_text(json.dumps({"host": host_id(), "api": "http://127.0.0.1:4311/api",
                                                            "process": dead_process(), "servers": []}))
    assert ingest_flow(pairs)["accepted"] == 3000
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(served.id).state_type == StateType.CRASHED
    assert [path.name for path in records.iterdir()] == [f"{elsewhere}.json"]


def test_a_record_goes_with_the_flow_but_stays_when_a_signal_ends_it(workspace):
    """A flow that returns or fails removes its record; one ended by SIGTERM (Prefect's TerminationSignal) or
    Ctrl-C keeps it, so the next flow stops the temporary Prefect server the dying process may leave."""
    records = workspace.prefect_home / "flow-runs"
    with on_record(workspace, "returned"):
        assert json.loads((records / "returned.json").read_text())["process"][0] == os.getpid()
    with pytest.raises(ValueError), on_record(workspace, "failed"):
        raise ValueError("a stage error")
    with pytest.raises(TerminationSignal), on_record(workspace, "terminated"):
        raise TerminationSignal(signal.SIGTERM)
    assert [path.name for path in records.iterdir()] == ["terminated.json"]


@pytest.mark.slow  # a process that loads a stage and boots a Prefect server: ~20 s on 2 cores
def test_the_cli_boots_prefects_temporary_server_while_the_stage_loads_and_the_flow_uses_that_one(tmp_path):
    """`load_flow` starts the server before it imports the stage (torch, transformers: seconds on 2 cores), so the
    two overlap: when it returns, the server is up, though no API call has been made; the flow's client then
    uses that server, not a second one. On the harness's (already migrated) database, in a process of its own."""
    code = textwrap.dedent("""
        import sys
        import psutil
        from prefect.client.orchestration import get_client
        from flows.cli import load_flow
        from flows.common import _prefect_servers
        load_flow("sft")
        [server] = _prefect_servers(psutil.Process())
        assert "torch" in sys.modules
        with get_client(sync_client=True) as client:
            assert client.hello().status_code == 200
            port = client.api_url.port
        assert [s.pid for s in _prefect_servers(psutil.Process())] == [server.pid]
        assert any(c.laddr.port == port for c in server.net_connections("inet") if c.status == psutil.CONN_LISTEN)
        print("one server, started by load_flow")
    """)
    database = get_current_settings().server.database.connection_url.get_secret_value()
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")} | {
        "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_DATABASE_CONNECTION_URL": database}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.strip() == "one server, started by load_flow", done.stderr
    assert start_prefect_server() is None  # under a Prefect API (here the harness's), no temporary server


def alignflow(workspace: Path, *args: str, **popen) -> subprocess.Popen:
    """`alignflow -w workspace args` as a user starts it, on the workspace's own temporary Prefect server."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME")}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "-w", str(workspace), *args], cwd=ROOT, env=env,
                            text=True, **popen)


def prefect_flow_runs(workspace: Path) -> list[tuple[str, str, str | None, set[str]]]:
    """(name, state, state message, states of its task runs) of every flow run in the workspace's Prefect, oldest
    first."""
    code = textwrap.dedent("""
        import json
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
        with get_client(sync_client=True) as client:
            runs = [[run.name, run.state_type.value, run.state.message, sorted({task.state_type.value for task in
                     client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))})]
                    for run in client.read_flow_runs(sort="EXPECTED_START_TIME_ASC")]
        print(json.dumps(runs))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(workspace / "prefect")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return [(name, state, message, set(tasks)) for name, state, message, tasks in json.loads(out.splitlines()[-1])]


@pytest.mark.slow  # nine processes, each starting Prefect's temporary server: ~200 s on 2 cores
def test_the_next_run_crashes_the_flow_runs_of_a_killed_process_and_stops_its_prefect_server(tmp_path):
    workspace = tmp_path / "ws"
    prepare = tmp_path / "prepare.yaml"
    prepare.write_text("corpus_sources: [demo]\nhidden_size: 32\nnum_layers: 1\n")
    ingest = alignflow(workspace, "ingest", str(ROOT / "data" / "demo" / "problems.jsonl"), "-s", "demo")
    assert ingest.wait(timeout=300) == 0
    built = alignflow(workspace, "run", "prepare", "--config", str(prepare), stdout=subprocess.PIPE)
    model = built.communicate(timeout=300)[0].strip().removeprefix("output: ")
    (tmp_path / "sft.yaml").write_text(f"model_path: {model}\nsource: demo\nmax_steps: 100000\nsave_every: 50\n")
    records = workspace / "prefect" / "flow-runs"

    sft = alignflow(workspace, "run", "sft", "--config", str(tmp_path / "sft.yaml"), stderr=subprocess.PIPE)
    while "step " not in sft.stderr.readline():  # training has begun
        assert sft.poll() is None
    [record] = [json.loads(path.read_text()) for path in records.glob("*.json")]
    [(server_pid, _)] = record["servers"]
    sft.kill()  # SIGKILL: no finally, no atexit; its Prefect server is left behind, an orphan
    sft.wait()
    sft.stderr.close()
    assert psutil.pid_exists(server_pid)
    assert [state for name, state, _, _ in prefect_flow_runs(workspace)] == ["COMPLETED", "COMPLETED", "RUNNING"]

    rerun = alignflow(workspace, "run", "prepare", "--config", str(prepare))  # any later flow in the workspace
    assert rerun.wait(timeout=300) == 0

    killed = f"alignflow process {sft.pid} ended without finishing this flow run (killed)"
    assert prefect_flow_runs(workspace) == [
        ("ingest-problems.jsonl", "COMPLETED", None, {"COMPLETED"}),
        ("prepare", "COMPLETED", None, {"COMPLETED"}),
        ("sft", "CRASHED", killed, {"COMPLETED", "CRASHED"}),  # its fingerprint task had completed, training had not
        ("prepare", "COMPLETED", None, {"COMPLETED"}),
    ]
    assert not psutil.pid_exists(server_pid) or psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE
    assert not list(records.glob("*.json"))

    def stopped_mid_training(stop: signal.Signals) -> tuple[int, float]:
        """(exit code, seconds to exit) of an SFT run whose process group gets `stop` once it trains."""
        again = alignflow(workspace, "run", "sft", "--config", str(tmp_path / "sft.yaml"), stderr=subprocess.PIPE,
                          start_new_session=True)
        while "step " not in again.stderr.readline():
            assert again.poll() is None
        sent = time.monotonic()
        os.killpg(again.pid, stop)
        code = again.wait(timeout=300)
        again.stderr.close()
        return code, time.monotonic() - sent

    # Ctrl-C in a terminal: SIGINT to the whole process group, so Prefect's temporary server stops too and its
    # client would retry it for minutes; the CLI exits within its grace period instead
    code, seconds = stopped_mid_training(signal.SIGINT)
    assert code == 130 and seconds < 30
    assert alignflow(workspace, "run", "prepare", "--config", str(prepare)).wait(timeout=300) == 0
    assert [(name, state) for name, state, _, _ in prefect_flow_runs(workspace)][-2:] == [
        ("sft", "CRASHED"), ("prepare", "COMPLETED")]
    assert not list(records.glob("*.json"))

    # SIGTERM to the whole group (`timeout`, systemd, Slurm): the same for the server, and the command lingered
    # about 2.5 minutes, holding the workspace, with the client's tracebacks; now it exits within the grace period
    code, seconds = stopped_mid_training(signal.SIGTERM)
    assert code in (143, -signal.SIGTERM) and seconds < 30
    assert alignflow(workspace, "run", "prepare", "--config", str(prepare)).wait(timeout=300) == 0

@pytest.mark.slow
def test_ctrl_c_during_a_pipelines_stage_marks_the_pipelines_mlflow_run_killed(tmp_path):
    """The stage's own run is ended KILLED as the interrupt unwinds it, but the CLI exits after its grace period while
    Prefect's client retries the stopped server, before the pipeline flow unwinds: its parent run stayed RUNNING
    until the workspace's next run."""
    workspace = tmp_path / "ws"
    preset = tmp_path / "p.yaml"
    preset.write_text(f"name: p\ningest:\n  - {{path: {ROOT / 'data' / 'demo' / 'problems.jsonl'}, source: demo}}\n"
                      "base: {corpus_sources: [demo], hidden_size: 32, num_layers: 1}\n"
                      "sft: {model_path: 'from:base', source: demo, max_steps: 100000, save_every: 50}\n")
    run = alignflow(workspace, "run", "pipeline", "--config", str(preset), stderr=subprocess.PIPE,
                    start_new_session=True)
    for line in iter(run.stderr.readline, ""):  # Prefect's lines of the task runs' output
        if "sft" in line and "step " in line:  # SFT trains (the base stage logs steps too)
            break
    os.killpg(run.pid, signal.SIGINT)
    assert run.wait(timeout=120) == 130
    run.stderr.close()
    runs = {run.info.run_name: run for run in tracking.find_runs(Workspace(workspace))}
    assert (runs["p"].info.status, runs["sft"].info.status) == ("KILLED", "KILLED")
    assert runs["p"].data.tags["alignflow.error"] == "interrupted (Ctrl-C)"


@pytest.mark.parametrize(("error", "retried"), [
    (VLLMServerError("vLLM server http://127.0.0.1:1: cannot connect (...)", transient=True), True),
    (VLLMServerError("vLLM server ...: HTTP 503: overloaded", status=503, transient=True), True),
    (VLLMServerError("vLLM server ...: HTTP 400: prompt too long", status=400), False),  # the same again
    (OSError("disk hiccup"), True),
    (duckdb.IOException("IO Error: could not write"), True),
    (ConfigError("max_new_tokens: ..."), False),
    (ValueError("a bug, or input the stage refuses: the same again"), False),
])
def test_sampling_retries_a_server_that_went_away_not_a_request_it_refused(error, retried):
    assert retry_on_io(None, None, Failed(data=error)) is retried


def test_a_deployment_runs_parameters_refused_by_a_configs_validator_log_one_line_without_a_traceback():
    """Prefect checks a deployment run's parameters with the config's validators before the flow starts, and its
    engine logged the ParameterTypeError with a 15-line traceback in the run's logs (Prefect's UI)."""
    from flows.evaluate import eval_flow

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("prefect.flow_runs")  # the engine's error logger in a deployment run
    logger.addHandler(handler)
    try:
        with pytest.raises(ParameterTypeError):
            run_flow(eval_flow, parameters={"cfg": {"model_path": "m", "n": 4, "ks": [1, 2, 8]}}, error_logger=logger)
    finally:
        logger.removeHandler(handler)
    (record,) = records
    assert record.exc_info is None and record.getMessage() == (
        "Engine execution exited with unexpected exception: Flow run received invalid parameters: - cfg: Value "
        "error, ks [1, 2, 8]: expected values in 1..n=4")
