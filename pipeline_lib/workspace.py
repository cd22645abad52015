"""The workspace directory (store, MLflow, Prefect home, models) and the offline settings, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Offline/quiet defaults measured on these machines (ENVIRONMENT.md): without HF_HUB_OFFLINE a
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
}
# A tracking server the user chose, read once at import: mlflow.set_tracking_uri() later writes this
# variable itself, which must not make one workspace log into another's database.
USER_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI")


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
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def tracking_uri(self) -> str:
        """MLFLOW_TRACKING_URI when the user runs a server, else the workspace's sqlite file."""
        return USER_TRACKING_URI or f"sqlite:///{self.mlflow_db}"

    def create(self) -> "Workspace":
        for path in (self.root, self.mlflow_artifacts, self.prefect_home, self.models_dir, self.runs_dir):
            path.mkdir(parents=True, exist_ok=True)
        return self


def resolve_workspace(path: str | Path | None = None) -> Workspace:
    """`path` (--workspace) > $ALIGNFLOW_HOME > ./.alignflow, made absolute."""
    chosen = path or os.environ.get("ALIGNFLOW_HOME") or ".alignflow"
    return Workspace(Path(chosen).expanduser().resolve())


def apply_environment(workspace: Workspace) -> Workspace:
    """Set the offline settings and point PREFECT_HOME / ALIGNFLOW_HOME at the workspace.

    Call before prefect is imported: Prefect reads PREFECT_HOME when its settings load.
    Values the user already exported win (setdefault)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["ALIGNFLOW_HOME"] = str(workspace.root)
    os.environ.setdefault("PREFECT_HOME", str(workspace.prefect_home))
    return workspace.create()
