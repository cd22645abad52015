"""Deployments of a pipeline preset (the pipeline on its cron, each stage on demand) and the local UI
servers (Prefect + MLflow on 127.0.0.1) behind `alignflow serve` and `alignflow ui`."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx

from pipeline_lib.config import FROM, ConfigError, PipelineConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.workspace import Workspace

# stage (as `alignflow run` names it) -> the preset field whose config is the default parameter of its deployment;
# ingest has none: a preset lists several files and the flow takes one, so the UI asks for it; nor has eval: the
# preset's eval section names no model (each stage of eval_models gives one), which the eval flow's config requires
# (Prefect refuses such defaults when the deployment is applied)
STAGE_FLOWS = {"ingest": None, "prepare": "base", "sft": "sft", "rm": "rm", "sample": "sample", "dpo": "dpo",
               "grpo": "grpo", "dapo": "dapo", "ppo": "ppo", "eval": None}
FILTER_KINDS = ("best_of_n", "west_of_n")
WORKSPACE_TAG = "alignflow-workspace:"
"""Prefix of the deployments' tag naming the workspace whose `alignflow serve` runs them."""
POLLED_WITHIN_S = 30
"""A deployment polled this recently is being served (a runner polls every 10 s by default)."""


def build_deployments(cfg: PipelineConfig, origin: str = "config", workspace: Path | None = None) -> list:
    """The pipeline deployment (cron from the preset), one per stage flow and one per filter kind, tagged with the
    `workspace` that serves them. A stage's preset config is its default parameter when it has no `from:`
    reference; otherwise the UI asks for the paths (and a filter for the sampling run). An invalid cron is a
    one-line ConfigError naming `origin`."""
    from flows.cli import load_flow
    from flows.filters import filter_flow
    from flows.pipeline import pipeline_flow

    check_cron(cfg.schedule_cron, origin)
    check_name(cfg.name, origin)

    tags = [f"{WORKSPACE_TAG}{workspace}"] if workspace is not None else []
    deployments = [pipeline_flow.to_deployment(name=cfg.name, cron=cfg.schedule_cron, tags=tags,
                                               parameters={"cfg": cfg.model_dump(mode="json")})]
    for stage, field in STAGE_FLOWS.items():
        stage_cfg = getattr(cfg, field) if field else None
        dumped = stage_cfg.model_dump(mode="json") if stage_cfg is not None else None
        params = {"cfg": dumped} if dumped and not any(str(v).startswith(FROM) for v in dumped.values()) else {}
        flow = load_flow(stage, servers=False)  # serve checks its server itself
        deployments.append(flow.to_deployment(name=f"{cfg.name}-{stage}", parameters=params, tags=tags))
    for kind in FILTER_KINDS:
        deployments.append(filter_flow.to_deployment(name=f"{cfg.name}-{kind}", parameters={"kind": kind},
                                                     tags=tags))
    return deployments


def check_not_served_elsewhere(api: str, name: str, workspace: Path) -> None:
    """A one-line AlignflowError if another workspace's `alignflow serve` serves the preset `name` on the server at
    `api` now (its runner polled the pipeline deployment within POLLED_WITHIN_S): both runners would take the
    deployments' runs, each into its own workspace. The same workspace may serve it again (a restart)."""
    from flows.pipeline import pipeline_flow

    response = httpx.get(f"{api}/deployments/name/{pipeline_flow.name}/{name}", timeout=10)
    if response.status_code == 404:
        return
    response.raise_for_status()
    deployment = response.json()
    served_from = [tag.removeprefix(WORKSPACE_TAG) for tag in deployment["tags"] if tag.startswith(WORKSPACE_TAG)]
    if not served_from or served_from == [str(workspace)] or deployment["last_polled"] is None:
        return
    age = (datetime.now(timezone.utc) - datetime.fromisoformat(deployment["last_polled"])).total_seconds()
    if age < POLLED_WITHIN_S:
        raise AlignflowError(f"preset {name!r} is served from workspace {served_from[0]} (polled {age:.0f} s ago): "
                             "both would take its runs; stop that `alignflow serve`, or give this preset another "
                             "`name`")


def csrf_headers(api: str) -> dict[str, str]:
    """The headers a state-changing request needs to pass the CSRF check of the Prefect server at `api` (on for the
    servers alignflow starts: `workspace.OFFLINE_ENV`); none where the server has the check off."""
    client = str(uuid.uuid4())
    response = httpx.get(f"{api}/csrf-token", params={"client": client}, timeout=5)
    if response.status_code == 422:  # "CSRF protection is disabled."
        return {}
    response.raise_for_status()
    return {"Prefect-Csrf-Token": response.json()["token"], "Prefect-Csrf-Client": client}


