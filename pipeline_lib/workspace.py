"""The workspace directory (store, MLflow, Prefect home, models), the offline settings, and the run lock that
keeps two pipeline/stage runs off the same workspace."""

from __future__ import annotations

import fcntl
import os
import re
import resource
import shlex
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from pipeline_lib.errors import AlignflowError

# Offline/quiet/locked-down defaults measured on CPU machines without internet: without HF_HUB_OFFLINE a
# missing hub id retries for ~46 s; Prefect's telemetry prints "database is locked" tracebacks.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # a fresh workspace's first run creates Prefect's database (~12 s on 2 cores); under load that passed
    # Prefect's 20 s default and the run died with "Timed out while attempting to connect"
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # Prefect's server answers any web page's requests by default (CORS `*`, no CSRF check): a page open in the
    # user's browser could read the runs and create or trigger them on 127.0.0.1. No cross-origin request is
    # allowed (`alignflow ui` allows its own UI's origins), and a change needs a CSRF token, which Prefect's client
    # and UI fetch themselves.
    "PREFECT_SERVER_CSRF_PROTECTION_ENABLED": "true",
    "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": "",
}
# The interfaces gloo's pair sockets and NCCL's bootstrap listen on unless the user names one (a torchrun stage's
# processes, the NCCL weight transfer, the vLLM server's own): by default the hostname's address or the first
# interface that is not loopback, reachable from the network, where alignflow's processes all meet on one machine.
LOOPBACK_INTERFACES = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
# A tracking server the user chose, read once at import: mlflow.set_tracking_uri() later writes this
# variable itself, which must not make one workspace log into another's database.
USER_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI")


MIN_ROOM_MIB = 64  # Prefect's new database takes 1.3 MiB, then grows with its runs, as the store with the data


class WorkspaceError(AlignflowError):
    """A workspace dir that cannot be made."""


@dataclass(frozen=True)
class Workspace:
    """Paths of one workspace; `root` defaults to ./.alignflow."""

    root: Path

    @property
    def store_path(self) -> Path:
        return self.root / "store.duckdb"

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def prefect_home(self) -> Path:
        return self.root / "prefect"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def lock_path(self) -> Path:
        return self.root / "run.lock"

    @property
    def tracking_uri(self) -> str:
        """MLFLOW_TRACKING_URI when the user runs a server, else the workspace's sqlite file."""
        return USER_TRACKING_URI or f"sqlite:///{self.mlflow_db}"

    def command(self, *args: str) -> str:
        """The `alignflow` command line running `args` in this workspace, shell-quoted (advice a user can paste)."""
        return shlex.join(["alignflow", "-w", str(self.root), *args])

    def create(self) -> "Workspace":
        if self.root.exists() and not self.root.is_dir():
            raise WorkspaceError(f"workspace {self.root}: a file, not a directory; pass another --workspace")
        for path in (self.root, self.mlflow_artifacts, self.prefect_home, self.models_dir):
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # the path or a parent is a file, /dev/null/x, no permission, disk full
                raise WorkspaceError(f"workspace {self.root}: cannot create {path} ({exc.strerror or exc})") from None
        # a part made read-only (its permissions, a read-only mount) failed deep in sqlite, Prefect's server (which
        # restarted for minutes) or MLflow, with tracebacks
        parts = (self.root, self.mlflow_artifacts, self.prefect_home, self.models_dir, self.store_path,
                 self.mlflow_db, self.prefect_home / "prefect.db")
        for path in parts:
            if path.exists() and not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
                raise WorkspaceError(f"workspace {self.root}: {path} is not writable (its permissions or a read-only "
                                     "file system); make it writable, or pass another --workspace")
        self._check_room()
        return self

    def _check_room(self) -> None:
        """Room for the databases a command starts with: on a nearly full disk, or under a small file-size limit
        (`ulimit -f`), Prefect's server failed to create its database and restarted for 4 minutes (3,748 lines of
        tracebacks); a limit reached later is the stage's one-line DiskFullError."""
        free = shutil.disk_usage(self.root).free
        if free < MIN_ROOM_MIB << 20:
            raise WorkspaceError(f"workspace {self.root}: {free >> 20} MiB free on its disk, under the {MIN_ROOM_MIB} "
                                 "MiB a command needs for its databases (Prefect's, MLflow's, the store); free some "
                                 "(README: Disk space), or pass another --workspace")
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and limit < MIN_ROOM_MIB << 20:
            raise WorkspaceError(f"a file-size limit (ulimit -f) of {limit >> 10} KiB, under the {MIN_ROOM_MIB} MiB "
                                 "the workspace's databases need; raise it (`ulimit -f unlimited`)")


