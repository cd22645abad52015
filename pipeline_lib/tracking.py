"""MLflow helpers: the workspace's experiment, stage runs (nested under a pipeline run), logging.

The only module that imports mlflow. Library code receives a `log(metrics, step)` callable;
`stage_run` supplies the MLflow one, `no_log` is for unit tests. Callers in tasks/ pass the
Prefect flow-run id as a tag (`prefect.flow_run_id`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient
from pydantic import BaseModel

from pipeline_lib import alignflow_version, code_version
from pipeline_lib.config import KEEPING_FIELDS
from pipeline_lib.errors import AlignflowError, one_line
from pipeline_lib.fingerprint import model_fingerprint
from pipeline_lib.logfns import LogFn, print_log
from pipeline_lib.workspace import USER_TRACKING_URI, Workspace, host_id, process_alive

EXPERIMENT = "alignflow"
PARENT_ENV = "ALIGNFLOW_PARENT_RUN_ID"  # set by the pipeline flow so stage runs nest under it
MAX_PARAM_CHARS = 500  # MLflow's param value limit is 6000; keep the UI readable
TRUNCATED = "...[truncated]"
# A model dir is copied into its run whole up to this many MiB ($ALIGNFLOW_MLFLOW_MODEL_MIB); a larger one (a 7B
# model is ~14 GiB a stage) keeps its big files in the workspace only, as HF's MLflow callback logs no weights.
MODEL_COPY_ENV = "ALIGNFLOW_MLFLOW_MODEL_MIB"
DEFAULT_MODEL_COPY_MIB = 1024
SMALL_FILE_BYTES = 64 * 2**20  # config, tokenizer, metrics: copied whatever the model's size
MODEL_COPY_TAG = "alignflow.model_copy"  # on a run holding a copy of a model: the model's content fingerprint
CARRY_BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics a call
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def configure(workspace: Workspace, experiment: str = EXPERIMENT) -> str:
    """Point MLflow at the workspace (sqlite + file artifacts) and return the experiment id.

    MLflow stores absolute artifact URIs: a workspace moved or copied since its experiment was created still
    points at the old directory, so its own store is rewritten to the workspace's `mlartifacts/` first."""
    user_uri = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(workspace.tracking_uri)
    if user_uri is None:  # mlflow exports the URI to child processes; they must follow their own workspace
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    artifacts = workspace.mlflow_artifacts.as_uri()
    with _one_process_at_a_time(workspace.tracking_uri):
        found = mlflow.get_experiment_by_name(experiment)  # MLflow creates or migrates a sqlite store's schema here
        if found is None:
            experiment_id = mlflow.create_experiment(experiment, artifact_location=artifacts)
        else:
            experiment_id = found.experiment_id
            old = found.artifact_location
            # a workspace's own artifacts dir somewhere else, not an artifact root the user chose (s3://, ...)
            moved = old != artifacts and old.startswith("file:") and old.rstrip("/").endswith("/mlartifacts")
            if moved and workspace.tracking_uri == f"sqlite:///{workspace.mlflow_db}":
                _relocate_artifacts(workspace.mlflow_db, old, artifacts)
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


@contextmanager
def _one_process_at_a_time(uri: str) -> Iterator[None]:
    """An exclusive lock on `<file>.lock` beside a sqlite tracking store: MLflow creates and migrates its schema on
    first use, unsafely against another process doing the same (two workspaces started together on a new shared
    file: one failed with alembic tracebacks, a helper saw it 3 times in 3), and both would create the experiment."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    with open(f"{uri.removeprefix('sqlite:///').split('?')[0]}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _relocate_artifacts(mlflow_db: Path, old: str, new: str) -> None:
    """Rewrite the artifact URIs under `old` to `new` in the workspace's own MLflow sqlite store."""
    prefix = old.rstrip("/")
    with contextlib.closing(sqlite3.connect(mlflow_db)) as db, db:
        for table, column in (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                              ("logged_models", "artifact_location")):
            db.execute(f"UPDATE {table} SET {column} = ? || substr({column}, ?) "  # noqa: S608 - fixed names
                       f"WHERE {column} = ? OR substr({column}, 1, ?) = ?",
                       (new.rstrip("/"), len(prefix) + 1, prefix, len(prefix) + 1, prefix + "/"))