def pause_served(api: str, deployments: list) -> str | None:
    """Pause the served deployments, as Prefect's runner does when it stops (`serve` turns that off): here in one
    try each, so a server that is down costs seconds, not the runner's minute of retries and tracebacks. Returns
    None, or why they were left unpaused (the pipeline's schedule then stays on until it is served again)."""
    try:
        headers = csrf_headers(api)
        for deployment in deployments:
            found = httpx.get(f"{api}/deployments/name/{deployment.flow_name}/{deployment.name}", timeout=5)
            found.raise_for_status()
            httpx.patch(f"{api}/deployments/{found.json()['id']}", json={"paused": True}, headers=headers,
                        timeout=5).raise_for_status()
    except httpx.HTTPStatusError as exc:  # it answered, with an error (503 while its sqlite database is busy)
        return (f"the Prefect server at {api} answered HTTP {exc.response.status_code} to pausing the deployments: "
                "they were left unpaused")
    except httpx.HTTPError as exc:
        return f"the Prefect server at {api} did not answer ({type(exc).__name__}): the deployments were left unpaused"
    return None


def check_cron(cron: str | None, origin: str) -> None:
    """Prefect's own cron check (its CronSchedule), here rather than in PipelineConfig because pipeline_lib never
    imports prefect; without it a bad cron fails inside to_deployment as a pydantic traceback."""
    if cron is None:
        return
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=cron)
    except ValueError:  # pydantic's ValidationError
        raise ConfigError(f"{origin}: field 'schedule_cron': expected a cron expression: minute hour day month "
                          f"weekday, like '0 3 * * *' (got {cron!r})") from None


def check_name(name: str, origin: str) -> None:
    """Prefect's own rule for deployment names (the pipeline's and `<name>-<stage>`): not empty, none of its banned
    characters; without it a bad name fails inside to_deployment as an InvalidNameError traceback."""
    from prefect.types import BANNED_CHARACTERS, WITHOUT_BANNED_CHARACTERS

    if not re.match(WITHOUT_BANNED_CHARACTERS, name):
        raise ConfigError(f"{origin}: field 'name': expected a non-empty deployment name without any of "
                          f"{' '.join(BANNED_CHARACTERS)} (got {name!r})")


def wait_healthy(url: str, process: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AlignflowError(f"{url} exited with {process.returncode}; see {log}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AlignflowError(f"{url} not healthy after {timeout:.0f} s; see {log}")


def require_free_port(port: int, option: str) -> None:
    """A one-line AlignflowError if 127.0.0.1:`port` is taken: a server started there would exit, and the health
    check would find whatever already answers (another workspace's UI)."""
    with socket.socket() as sock:
        # as the servers bind: a port left in TIME_WAIT by a UI stopped a moment ago is free to them
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise AlignflowError(f"port {port} on 127.0.0.1 is in use (another `alignflow ui` or server?); choose "
                                 f"another with {option}") from None


def run_ui(workspace: Workspace, *, prefect_port: int, mlflow_port: int) -> None:
    """Prefect server + MLflow UI until SIGINT/SIGTERM/SIGHUP; both bound to 127.0.0.1, logs in the workspace. A server
    that stops on its own ends both with a one-line error."""
    require_free_port(prefect_port, "--prefect-port")
    require_free_port(mlflow_port, "--mlflow-port")
    bin_dir = Path(sys.executable).parent
    logs = workspace.root / "logs"
    logs.mkdir(exist_ok=True)
    commands = {
        "prefect": ([sys.executable, "-m", "flows.prefect_server", "server", "start", "--host", "127.0.0.1", "--port",
                     str(prefect_port)], f"http://127.0.0.1:{prefect_port}/api/health"),
        "mlflow": ([str(bin_dir / "mlflow"), "server", "--backend-store-uri", workspace.tracking_uri,
                    "--default-artifact-root", workspace.mlflow_artifacts.as_uri(), "--host", "127.0.0.1",
                    "--port", str(mlflow_port), "--workers", "1"], f"http://127.0.0.1:{mlflow_port}/health"),
    }
    # MLflow's job runner (a dozen huey consumers for its GenAI jobs, unused here) took up to 15 s to stop on SIGTERM
    origins = os.environ.get("PREFECT_SERVER_CORS_ALLOWED_ORIGINS") or \
        f"http://127.0.0.1:{prefect_port},http://localhost:{prefect_port}"  # the UI's own, unless the user set some
    environments = {"prefect": {**os.environ, "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": origins},
                    "mlflow": {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ}}
    processes = {}
    for stop in (signal.SIGTERM, signal.SIGHUP):  # before the servers start: `finally` stops them (the terminal
        signal.signal(stop, lambda *_: sys.exit(0))  # closed, a lost ssh session: SIGHUP left both running)
    try:
        for name, (command, health) in commands.items():
            log = logs / f"{name}-server.log"
            with log.open("w") as output:  # the server writes to its own copy of the descriptor
                processes[name] = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                                   start_new_session=True, env=environments[name])
            wait_healthy(health, processes[name], 90, log)
        print(f"Prefect UI: http://127.0.0.1:{prefect_port}   "
              f"(export PREFECT_API_URL=http://127.0.0.1:{prefect_port}/api)")
        print(f"MLflow UI:  http://127.0.0.1:{mlflow_port}")
        print("Ctrl-C stops both.", flush=True)
        while all(p.poll() is None for p in processes.values()):
            time.sleep(1)
        name = next(name for name, p in processes.items() if p.poll() is not None)
        raise AlignflowError(f"the {name} server stopped (exit {processes[name].returncode}); see "
                             f"{logs / f'{name}-server.log'}")
    except KeyboardInterrupt:
        pass
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
