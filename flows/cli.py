"""`alignflow` command line (typer): every command sets up the workspace, then runs a flow.

Lives in flows/ because it sits on top of the layers (cli -> flows -> tasks -> pipeline_lib);
prefect is imported only after the workspace has set PREFECT_HOME and the offline settings."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import click
import typer

from pipeline_lib.errors import AlignflowError
from pipeline_lib.workspace import apply_environment, resolve_workspace

app = typer.Typer(help="alignflow: reproducible LLM alignment pipelines (Prefect + MLflow + DuckDB).",
                  no_args_is_help=True, pretty_exceptions_enable=False)
data_app = typer.Typer(help="Inspect the data store.", no_args_is_help=True)
app.add_typer(data_app, name="data")

REPO_DATA = Path(__file__).resolve().parents[1] / "data"


@app.callback()
def main(
    workspace: Optional[Path] = typer.Option(
        None, "--workspace", "-w", help="Workspace dir (default $ALIGNFLOW_HOME or ./.alignflow)."
    ),
) -> None:
    apply_environment(resolve_workspace(workspace))


def fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def run_cli() -> None:
    """Entry point: one-line errors instead of tracebacks for user mistakes."""
    try:
        code = app(standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except AlignflowError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    sys.exit(code or 0)


@app.command()
def ingest(
    path: Path = typer.Argument(..., help="A .jsonl, .jsonl.gz, .json, .parquet or .csv file."),
    format: str = typer.Option("auto", "--format", "-f", help="auto|pairs|hh|chat|ranking|problem"),
    source: Optional[str] = typer.Option(None, "--source", "-s", help="Source name (default: file name)."),
    split: Optional[str] = typer.Option(None, "--split", help="Split for problems (default: train)."),
) -> None:
    """Validate a data file into the store; bad rows go to the quarantine with a reason."""
    from pipeline_lib.config import IngestConfig, validate_config

    cfg = validate_config(IngestConfig, {"path": str(path), "format": format, "source": source, "split": split},
                          origin="alignflow ingest")
    if not path.is_file():
        fail(f"{path}: no such file")
    from flows.ingest import ingest_flow

    ingest_flow(cfg)


@data_app.command("stats")
def data_stats() -> None:
    """Row counts per table and source."""
    from pipeline_lib.store.db import open_store

    workspace = resolve_workspace()
    with open_store(workspace.store_path, read_only=True) as store:
        frame = store.stats()
    typer.echo(f"store: {workspace.store_path}")
    typer.echo(frame if frame.height else "(empty)")


if __name__ == "__main__":
    run_cli()
