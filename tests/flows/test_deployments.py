"""The deployments of a preset: one per stage flow (ingest, prepare, filters included), with the preset's stage
config as default parameters; on a real `prefect server` on 127.0.0.1, `alignflow serve` registers them with the
cron schedule, and a triggered run of the pipeline deployment is seen COMPLETED and its work lands in the store."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.deployments import build_deployments, csrf_headers, pause_served
from pipeline_lib.config import ConfigError, PipelineConfig, load_config
from pipeline_lib.store.db import open_store

DATA = Path(__file__).resolve().parents[2] / "data"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def test_every_stage_flow_is_deployed_with_the_presets_parameters():
    cfg = load_config(PipelineConfig, Path(__file__).resolve().parents[2] / "flows" / "configs" / "demo.yaml")
    deployments = {d.name: d for d in build_deployments(cfg)}
    assert {name: d.flow_name for name, d in deployments.items()} == {
        "demo": "pipeline", "demo-ingest": "ingest", "demo-prepare": "prepare-model", "demo-sft": "sft",
        "demo-rm": "rm", "demo-sample": "sample", "demo-dpo": "dpo", "demo-grpo": "grpo", "demo-dapo": "dapo",
        "demo-ppo": "ppo", "demo-eval": "evaluate", "demo-best_of_n": "filter", "demo-west_of_n": "filter"}
    assert deployments["demo-prepare"].parameters == {"cfg": cfg.base.model_dump(mode="json")}
    assert deployments["demo-best_of_n"].parameters == {"kind": "best_of_n"}  # the UI asks for the sampling run
    assert deployments["demo-ingest"].parameters == {} and deployments["demo-sft"].parameters == {}  # from:base
    assert deployments["demo-eval"].parameters == {}  # the eval section names no model: the UI asks for the config


@pytest.mark.parametrize("cron", ["every day", "61 * * * *", ""])
def test_an_invalid_cron_is_a_one_line_config_error_before_anything_is_deployed(cron):
    cfg = PipelineConfig(name="p", schedule_cron=cron)
    with pytest.raises(ConfigError) as err:
        build_deployments(cfg, origin="p.yaml")
    assert str(err.value) == (f"p.yaml: field 'schedule_cron': expected a cron expression: minute hour day month "
                              f"weekday, like '0 3 * * *' (got {cron!r})")


@pytest.mark.parametrize("name", ["a/b c", "", "50%"])
def test_a_name_prefect_refuses_is_a_one_line_config_error_before_anything_is_deployed(name):
    with pytest.raises(ConfigError) as err:
        build_deployments(PipelineConfig(name=name), origin="p.yaml")
    assert str(err.value) == (f"p.yaml: field 'name': expected a non-empty deployment name without any of "
                              f"/ % & > < (got {name!r})")


def test_a_server_answering_an_error_to_the_pause_is_not_called_down(answering_server):
    """Two serves stopped together: one got HTTP 503 (Prefect's sqlite busy) and warned that the server "did not
    answer" (a helper). A server answering 503 to everything stands in for that answer here."""
    api = f"http://127.0.0.1:{answering_server(503)}/api"
    assert pause_served(api, []) == (f"the Prefect server at {api} answered HTTP 503 to pausing the deployments: they "
                                     "were left unpaused")


def test_serve_reports_an_invalid_cron_in_one_line_without_a_server(tmp_path, subprocess_env):
    preset = tmp_path / "p.yaml"
    preset.write_text("name: p\nschedule_cron: every day\n")
    env = subprocess_env | {"ALIGNFLOW_HOME": str(tmp_path / "ws"),
                            "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"}
    result = subprocess.run([sys.executable, "-m", "flows.cli", "serve", "--config", str(preset)], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: {preset}: field 'schedule_cron': expected a cron expression: minute hour "
                                     "day month weekday, like '0 3 * * *' (got 'every day')")


@pytest.mark.slow
def test_served_pipeline_deployment_runs_on_a_real_server(tmp_path, subprocess_env, listening_sockets):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    server_env = os.environ | {"PREFECT_HOME": str(tmp_path / "server-home")}
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              stdout=(tmp_path / "server.log").open("w"), stderr=subprocess.STDOUT,
                              env=server_env, start_new_session=True)
    served = None
    try:
        wait_for(lambda: _healthy(api), 120, "prefect server health")
        preset = tmp_path / "smoke.yaml"
        preset.write_text(f"name: smoke\nschedule_cron: '0 3 * * *'\n"
                          f"ingest:\n  - {{path: {DATA / 'demo' / 'rankings.jsonl'}, source: demo}}\n")
        workspace = tmp_path / "ws"
        env = subprocess_env | {"PREFECT_API_URL": api, "ALIGNFLOW_HOME": str(workspace),
                            "PREFECT_HOME": str(tmp_path / "client-home")}
        served = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", str(preset)],
                                  stdout=(tmp_path / "serve.log").open("w"), stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        deployment = wait_for(lambda: _deployment(api, "smoke"), 120, "the pipeline deployment")
        assert deployment["schedules"][0]["schedule"]["cron"] == "0 3 * * *"
        assert f"alignflow-workspace:{workspace}" in deployment["tags"]
        # every stage flow is deployed too (registered one after the other)
        wait_for(lambda: _deployment(api, "smoke-west_of_n"), 60, "the stage deployments")
        for stage in ("ingest", "prepare", "sft", "eval", "best_of_n"):
            assert _deployment(api, f"smoke-{stage}") is not None
        # the serving process opens no socket beyond loopback (checked on the sockets themselves)
        assert {address for address, _ in listening_sockets(served.pid)} <= {"127.0.0.1"}

        def create_run(deployment: dict, body: dict) -> dict | None:
            created = httpx.post(f"{api}/deployments/{deployment['id']}/create_flow_run", json=body, timeout=10,
                                 headers=csrf_headers(api))
            if created.status_code == 503:  # the server's SQLite is busy with the runner; Prefect's client retries too
                return None
            assert created.status_code == 201, created.text
            return created.json()

        run = wait_for(lambda: create_run(deployment, {}), 60, "the flow run to be created")
        state = wait_for(lambda: _final_state(api, run["id"]), 240, "the triggered flow run to finish")
        assert state == "COMPLETED", (tmp_path / "serve.log").read_text()[-3000:]
        with open_store(workspace / "store.duckdb", read_only=True) as store:
            assert store.count("rankings") == 600
        # another workspace may not serve the same preset name while this one does: both would take its runs
        other = subprocess.run([sys.executable, "-m", "flows.cli", "serve", "--config", str(preset)],
                               capture_output=True, text=True, env=env | {"ALIGNFLOW_HOME": str(tmp_path / "ws2")},
                               timeout=120)
        assert other.returncode == 2, other.stderr
        assert other.stderr.startswith(f"error: preset 'smoke' is served from workspace {workspace} (polled "), \
            other.stderr
        # a user error in a deployment run (a file path mistyped in the UI) is one line in its logs, no traceback
        ingest = _deployment(api, "smoke-ingest")
        body = {"parameters": {"cfg": {"path": str(tmp_path / "no-such.jsonl"), "source": "x"}}}
        run = wait_for(lambda: create_run(ingest, body), 60, "the ingest run to be created")
        assert wait_for(lambda: _final_state(api, run["id"]), 240, "the ingest run to finish") == "FAILED"
        served_log = (tmp_path / "serve.log").read_text()
        assert f"{tmp_path / 'no-such.jsonl'}: no such file" in served_log and "Traceback" not in served_log
        # the server takes every deployment of the demo preset, its stages' default parameters included (the eval
        # section's, which names no model, were refused: serve crashed half-way, the pipeline's cron registered)
        demo = load_config(PipelineConfig, DATA.parent / "flows" / "configs" / "demo.yaml")
        with temporary_settings({PREFECT_API_URL: api}):
            applied = [stage_deployment.apply() for stage_deployment in build_deployments(demo)]
        assert len(applied) == 13
        # stopped, serve pauses what it served (the pipeline's cron stops with it); by a SIGINT sent to it alone,
        # as a supervisor's `kill -INT` is (it ran on: asyncio cancelled its main task, Prefect's runner never ended)
        served.send_signal(signal.SIGINT)
        assert served.wait(30) == 0 and _deployment(api, "smoke")["paused"]
        # stopped while its server is down, it exits in seconds with one warning, not after Prefect's runner spent
        # about 70 s retrying the server to pause them, with tracebacks
        restarted = datetime.now(timezone.utc)
        served = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", str(preset)],
                                  stdout=(tmp_path / "serve-2.log").open("w"), stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        wait_for(lambda: _polled_since(api, "smoke", restarted), 120, "the runner polling again")
        stop(server)
        os.killpg(served.pid, signal.SIGTERM)
        assert served.wait(30) == 0
        last = (tmp_path / "serve-2.log").read_text().splitlines()[-1]
        assert last == (f"warning: the Prefect server at {api} did not answer (ConnectError): the deployments were "
                        "left unpaused")
    finally:
        if served is not None:
            stop(served)  # serve processes first: stopped after their server, they hang retrying it
        stop(server)


def _healthy(api: str) -> bool:
    try:
        return httpx.get(f"{api}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _deployment(api: str, name: str) -> dict | None:
    found = httpx.post(f"{api}/deployments/filter", json={"deployments": {"name": {"any_": [name]}}}, timeout=10,
                       headers=csrf_headers(api))
    rows = found.json()
    return rows[0] if rows else None


def _polled_since(api: str, name: str, since: datetime) -> bool:
    polled = _deployment(api, name)["last_polled"]
    return polled is not None and datetime.fromisoformat(polled) > since


def _final_state(api: str, flow_run_id: str) -> str | None:
    state = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]["type"]
    return state if state in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"} else None