def flatten_params(value: Any, prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b": "v"}; long values truncated with a marker."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, (list, tuple)) and any(isinstance(item, (Mapping, BaseModel)) for item in value):
        value = dict(enumerate(value))  # a list of configs (the pipeline's ingest files): ingest.0.path, ...
    if isinstance(value, Mapping):
        flat: dict[str, str] = {}
        for key, item in value.items():
            flat.update(flatten_params(item, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): _truncated(json.dumps(value) if isinstance(value, (list, tuple)) else str(value))}


def _truncated(text: str) -> str:
    return text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - len(TRUNCATED)] + TRUNCATED


@contextmanager
def stage_run(
    workspace: Workspace,
    stage: str,
    config: BaseModel | Mapping[str, Any] | None = None,
    *,
    tags: Mapping[str, str] | None = None,
    echo: bool = True,
) -> Iterator[LogFn]:
    """An MLflow run for one stage (nested under $ALIGNFLOW_PARENT_RUN_ID when set).

    Logs the flattened config as params and as `config.json`; yields `log(metrics, step)`.
    An exception marks the run FAILED and propagates."""
    model_copy_limit()  # a bad setting fails before the stage trains, not when it logs its model
    experiment_id = configure(workspace)
    params = flatten_params(config) if config is not None else {}
    _end_stale_runs(experiment_id)
    resumes = _run_to_resume(workspace, experiment_id, stage, params, dict(tags or {}).get("data.fingerprint"))
    parent = os.environ.get(PARENT_ENV)
    run = mlflow.start_run(run_name=stage, nested=parent is not None, parent_run_id=parent)
    try:
        mlflow.set_tags({"alignflow.stage": stage, **_process_tags(workspace),
                         **({"alignflow.resumes": resumes} if resumes else {}), **dict(tags or {})})
        if config is not None:
            mlflow.log_params(params)
            dumped = config.model_dump(mode="json") if isinstance(config, BaseModel) else dict(config)
            mlflow.log_dict(dumped, "config.json")

        carried = not resumes  # the resumed run's earlier points, copied at the first step this run logs

        def log(metrics: Mapping[str, float], step: int) -> None:
            nonlocal carried
            if not carried:
                _carry_history(resumes, run.info.run_id, before_step=step)
                carried = True
            clean = {k: float(v) for k, v in metrics.items()}
            mlflow.log_metrics(clean, step=step, run_id=run.info.run_id)
            if echo:
                print_log(clean, step)

        yield log
    except BaseException as exc:
        _end_failed(exc)
        _raise_if_disk_full(exc)
        raise
    mlflow.end_run(status="FINISHED")


@contextmanager
def pipeline_run(
    workspace: Workspace, name: str, config: BaseModel, *, tags: Mapping[str, str] | None = None
) -> Iterator[str]:
    """The parent run of a pipeline: stage runs started inside nest under it."""
    _end_stale_runs(configure(workspace))
    run = mlflow.start_run(run_name=name)
    os.environ[PARENT_ENV] = run.info.run_id
    try:
        mlflow.set_tags({"alignflow.stage": "pipeline", **_process_tags(workspace), **dict(tags or {})})
        mlflow.log_params(flatten_params(config))
        mlflow.log_dict(config.model_dump(mode="json"), "config.json")
        yield run.info.run_id
    except BaseException as exc:
        _end_failed(exc)
        _raise_if_disk_full(exc)
        raise
    finally:
        os.environ.pop(PARENT_ENV, None)
    mlflow.end_run(status="FINISHED")


def end_interrupted_pipeline_run(cause: str) -> None:
    """Mark KILLED the pipeline run this process holds open, if any, interrupted by `cause` (Ctrl-C, SIGTERM): the
    interrupt ends the stage's run, but the CLI exits (`flows.signals.exit_after`) while Prefect's client still
    retries its stopped server, before the pipeline's flow unwinds to `pipeline_run`; the parent run was left
    RUNNING until the workspace's next run."""
    run_id = os.environ.get(PARENT_ENV)
    if run_id is None:
        return
    client = MlflowClient()  # the workspace's store: `pipeline_run` pointed MLflow at it
    client.set_tag(run_id, "alignflow.error", f"interrupted ({cause})")
    client.set_terminated(run_id, status="KILLED")


def _process_tags(workspace: Workspace) -> dict[str, str]:
    """Who writes the run: host and pid (to tell a killed run from a live one), its workspace (an exported
    MLFLOW_TRACKING_URI holds several) and the code that wrote it."""
    return {"alignflow.host": host_id(), "alignflow.pid": str(os.getpid()), "alignflow.workspace": str(workspace.root),
            **_code_version_tags()}