def resolve_workspace(path: str | Path | None = None) -> Workspace:
    """`path` (--workspace) > $ALIGNFLOW_HOME > ./.alignflow, made absolute. WorkspaceError for an empty path (a
    script's unset variable: it made the current directory the workspace), a current directory deleted since the
    shell entered it, and a path its databases' URLs cannot name."""
    if path is not None and not str(path).strip():
        raise WorkspaceError("--workspace is empty; name a directory (or leave it out: $ALIGNFLOW_HOME, else "
                             "./.alignflow)")
    try:
        os.getcwd()
    except FileNotFoundError:
        raise WorkspaceError("the current directory no longer exists (deleted since the shell entered it); cd to "
                             "another one") from None
    chosen = path or os.environ.get("ALIGNFLOW_HOME") or ".alignflow"
    root = Path(chosen).expanduser().resolve()
    if "?" in str(root) or re.search(r"%[0-9A-Fa-f]{2}", str(root)):
        # Prefect's and MLflow's sqlite URLs end the path at `?` and decode `%41` as `A`: their databases went
        # elsewhere (outside the workspace, shared), or Prefect's server retried for minutes
        raise WorkspaceError(f"workspace {root}: a path with '?' or '%' and two hex digits cannot be a database URL's "
                             "(Prefect's, MLflow's); pick another path")
    return Workspace(root)


def host_id() -> str:
    """This host and its pid namespace: a pid means something only inside its namespace (containers)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc (macOS)
        return socket.gethostname()
    return f"{socket.gethostname()} {namespace}"


def process_alive(pid: int, started: float | None = None) -> bool:
    """Whether process `pid` on this host runs (a zombie, exited but not reaped, does not); with `started` (its
    psutil create_time), only if it is that same process and not a later one the system gave its pid to."""
    try:
        process = psutil.Process(pid)
        # start times are computed from the boot time, which the kernel may report a little differently later
        same = started is None or abs(process.create_time() - started) < 1.0
        return same and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def apply_environment(workspace: Workspace) -> Workspace:
    """Set the offline settings and point PREFECT_HOME / ALIGNFLOW_HOME at the workspace; creates nothing (a
    command that writes creates the workspace, so a mistyped --workspace given to a reading one leaves no dirs).

    Call before prefect is imported: Prefect reads PREFECT_HOME when its settings load.
    Values the user already exported win (setdefault)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    if not os.environ.get("PREFECT_API_URL", "x").strip():  # exported empty to unset it: Prefect read it as a URL
        del os.environ["PREFECT_API_URL"]
    os.environ["ALIGNFLOW_HOME"] = str(workspace.root)
    os.environ.setdefault("PREFECT_HOME", str(workspace.prefect_home))
    return workspace


class WorkspaceLockedError(AlignflowError):
    """Another process holds the workspace's run lock."""


# lock files this process holds: the CLI takes the lock and the pipeline flow it runs takes it again
_HELD: set[Path] = set()


@contextmanager
def workspace_lock(workspace: Workspace, holder: str,
                   remedy: str = "wait for it to finish or pass another --workspace") -> Iterator[None]:
    """Hold the workspace's run lock while a pipeline or stage runs; re-entrant within one process. `remedy` ends
    the error a second process gets: what its user can do (a deployment run's cannot pass --workspace).

    An flock on `run.lock`: the kernel drops it when the holder exits, SIGKILL included, so a file left
    behind never blocks a later run. A second process gets a one-line WorkspaceLockedError naming the
    holder's pid and command at once, before it opens the store or starts Prefect. The descriptor is not
    inherited (O_CLOEXEC), so a server the run started cannot keep the lock after it."""
    path = workspace.lock_path
    if path in _HELD:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # a read-only workspace, another user's run.lock
        raise WorkspaceError(f"workspace {workspace.root}: cannot open its lock file {path} for writing "
                             f"({exc.strerror or exc}); pass a workspace you can write to") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        # the holder writes "pid command" once it has the lock; empty only in that instant
        owner = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        pid, _, command = owner.partition(" ")
        raise WorkspaceLockedError(
            f"workspace {workspace.root} is in use by alignflow process {pid or '(pid not written yet)'} "
            f"({command or 'unknown command'}); {remedy}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {holder}\n".encode(), 0)
        _HELD.add(path)
        yield
    finally:
        _HELD.discard(path)
        os.close(fd)  # closing the descriptor releases the flock