@functools.cache
def _code_version_tags() -> dict[str, str]:
    """alignflow's version, its code (`code_version`, what cache keys hold) and, from a git checkout, its commit and
    local changes (`_git_tags`)."""
    return {"alignflow.version": alignflow_version(), "alignflow.code": code_version(),
            **_git_tags(Path(__file__).resolve().parents[1])}


def _git_tags(checkout: Path) -> dict[str, str]:
    """The commit of the git checkout at `checkout` (MLflow shows `mlflow.source.git.commit`) and whether its working
    tree differs from it: `alignflow.git.dirty` true or false, and where true `alignflow.git.changes`, the count and
    paths of the changed and untracked files (`git status`). The commit alone named code the run may not have run:
    runs of one commit had other code fingerprints. Nothing outside a checkout of its own."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout

    try:
        top, head = git("rev-parse", "--show-toplevel", "HEAD").splitlines()
        changes = [line[3:] for line in git("status", "--porcelain").splitlines()]  # "XY path"
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    # installed into site-packages inside some other repository, HEAD would be that repository's commit
    if Path(top).resolve() != checkout:
        return {}
    tags = {"mlflow.source.git.commit": head, "alignflow.git.dirty": str(bool(changes)).lower()}
    if changes:
        tags["alignflow.git.changes"] = _truncated(f"{len(changes)} changed: {', '.join(changes)}")
    return tags


def require_tracking_server() -> None:
    """An http(s) MLFLOW_TRACKING_URI answers its health check (asked through MLflow's own client: its TLS and auth
    settings), else one AlignflowError line: MLflow's client retried an unreachable one for 4.5 minutes."""
    uri = USER_TRACKING_URI or ""
    if not uri.startswith(("http://", "https://")):
        return
    from mlflow.tracking._tracking_service.utils import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        response = http_request(get_default_host_creds(uri), "/health", "GET", max_retries=0, timeout=5)
        error = None if response.ok else f"HTTP {response.status_code}"
    except Exception as exc:  # noqa: BLE001 - every failure of the check is the same one-line error
        error = one_line(exc, width=200)
    if error is not None:
        raise AlignflowError(f"the MLflow server at {uri} (MLFLOW_TRACKING_URI) fails its health check ({error}); "
                             "start it, or unset MLFLOW_TRACKING_URI to track in the workspace")


def _end_stale_runs(experiment_id: str) -> None:
    """Mark KILLED the RUNNING runs whose process on this host is gone (a SIGKILLed stage)."""
    client = MlflowClient()
    for run in client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'"):
        pid = run.data.tags.get("alignflow.pid")
        ours = run.data.tags.get("alignflow.host") == host_id()
        if not ours or not pid or int(pid) == os.getpid() or process_alive(int(pid)):
            continue
        client.set_terminated(run.info.run_id, status="KILLED")
        client.set_tag(run.info.run_id, "alignflow.error", f"process {pid} ended without closing the run")


def _run_to_resume(workspace: Workspace, experiment_id: str, stage: str, params: Mapping[str, str],
                   data_fingerprint: str | None) -> str | None:
    """The latest KILLED or FAILED run of this stage with these params, data and code in this workspace that no run
    resumed yet: the run a rerun continues from its last checkpoint (a failure, such as a full disk, leaves one as a
    kill does; other data or code trains in another dir, from the start; another workspace sharing the tracking
    store has its own checkpoints). `KEEPING_FIELDS` are left out of the comparison: a new `save_every` resumes
    the same run."""
    client = MlflowClient()
    ended = client.search_runs([experiment_id], order_by=["attributes.start_time DESC"],
                               filter_string="attributes.status != 'FINISHED' and attributes.status != 'RUNNING'")
    inputs = {"alignflow.code": code_version(), "data.fingerprint": data_fingerprint,
              "alignflow.workspace": str(workspace.root)}
    for run in ended:
        same_inputs = all(run.data.tags.get(key) == value for key, value in inputs.items())
        if run.info.run_name == stage and same_inputs and _run_params(run.data.params) == _run_params(params):
            resumed = client.search_runs([experiment_id], max_results=1,
                                         filter_string=f"tags.`alignflow.resumes` = '{run.info.run_id}'")
            return None if resumed else run.info.run_id
    return None


def _carry_history(resumed: str, run_id: str, before_step: int) -> None:
    """Copy the points of the resumed (killed or failed) run logged before `before_step`, the first step this run
    logs (the first it logs after its checkpoint: with `log_every` > 1, past the checkpoint's step), into this run:
    its curves start at step 0, as an uninterrupted run's do. The steps the resumed run logged after its checkpoint
    are left out: this run computes them again. The tag `alignflow.carried_before_step` says from which step the
    points are this run's own. A resumed run killed before it logged anything (a Ctrl-C while its model loaded)
    holds no points: they are in the run it resumed in turn."""
    client = MlflowClient()
    run = client.get_run(resumed)
    while not run.data.metrics and "alignflow.resumes" in run.data.tags:  # (each resumes an earlier run)
        run = client.get_run(run.data.tags["alignflow.resumes"])
    points = [point for key in run.data.metrics
              for point in client.get_metric_history(run.info.run_id, key) if point.step < before_step]
    for start in range(0, len(points), CARRY_BATCH):
        client.log_batch(run_id, metrics=points[start:start + CARRY_BATCH])
    client.set_tag(run_id, "alignflow.carried_before_step", str(before_step))


def metric_history(keys: list[str]) -> list[tuple[int, dict[str, float]]]:
    """The active run's points of `keys` as (step, {key: value}) in step order: its curves, carried ones included."""
    client = MlflowClient()
    run_id = mlflow.active_run().info.run_id
    steps: dict[int, dict[str, float]] = {}
    for key in keys:
        for point in sorted(client.get_metric_history(run_id, key), key=lambda point: (point.step, point.timestamp)):
            steps.setdefault(point.step, {})[key] = point.value
    return sorted(steps.items())


def _run_params(params: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in params.items() if key not in KEEPING_FIELDS}


class _DropCaughtDatabaseErrors(logging.Filter):
    """MLflow's sqlite store logs each failed operation with its traceback and SQL, then raises it again as an
    MlflowException, which reaches the stage and is reported there (a full disk printed 9 such tracebacks)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("SQLAlchemy database error.")


logging.getLogger("mlflow.store.db.utils").addFilter(_DropCaughtDatabaseErrors())


class DiskFullError(AlignflowError):
    """A write failed for want of disk space (the store, MLflow's database or artifacts, a model dir), or past the
    user's disk quota or file-size limit."""


# errno -> (its text, as libraries that drop the errno quote it (DuckDB: `Could not write file ...: File too large`),
# what the user reads, what to do)
_NO_ROOM = {
    errno.ENOSPC: ("No space left on device", "no space left on the disk", "free some"),
    errno.EDQUOT: ("Disk quota exceeded", "the disk quota is used up", "free some"),
    errno.EFBIG: ("File too large", "a file reached the file-size limit (ulimit -f)", "raise it"),
}


def _raise_if_disk_full(exc: BaseException) -> None:
    """A full disk anywhere under a stage (MLflow's sqlite store: 'database or disk is full'; its artifact copy: an
    OSError ENOSPC; the DuckDB store's write-ahead log), a used-up quota or a file-size limit, as one DiskFullError
    line, not the tracebacks of whichever library hit it first; an AlignflowError says it already (a checkpoint
    write)."""
    if isinstance(exc, AlignflowError):
        return
    for cause in (exc, exc.__cause__, exc.__context__):
        text = str(cause)
        if "database or disk is full" in text:  # its message goes on with the SQL and its parameters
            number, detail = errno.ENOSPC, f"{type(cause).__name__}: an sqlite database (MLflow's) is full"
        else:
            number = next((n for n, (quoted, _, _) in _NO_ROOM.items()
                           if getattr(cause, "errno", None) == n or quoted in text), None)
            detail = one_line(cause, width=300)
        if number is None:
            continue
        _, what, fix = _NO_ROOM[number]
        raise DiskFullError(f"{what} ({detail}); {fix} and rerun: a training stage resumes from its last "
                            "checkpoint") from exc


def _end_failed(exc: BaseException) -> None:
    """End the active run with the reason as a tag (MLflow has no field for it): KILLED when the user interrupted
    it (a rerun resumes it, as it does a killed process's run), else FAILED. A store that cannot take it (a full
    disk) leaves the run RUNNING, for the workspace's next run to end."""
    interruption = _interruption(exc)
    status, reason = ("KILLED", f"interrupted ({interruption})") if interruption else \
        ("FAILED", one_line(exc, width=5000))
    with contextlib.suppress(Exception):
        mlflow.set_tag("alignflow.error", reason)
        mlflow.end_run(status=status)


def _interruption(exc: BaseException) -> str | None:
    """How the user stopped a run, or None for a failure: Ctrl-C, or a signal that Prefect's engine raised as its
    TerminationSignal (SIGTERM: a cancel in Prefect's UI, a `serve` stopped mid-run, a `kill`), which was recorded
    as a failure with an empty reason."""
    if isinstance(exc, KeyboardInterrupt):
        return "Ctrl-C"
    number = getattr(exc, "signal", None)
    if not isinstance(exc, Exception) and isinstance(number, int):
        return signal.Signals(number).name
    return None


def log_figure(figure: Any, artifact_file: str, *, run_id: str | None = None) -> None:
    """Into the active run of this thread, or into `run_id` (e.g. the pipeline run, from a task thread)."""
    if run_id:
        MlflowClient().log_figure(run_id, figure, artifact_file)
    else:
        mlflow.log_figure(figure, artifact_file)


def log_model(path: str | Path) -> None:
    """A stage's model dir into the active run under `model/`, and the tag `alignflow.model_path` naming it.
    Up to $ALIGNFLOW_MLFLOW_MODEL_MIB MiB (default 1024) the whole dir is copied; above it, its files of at most
    64 MiB that are not weights (shards of any size) are, and `model/not_copied.json` lists the others with their
    sizes and the dir they are in. A model an earlier run of the experiment copied (the same content: a stage
    returning its finished final, or retrained to the same weights) is not copied again: the tag
    `alignflow.model_logged_in` names that run."""
    path = Path(path).resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"model dir {path}: not a directory")
    files = {file: file.stat().st_size for file in sorted(path.rglob("*")) if file.is_file()}
    mlflow.set_tag("alignflow.model_path", str(path))
    content = model_fingerprint(path)
    run = mlflow.active_run()
    copied = MlflowClient().search_runs([run.info.experiment_id], max_results=1,
                                        filter_string=f"tags.`{MODEL_COPY_TAG}` = '{content}'")
    if copied:
        mlflow.set_tag("alignflow.model_logged_in", copied[0].info.run_id)
        return
    if sum(files.values()) <= model_copy_limit() * 2**20:
        mlflow.log_artifacts(str(path), "model")
    else:
        not_copied = {}
        for file, size in files.items():
            relative = file.relative_to(path)
            if size <= SMALL_FILE_BYTES and not file.name.endswith(WEIGHT_SUFFIXES):
                mlflow.log_artifact(str(file), str(Path("model", relative.parent)))
            else:
                not_copied[relative.as_posix()] = size
        mlflow.log_dict({"model_path": str(path), "bytes": not_copied}, "model/not_copied.json")
    mlflow.set_tag(MODEL_COPY_TAG, content)  # once the copy is whole


def model_copy_limit() -> int:
    """$ALIGNFLOW_MLFLOW_MODEL_MIB as a whole number of MiB (default 1024 when unset or empty), else a one-line
    error."""
    text = os.environ.get(MODEL_COPY_ENV) or str(DEFAULT_MODEL_COPY_MIB)
    if not text.strip().isdecimal():
        raise AlignflowError(f"${MODEL_COPY_ENV}: expected a whole number of MiB (0 copies only config and "
                             f"tokenizer files), got {text!r}")
    return int(text)


def log_dict(value: Mapping[str, Any], artifact_file: str, *, run_id: str | None = None) -> None:
    if run_id:
        MlflowClient().log_dict(run_id, dict(value), artifact_file)
    else:
        mlflow.log_dict(dict(value), artifact_file)


def set_tags(tags: Mapping[str, str], *, run_id: str | None = None) -> None:
    if run_id:
        MlflowClient().log_batch(run_id, tags=[RunTag(key, value) for key, value in tags.items()])
    else:
        mlflow.set_tags(dict(tags))


def log_metrics(metrics: Mapping[str, float], *, run_id: str) -> None:
    """Step-0 metrics into `run_id` (e.g. the pipeline run, from a task thread)."""
    MlflowClient().log_batch(run_id, metrics=[Metric(key, float(value), int(time.time() * 1000), 0)
                                              for key, value in metrics.items()])


def find_runs(workspace: Workspace, filter_string: str = "") -> list[Any]:
    """Runs of the workspace experiment (newest first), for tests and `alignflow` summaries."""
    experiment_id = configure(workspace)
    return MlflowClient(workspace.tracking_uri).search_runs(
        [experiment_id], filter_string=filter_string, order_by=["attributes.start_time DESC"]
    )



def log_text(text: str, artifact_file: str, *, run_id: str | None = None) -> None:
    if run_id:
        MlflowClient().log_text(run_id, text, artifact_file)
    else:
        mlflow.log_text(text, artifact_file)

