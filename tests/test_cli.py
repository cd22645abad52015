"""The `alignflow` CLI as a user runs it: --help everywhere, one-line errors, ingest + data stats."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

DATA = Path(__file__).resolve().parents[1] / "data"


def alignflow(*args: str, workspace: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"ALIGNFLOW_HOME": str(workspace)}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=cwd)


@pytest.mark.parametrize("command", [[], ["ingest"], ["run"], ["sample"], ["eval"], ["demo"], ["serve"],
                                     ["ui"], ["data", "stats"], ["data", "delete"], ["vllm-env"]])
def test_help_everywhere(tmp_path, command):
    result = alignflow(*command, "--help", workspace=tmp_path / "ws")
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout
    assert not (tmp_path / "ws").exists()  # asking for help creates no workspace
    assert ("--trust-remote-code" in result.stdout) == (command in (["sample"], ["eval"]))  # off unless given


def test_vllm_env_builds_where_the_samplers_look_from_any_directory(tmp_path):
    """`alignflow vllm-env` built ./.venv-vllm in the current directory, where the samplers never look (they read
    <checkout>/.venv-vllm or $ALIGNFLOW_VLLM_PYTHON), though their error names this command: the default is now
    the checkout's. A venv built elsewhere on purpose is told how to reach them. (A stamped venv: nothing is
    installed.)"""
    from pipeline_lib.sampling.vllm_env import STAMP, _plan

    elsewhere = tmp_path / "venvs" / "vllm"
    (elsewhere / "bin").mkdir(parents=True)
    (elsewhere / "bin" / "python").write_text("")
    (elsewhere / STAMP).write_text(__import__("json").dumps(_plan(cuda=False)))
    result = alignflow("vllm-env", "--cpu", "--venv", "vllm", workspace=tmp_path / "ws", cwd=tmp_path / "venvs")
    assert result.returncode == 0, result.stderr
    python = elsewhere / "bin" / "python"
    assert result.stdout.splitlines() == [f"vllm python: {python}",
                                          f"the samplers use it with: export ALIGNFLOW_VLLM_PYTHON={python}"]


@pytest.mark.parametrize("args, expected", [
    (["ingest", "/no/such.jsonl"], "error: /no/such.jsonl: no such file"),
    (["ingest", str(DATA)], f"error: {DATA}: is a directory, expected a data file"),
    (["ingest", "/dev/zero"], "error: /dev/zero: is a character device, expected a data file"),
    (["ingest", str(DATA / "gsm8k" / "LICENSE")], f"error: {DATA / 'gsm8k' / 'LICENSE'}: unknown file type; expected"),
    (["run", "nosuch", "--config", "x.yaml"], "error: unknown stage 'nosuch'"),
    (["eval", "--model", "/no/model"], "error: /no/model: no such model dir"),
    (["eval", "--model", str(DATA / "gsm8k" / "LICENSE")], f"error: {DATA / 'gsm8k' / 'LICENSE'}: a file; expected"),
    (["eval", "--model", str(DATA), "--n", "2000"], "error: alignflow eval: field 'n': Input should be less than or "
                                                    "equal to 1024"),
    (["ingest", str(DATA / "demo" / "pairs.jsonl"), "--format", "xml"], "error: alignflow ingest: field 'format'"),
    (["eval", "--model", str(DATA), "--ks", "1,a"], "error: alignflow eval: field 'ks.1': Input should be a valid integer"),
    (["eval", "--model", str(DATA), "--top-p", "0"], "error: alignflow eval: field 'top_p': Input should be greater "
                                                     "than 0"),
    (["eval", "--model", str(DATA), "--temperature", "-1"], "error: alignflow eval: field 'temperature'"),
    (["sample", "--model", str(DATA), "--seed", "-1"], "error: alignflow sample: field 'seed': Input should be greater "
                                                       "than or equal to 0"),
    (["ingest", str(DATA / "demo" / "pairs.jsonl"), "--max-record-bytes", "0"],
     "error: alignflow ingest: field 'max_record_bytes': Input should be greater than or equal to 1"),
    (["run", "pipeline", "--config", "x.yaml", "--force", "sfft"],
     "error: --force 'sfft': expected one of base, sft, rm, sample, rs_sft, dpo, grpo, dapo, ppo, eval"),
    (["run", "sft", "--config", "x.yaml", "--force", "dpo"], "error: --force 'dpo': expected one of sft"),
])
def test_user_errors_are_one_line(tmp_path, args, expected):
    result = alignflow(*args, workspace=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_workspace_that_cannot_be_made_is_one_line(tmp_path, where):
    (tmp_path / "f").write_text("x")
    workspace = tmp_path / "f" if where == "a file" else tmp_path / "f" / "ws"
    result = alignflow("ingest", str(DATA / "demo" / "pairs.jsonl"), workspace=workspace)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    expected = "a file, not a directory; pass another --workspace" if where == "a file" else f"cannot create {workspace} ("
    assert len(lines) == 1 and lines[0].startswith(f"error: workspace {workspace}: {expected}"), \
        result.stderr


@pytest.mark.parametrize("part", ["mlflow.db", "prefect", "mlartifacts", "models", "store.duckdb", "."])
def test_a_read_only_part_of_the_workspace_is_one_line(tmp_path, part):
    """Each gave tracebacks: sqlite's "attempt to write a readonly database" from MLflow, a Prefect server restarting
    for minutes, a PermissionError from MLflow's artifact store. Run as root (CI), the capabilities that let root
    write anywhere are dropped for the command."""
    workspace = tmp_path / "ws"
    assert alignflow("ingest", str(DATA / "demo" / "pairs.jsonl"), workspace=workspace).returncode == 0
    target = workspace / part
    target.chmod(target.stat().st_mode & ~0o222)
    caps = "-dac_override,-dac_read_search,-fowner"
    prefix = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"] if os.geteuid() == 0 else []
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"ALIGNFLOW_HOME": str(workspace)}
    command = [*prefix, sys.executable, "-m", "flows.cli", "ingest", str(DATA / "demo" / "pairs.jsonl")]
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    finally:
        target.chmod(target.stat().st_mode | 0o200)
    named = workspace if part == "." else target
    assert (result.returncode, result.stderr) == (2, f"error: workspace {workspace}: {named} is not writable (its "
                                                     "permissions or a read-only file system); make it writable, or "
                                                     "pass another --workspace\n")

@pytest.mark.parametrize("case", ["empty -w", "? in -w", "%41 in -w", "lock unopenable", "prefect down",
                                  "mlflow down", "serve, prefect down", "config a device", "cwd deleted"])
def test_what_a_user_brings_in_paths_and_environment_is_one_line(tmp_path, case):
    """Each took a traceback or minutes: `-w ""` made the current dir the workspace; `?` put Prefect's and MLflow's
    databases outside it (one shared file), `%41` read as `A` let Prefect's server retry for 4 minutes, as did a
    deleted current dir; an unopenable run.lock, an exported server URL that is down (MLflow's client retried for
    4.5 minutes), `--config <(...)` called "not found". The helper's cases, each now one line at once."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "ALIGNFLOW_HOME")}
    data, cwd = str(DATA / "demo" / "pairs.jsonl"), tmp_path
    workspace, args, expected, advice = str(tmp_path / "ws"), ["ingest", data], None, ""
    if case == "empty -w":
        workspace, expected = "", "error: --workspace is empty; name a directory"
    elif case in ("? in -w", "%41 in -w"):
        workspace = str(tmp_path / ("exp?a" if case == "? in -w" else "p%41"))
        expected = f"error: workspace {workspace}: a path with '?' or '%' and two hex digits cannot be"
    elif case == "lock unopenable":
        (tmp_path / "ws" / "run.lock").mkdir(parents=True)
        expected = f"error: workspace {workspace}: cannot open its lock file {workspace}/run.lock for writing"
    elif case == "prefect down":
        env["PREFECT_API_URL"] = "http://127.0.0.1:9/api"
        expected = "error: the Prefect server at http://127.0.0.1:9/api (PREFECT_API_URL) fails its health check ("
        # a helper: "start it (`alignflow ui`)" started one on 4200, which the error named again
        advice = f"start it (`alignflow -w {workspace} ui --prefect-port 9`), or unset PREFECT_API_URL to run on a " \
                 "temporary one"
    elif case == "mlflow down":
        env["MLFLOW_TRACKING_URI"] = "http://127.0.0.1:9"
        expected = "error: the MLflow server at http://127.0.0.1:9 (MLFLOW_TRACKING_URI) fails its health check ("
    elif case == "serve, prefect down":  # serve's own advice: it needs a server (the review: it said "unset" it)
        env["PREFECT_API_URL"] = "http://127.0.0.1:9/api"
        args = ["serve", "--config", str(Path(__file__).resolve().parents[1] / "flows" / "configs" / "demo.yaml")]
        expected = "error: no Prefect server at http://127.0.0.1:9/api (ConnectError: [Errno 111] Connection refused)"
        advice = f"; start it (`alignflow -w {workspace} ui --prefect-port 9`)"  # PREFECT_API_URL is set already
    elif case == "config a device":
        args, expected = ["run", "sft", "--config", "/dev/null"], "error: /dev/null: not a regular file (a pipe or"
    else:
        cwd = tmp_path / "gone"
        cwd.mkdir()
        args, expected = ["-c", f"import os, sys; os.rmdir({str(cwd)!r}); sys.argv[1:] = ['ingest', {data!r}]; "
                                "import flows.cli; flows.cli.run_cli()"], "error: the current directory no longer"
    command = [sys.executable, *args] if case == "cwd deleted" else [sys.executable, "-m", "flows.cli", "-w",
                                                                    workspace, *args]
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, cwd=cwd)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert (result.returncode, len(lines)) == (2, 1) and lines[0].startswith(expected), result.stderr
    assert lines[0].endswith(advice), result.stderr
    assert time.perf_counter() - started < 60
    assert not (tmp_path / "store.duckdb").exists() and not (tmp_path / "exp").exists()


@pytest.mark.parametrize("files, expected", [
    ({}, "no config.json; expected a Hugging Face model directory"),
    ({"config.json": "{}", "pytorch_model.bin": "x"}, "only pickle weights (pytorch_model.bin); convert them"),
    # an adapter's weights passed for the model's (any *.safetensors did): failed 23 s later inside the flow (a helper)
    ({"config.json": "{}", "adapter_model.safetensors": "", "pytorch_model.bin": "x"},
     "only pickle weights (pytorch_model.bin); convert them"),
    ({"config.json": "{}", "adapter_model.safetensors": ""},
     "no model.safetensors (nor model.safetensors.index.json); adapter_model.safetensors are not the model's weights"),
    ({"config.json": "{}", "model.safetensors": "fifo"}, "no model.safetensors (nor model.safetensors.index.json)"),
], ids=["empty", "pickle", "adapter-and-pickle", "adapter", "fifo"])
def test_a_model_dir_loading_would_refuse_fails_before_the_stage_starts(tmp_path, files, expected):
    model = tmp_path / "model"
    model.mkdir()
    for name, text in files.items():
        if text == "fifo":  # a reader of it would wait for a writer
            os.mkfifo(model / name)
        else:
            (model / name).write_text(text)
    config = tmp_path / "sft.yaml"
    config.write_text(f"model_path: {model}\nsource: demo\n")
    result = alignflow("run", "sft", "--config", str(config), workspace=tmp_path / "ws")
    assert result.returncode == 2
    assert result.stderr.strip().startswith(f"error: {config}: field 'model_path': model dir {model}: {expected}"), \
        result.stderr
    assert not (tmp_path / "ws").exists()
    for command in ("eval", "sample"):  # --model of the two commands that take a dir, not a config
        result = alignflow(command, "--model", str(model), workspace=tmp_path / "ws")
        assert result.returncode == 2
        assert result.stderr.strip().startswith(f"error: --model: model dir {model}: {expected}"), result.stderr
        assert not (tmp_path / "ws").exists()


def test_a_stage_dir_given_for_its_model_points_at_final(tmp_path):
    """A stage's dir (models/<stage>/<key>) holds its model in final/: the error says where."""
    stage_dir = tmp_path / "models" / "sft" / "abc"
    (stage_dir / "final").mkdir(parents=True)
    (stage_dir / "final" / "config.json").write_text("{}")
    result = alignflow("sample", "--model", str(stage_dir), workspace=tmp_path / "ws")
    assert (result.returncode, result.stderr.strip()) == (2, (
        f"error: --model: model dir {stage_dir}: no config.json; expected a Hugging Face model directory (a stage's "
        f"dir? its model is {stage_dir / 'final'})"))


def test_a_stage_s_models_dir_given_for_a_model_points_at_its_newest_run(tmp_path):
    """models/<stage> holds one run per key; models/<stage>/final does not exist: both errors name the newest run's
    model."""
    stage = tmp_path / "models" / "sft"
    for key, mtime in (("new", 2_000_000_000), ("old", 1_000_000_000)):
        (stage / key / "final").mkdir(parents=True)
        (stage / key / "final" / "config.json").write_text("{}")
        os.utime(stage / key / "final" / "config.json", (mtime, mtime))
    hint = f" (a stage's dir? its newest model is {stage / 'new' / 'final'})"
    result = alignflow("eval", "--model", str(stage), workspace=tmp_path / "ws")
    assert (result.returncode, result.stderr.strip()) == (2, (
        f"error: --model: model dir {stage}: no config.json; expected a Hugging Face model directory{hint}"))
    result = alignflow("sample", "--model", str(stage / "final"), workspace=tmp_path / "ws")
    assert (result.returncode, result.stderr.strip()) == (2, f"error: {stage / 'final'}: no such model dir{hint}")


def test_a_policy_dir_given_as_the_reward_model_fails_before_the_stage_starts(tmp_path):
    policy = tmp_path / "policy"  # what the check reads of a policy dir: its config and a safetensors file
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    (policy / "model.safetensors").write_bytes(b"")
    config = tmp_path / "ppo.yaml"
    config.write_text(f"policy_path: {policy}\nreward_model_path: {policy}\n")
    result = alignflow("run", "ppo", "--config", str(config), workspace=tmp_path / "ws")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: {config}: field 'reward_model_path': {policy}: not a reward model "
                                     "dir (needs reward_config.json and reward_head.safetensors); alignflow's rm "
                                     "stage (`from:rm` in a pipeline) writes one"), result.stderr
    assert not (tmp_path / "ws").exists()


def test_data_quarantine_lists_each_files_reasons(tmp_path):
    import polars as pl

    from pipeline_lib.store.db import open_store
    from pipeline_lib.store.ingest import ingest_file

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": 1, "rejected": "c"}\n'
                    'not json\n{"prompt": "d", "chosen": 2, "rejected": "e"}\n')
    table = tmp_path / "p.parquet"  # its second row is bad: `row 2`, counted from 1 as the lines are
    pl.DataFrame({"prompt": ["a", "b"], "chosen": ["b", "same"], "rejected": ["c", "same"]}).write_parquet(table)
    with open_store(tmp_path / "ws" / "store.duckdb") as store:
        report = ingest_file(data, store, source="my data")
        assert ingest_file(table, store, source="my data").quarantined == 1
    assert report.quarantined == 3
    result = alignflow("data", "quarantine", "--source", "my data", workspace=tmp_path / "ws")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"4 quarantined rows in {tmp_path / 'ws' / 'store.duckdb'}"
    assert lines[1].startswith("┌"), result.stdout  # the table itself: no polars `shape: (3, 5)` line above it
    assert "┆ first  │" in lines[2], result.stdout  # the header names the column; each row says line or row
    counts = [line for line in lines if str(data) in line]  # most frequent reason first, with its first line
    assert len(counts) == 2 and "field 'chosen'" in counts[0] and "┆ 2      ┆ line 2 " in counts[0], result.stdout
    assert "┆ 1      ┆ line 3 " in counts[1], result.stdout
    assert [line for line in lines if str(table) in line][0].endswith("┆ row 2  │"), result.stdout
    with open_store(tmp_path / "ws" / "store.duckdb") as store:  # a sampled policy's name is no source
        store.append("samples", pl.DataFrame({"run_id": ["r"], "prompt_id": ["p"], "sample_idx": [0],
                                              "completion": ["c"], "policy": ["other"]}))
    other = alignflow("data", "quarantine", "--source", "other", workspace=tmp_path / "ws")
    assert other.returncode == 2 and other.stderr.startswith("error: source 'other': no rows in the store")
    with open_store(tmp_path / "ws" / "store.duckdb") as store:
        ingest_file(DATA / "demo" / "rankings.jsonl", store, source="clean")
    clean = alignflow("data", "quarantine", "--source", "clean", workspace=tmp_path / "ws")
    assert clean.returncode == 0 and clean.stdout.startswith("0 quarantined rows"), clean.stderr


def test_reading_a_workspace_that_is_not_there_creates_nothing(tmp_path):
    """A mistyped --workspace given to a command that only reads is an error, not a new empty workspace."""
    workspace = tmp_path / "typo"
    for args in (["data", "stats"], ["data", "quarantine"], ["data", "delete", "--source", "x"]):
        result = alignflow(*args, workspace=workspace)
        assert result.returncode == 2
        assert result.stderr.strip() == (f"error: no store at {workspace / 'store.duckdb'}; run "
                                         f"`alignflow -w {workspace} ingest FILE` first")
    assert alignflow("--version", workspace=workspace).stdout.strip().startswith("alignflow 0.")
    assert not workspace.exists()


@pytest.mark.parametrize("text, expected, options", [
    ("", "the file holds no records", []),
    ("\n\n", "the file holds no records", ["--format", "pairs"]),  # a named format does not make it readable
    ('{"foo": 1}\n', "cannot detect the record format (fields ['foo']); the shapes read are pairs (prompt, chosen, "
     "rejected), hh (chosen and rejected HH-RLHF transcripts), chat (chosen and rejected message lists), ranking "
     "(prompt, responses[, ranks]) and problem (question, prompt or problem, with answer or solution): rename the "
     "fields", []),
])
def test_an_unreadable_data_file_fails_before_prefect_starts(tmp_path, text, expected, options):
    """A file ingest cannot read as a whole is one line, before Prefect's temporary server starts (which takes
    seconds and would log the error three more times), alone or inside a pipeline preset."""
    data = tmp_path / "bad.jsonl"
    data.write_text(text)
    result = alignflow("ingest", str(data), *options, workspace=tmp_path / "ws")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {data}: {expected}"
    fmt = f", format: {options[1]}" if options else ""
    preset = tmp_path / "preset.yaml"
    preset.write_text(f"ingest:\n  - {{path: data/demo/pairs.jsonl}}\n  - {{path: {data}{fmt}}}\n")
    result = alignflow("run", "pipeline", "--config", str(preset), workspace=tmp_path / "ws")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {preset}: field 'ingest.1.path': {data}: {expected}"


@pytest.mark.parametrize("stage, text, field", [
    ("sft", "model_path: {missing}\nsource: demo\n", "model_path"),
    ("ppo", "policy_path: {here}\nreward_model_path: {missing}\n", "reward_model_path"),
    ("pipeline", "base_model_path: {here}\nsft: {{model_path: from:base, source: demo}}\n"
                 "rm: {{model_path: {missing}, source: demo}}\n", "rm.model_path"),
])
def test_a_model_path_that_is_not_there_fails_before_the_stage_starts(tmp_path, stage, text, field):
    missing = tmp_path / "models" / "sfft"
    here = tmp_path / "policy"  # what the check reads of a model dir: a config and safetensors weights
    here.mkdir()
    (here / "config.json").write_text("{}")
    (here / "model.safetensors").write_text("")
    config = tmp_path / "stage.yaml"
    config.write_text(text.format(missing=missing, here=here))
    expected = f"error: {config}: field '{field}': model '{missing}': no such directory {missing}"
    commands = [["run", stage, "--config", str(config)]]
    if stage == "pipeline":
        commands += [["demo", "--config", str(config)], ["serve", "--config", str(config)]]
    for command in commands:
        result = alignflow(*command, workspace=tmp_path / "ws")
        assert result.returncode == 2
        assert result.stderr.strip() == expected, (command, result.stderr)
    assert not (tmp_path / "ws").exists()  # nothing ran: not even the workspace was made


@pytest.mark.parametrize("args, expected", [
    (["run", "pipeline", "--config", "x.yaml", "--workspace", "/tmp/w"],
     "error: --workspace is an option of alignflow itself: put it before the command (alignflow --workspace ... "
     "run ...)"),
    (["data", "stats", "-w", "/tmp/w"], "error: -w is an option of alignflow itself: put it before the command "
                                        "(alignflow -w ... data stats ...)"),
    (["run"], "error: Missing argument 'stage' (see alignflow run --help)"),
    (["eval", "--modle", "/m"], "error: No such option: --modle (Possible options: --model, --name) "
                                "(see alignflow eval --help)"),
    (["eval", "--model", "/m", "--n", "many"], "error: Invalid value for '--n': Input should be a valid integer, "
                                               "unable to parse string as an integer (see alignflow eval --help)"),
    (["data", "quarantine", "--sorce", "x"], "error: No such option: --sorce (Possible options: --source) "
                                             "(see alignflow data quarantine --help)"),
    (["nosuch"], "error: No such command 'nosuch' (see alignflow --help)"),
    (["eval", "--model"], "error: Option '--model' requires an argument (see alignflow eval --help)"),
    (["-w", "/tmp/w", "data", "quarantine", "--source"],
     "error: Option '--source' requires an argument (see alignflow data quarantine --help)"),
    (["--workspace"], "error: Option '--workspace' requires an argument (see alignflow --help)"),
])
def test_usage_errors_are_one_line(tmp_path, args, expected):
    """click's usage errors (typer vendors its own click) are one line naming the command's --help, exit 2; no
    usage lines, no boxed panel, no traceback."""
    result = alignflow(*args, workspace=tmp_path / "ws")
    assert (result.returncode, result.stdout, result.stderr) == (2, "", expected + "\n")
    assert not (tmp_path / "ws").exists()


def test_no_command_still_prints_the_help(tmp_path):
    for args in ([], ["data"]):
        result = alignflow(*args, workspace=tmp_path / "ws")
        assert result.returncode == 2 and "Usage: alignflow" in result.stdout and result.stderr == "", result.stderr


def test_a_single_stage_config_with_a_pipeline_reference_is_one_line(tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text("model_path: from:base\nmax_steps: 5\n")
    result = alignflow("run", "sft", "--config", str(config), workspace=tmp_path / "ws")
    assert result.returncode == 2
    assert result.stderr.strip().startswith(f"error: {config}: model_path: 'from:base' names a pipeline stage")


@pytest.mark.parametrize(("stage", "section"), [("sft", "sft"), ("prepare", "base")])
def test_a_pipeline_preset_given_to_one_stage_is_one_line_naming_the_pipeline_command(tmp_path, stage, section):
    """`prepare` is the preset's `base` section."""
    result = alignflow("run", stage, "--config", "flows/configs/demo.yaml", workspace=tmp_path / "ws")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: flows/configs/demo.yaml: a pipeline preset (it has a '{section}' section), not one stage's config; "
        f"`alignflow -w {tmp_path / 'ws'} run pipeline -c flows/configs/demo.yaml` runs it, reusing the stages "
        "already cached "
        f"(`--force {section}` recomputes this one)")


def test_a_stage_config_given_to_the_pipeline_and_a_preset_lacking_the_stage_name_the_command(tmp_path):
    """A helper followed the field-by-field errors instead: model_path -> base_model_path, then `source`, then
    `max_steps` unknown; a preset without the stage's section was "unknown field 'name'"."""
    stage_config = tmp_path / "sft.yaml"
    stage_config.write_text("model_path: /m\nsource: demo\nmax_steps: 5\n")
    workspace = tmp_path / "ws"
    for command in (["run", "pipeline", "-c", str(stage_config)], ["demo", "--config", str(stage_config)]):
        result = alignflow(*command, workspace=workspace)
        assert (result.returncode, result.stderr.strip()) == (2, (
            f"error: {stage_config}: one stage's config (its fields are those of sft or rm), not a pipeline preset; "
            f"`alignflow -w {workspace} run sft -c {stage_config}` runs it"))
    preset = tmp_path / "p.yaml"
    preset.write_text("name: mine\nbase: {}\nsft: {model_path: 'from:base'}\n")
    result = alignflow("run", "grpo", "-c", str(preset), workspace=workspace)
    assert (result.returncode, result.stderr.strip()) == (2, (
        f"error: {preset}: a pipeline preset (sections 'name', 'base', 'sft') without a 'grpo' section; add one, or "
        "give `run grpo` a grpo config of its own"))
    result = alignflow("run", "rs_sft", "-c", str(preset), workspace=workspace)
    assert result.stderr.strip().startswith("error: unknown stage 'rs_sft' (a preset's rs_sft section: `run sft` with "
                                            "`data: best_of_n`); expected one of ingest, prepare, sft")


def test_misspelled_config_field_is_one_line(tmp_path):
    config = tmp_path / "dpo.yaml"
    config.write_text("policy_path: /m\nbetta: 0.2\n")
    result = alignflow("run", "dpo", "--config", str(config), workspace=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {config}: unknown field 'betta' (did you mean 'beta'?)"


@pytest.mark.slow  # several CLI processes, each starting Prefect: 30-70 s on 2 cores
def test_ingest_then_stats(tmp_path):
    """From a directory of the user's own, the README's `data/...` path still names the shipped file; the counts
    come on stdout (Prefect's log lines go to stderr)."""
    ingest = alignflow("ingest", "data/demo/rankings.jsonl", "--source", "demo", workspace=tmp_path, cwd=tmp_path)
    assert ingest.returncode == 0, ingest.stderr
    assert "rankings.jsonl (ranking -> rankings): read 600 = accepted 600 + duplicates 0 + quarantined 0" in ingest.stdout
    again = alignflow("ingest", "data/demo/rankings.jsonl", "--source", "demo", "--replace", workspace=tmp_path)
    assert ("read 600 = accepted 600 + duplicates 0 + quarantined 0; the rows source 'demo' held were deleted first "
            "(rankings 600)") in again.stdout, again.stderr
    both = alignflow("ingest", "data/demo/rankings.jsonl", "data/demo/problems.jsonl", workspace=tmp_path)
    assert [line.split(":")[0] for line in both.stdout.splitlines()] == [
        "rankings.jsonl (ranking -> rankings)", "problems.jsonl (problem -> problems)"], both.stderr
    refused = alignflow("ingest", "data/demo/rankings.jsonl", "data/demo/problems.jsonl", "-s", "x", "--replace",
                        workspace=tmp_path)
    assert (refused.returncode, refused.stderr.strip()) == (2, (
        "error: --replace: 2 of the files go to the one source 'x', and each would delete what the one before it "
        "stored; give them sources of their own, or --replace one file"))
    stats = alignflow("data", "stats", workspace=tmp_path)
    assert stats.returncode == 0
    assert "rankings" in stats.stdout and "600" in stats.stdout
    small = alignflow("ingest", "data/demo/pairs.jsonl", "--max-record-bytes", "60", workspace=tmp_path)
    assert small.returncode == 0, small.stderr
    assert "pairs.jsonl (pairs -> preference_pairs): read 3000 = accepted 0 + duplicates 0 + quarantined 3000" \
        in small.stdout
    hint = f"why 3000 rows were quarantined: alignflow -w {tmp_path} data quarantine --source pairs"
    assert hint in small.stdout.splitlines(), small.stdout
    listed = alignflow(*hint.split(": ", 1)[1].split()[1:], workspace=tmp_path / "elsewhere")  # -w given: it wins
    assert listed.returncode == 0 and listed.stdout.startswith("3000 quarantined rows"), listed.stderr


@pytest.mark.slow  # several CLI processes, each starting Prefect: 30-70 s on 2 cores
def test_a_file_ingested_again_under_another_split_says_where_its_rows_stay_and_data_delete_frees_them(tmp_path):
    """The GSM8K test file ingested without --split lands in 'train'; ingesting it again with --split test says
    the rows stay where they are, and `data delete --source` lets the second ingest place them."""
    test_file = "data/gsm8k/test-first100.jsonl"
    first = alignflow("ingest", test_file, workspace=tmp_path)
    assert "accepted 100 + duplicates 0" in first.stdout, first.stderr
    again = alignflow("ingest", test_file, "--split", "test", "--source", "gsm8k", workspace=tmp_path)
    assert ("read 100 = accepted 0 + duplicates 100 + quarantined 0; of the duplicates, 100 under source "
            "'test-first100', split 'train' stay as first ingested") in again.stdout, again.stderr
    deleted = alignflow("data", "delete", "--source", "test-first100", workspace=tmp_path)
    assert deleted.returncode == 0 and deleted.stdout.strip() == "problems: 100 deleted", deleted.stderr
    moved = alignflow("ingest", test_file, "--split", "test", "--source", "gsm8k", workspace=tmp_path)
    assert "read 100 = accepted 100 + duplicates 0 + quarantined 0" in moved.stdout, moved.stderr
    assert "of the duplicates" not in moved.stdout
    missing = alignflow("data", "delete", "--source", "test-first100", workspace=tmp_path)
    assert missing.returncode == 2 and "error: source 'test-first100': no rows in the store" in missing.stderr


@pytest.mark.slow  # several CLI processes, each starting Prefect: ~80 s on 2 cores
def test_a_model_given_by_relative_paths_from_two_directories_is_evaluated_once_under_its_absolute_path(tmp_path):
    """`eval --model` as typed in two working directories names one model: the second run reads the first's
    samples instead of sampling again, and eval_results label the model by its absolute path, not by a relative
    path that means nothing outside the directory it was typed in."""
    from pipeline_lib.models import build_tiny_model
    from pipeline_lib.store.db import open_store

    problems = tmp_path / "problems.jsonl"
    problems.write_text('{"question": "1+2=", "answer": "3"}\n{"question": "2+2=", "answer": "4"}\n')
    model = build_tiny_model(tmp_path / "models" / "m", ["1+2=3", "2+2=4"], hidden_size=32, num_layers=1)
    ingest = alignflow("ingest", str(problems), "--split", "test", workspace=tmp_path / "ws")
    assert ingest.returncode == 0, ingest.stderr
    (tmp_path / "sub").mkdir()
    for cwd, typed in ((tmp_path, "models/m"), (tmp_path / "sub", "../models/m")):
        result = alignflow("eval", "--model", typed, "--n", "2", "--max-new-tokens", "4", workspace=tmp_path / "ws",
                           cwd=cwd)
        assert result.returncode == 0, result.stderr
    with open_store(tmp_path / "ws" / "store.duckdb", read_only=True) as store:
        assert store.read("samples")["run_id"].n_unique() == 1
        assert sorted(set(store.read("eval_results")["model"])) == [str(model.resolve())]
    # an instruct model is evaluated on chat-rendered prompts as a pipeline's eval section does: the CLI had no way
    result = alignflow("eval", "--model", str(model), "--n", "2", "--max-new-tokens", "4", "--chat-template",
                       workspace=tmp_path / "ws")
    assert result.returncode == 0, result.stderr
    with open_store(tmp_path / "ws" / "store.duckdb", read_only=True) as store:
        runs = store.read("samples").group_by("run_id").agg(pl.col("chat_template").first())
    assert sorted(runs["chat_template"].to_list()) == [False, True]


@pytest.mark.slow  # three CLI processes, each starting Prefect: ~80 s on 2 cores
def test_the_same_sample_command_again_says_its_samples_were_cached(tmp_path):
    """The second run is a Prefect cache hit that samples nothing: it says so, with the run id and the run's counts,
    instead of the first run's `rows written`; so does `run sample` with a config file of the same settings."""
    from pipeline_lib.models import build_tiny_model
    from pipeline_lib.store.db import open_store
    from pipeline_lib.store.ingest import ingest_file

    model = build_tiny_model(tmp_path / "m", ["1+2=3", "2+2=4"], hidden_size=32, num_layers=1)
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"question": "1+2=", "answer": "3"}\n{"question": "2+2=", "answer": "4"}\n')
    (tmp_path / "ws").mkdir()
    with open_store(tmp_path / "ws" / "store.duckdb") as store:
        ingest_file(problems, store, split="test")
    args = ["sample", "--model", str(model), "--n", "2", "--max-new-tokens", "4"]
    first = alignflow(*args, workspace=tmp_path / "ws")
    assert first.returncode == 0, first.stderr
    summary = first.stdout.strip().splitlines()[-1]
    assert summary.startswith("sample sample-") and "2 prompts (0 already done), 4 rows written" in summary
    run_id = summary.split()[1].rstrip(":")
    again = alignflow(*args, workspace=tmp_path / "ws")
    assert again.returncode == 0, again.stderr
    cached = (f"sample {run_id}: cached, nothing sampled: its 4 rows (2 prompts) were already in the store | "
              "mean reward ")
    assert again.stdout.strip().splitlines()[-1].startswith(cached)
    assert "rows written" not in again.stdout
    config = tmp_path / "sample.yaml"
    config.write_text(f"model_path: {model}\nsplit: test\nn: 2\nmax_new_tokens: 4\n")
    from_config = alignflow("run", "sample", "-c", str(config), workspace=tmp_path / "ws")
    assert from_config.returncode == 0, from_config.stderr
    assert from_config.stdout.strip().splitlines()[-1].startswith(cached)
    # another seed and nucleus draw other samples, a run of their own: the one a config file of them names
    reseeded = alignflow(*args, "--seed", "1", "--top-p", "0.9", workspace=tmp_path / "ws")
    assert reseeded.returncode == 0, reseeded.stderr
    summary = reseeded.stdout.strip().splitlines()[-1]
    assert "4 rows written" in summary and run_id not in summary
    config.write_text(f"model_path: {model}\nsplit: test\nn: 2\nmax_new_tokens: 4\nseed: 1\ntop_p: 0.9\n")
    from_config = alignflow("run", "sample", "-c", str(config), workspace=tmp_path / "ws")
    assert from_config.stdout.strip().splitlines()[-1].startswith(f"sample {summary.split()[1]} cached")


def test_sample_and_eval_refuse_problems_the_store_does_not_hold_before_prefect_starts(tmp_path):
    """A workspace never ingested into, a mistyped --problems, a split the source lacks: one line and exit 2, with
    no Prefect server booted and no run recorded (the flow found them only after Prefect had started)."""
    from pipeline_lib.models import build_tiny_model
    from pipeline_lib.store.db import open_store
    from pipeline_lib.store.ingest import ingest_file

    model = build_tiny_model(tmp_path / "m", ["1+2=3"], hidden_size=32, num_layers=1)
    workspace = tmp_path / "ws"
    for command in ("sample", "eval"):
        result = alignflow(command, "--model", str(model), workspace=workspace)
        assert (result.returncode, result.stderr.strip()) == (
            2, f"error: no store at {workspace / 'store.duckdb'}; run `alignflow -w {workspace} ingest FILE` first")
    assert not workspace.exists()
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"question": "1+2=", "answer": "3"}\n')
    workspace.mkdir()
    with open_store(workspace / "store.duckdb") as store:
        ingest_file(problems, store, split="test")
    for command, args, expected in [
        ("eval", ["--problems", "gsm8k"], "source='gsm8k', split='test'; it holds source='p', split='test': 1 rows"),
        ("sample", ["--split", "train"], "split='train'; it holds split='test': 1 rows"),
    ]:
        result = alignflow(command, "--model", str(model), *args, workspace=workspace)
        assert (result.returncode, result.stderr.strip()) == (
            2, f"error: no problems rows in the store with {expected}")
    # the workspace's dirs, made with its run lock, and no Prefect or MLflow database: nothing ran
    assert sorted(str(path.relative_to(workspace)) for path in workspace.rglob("*")) == [
        "mlartifacts", "models", "prefect", "run.lock", "store.duckdb"]


def test_a_stage_run_refuses_a_workspace_without_a_store_and_rows_it_does_not_hold_before_prefect_starts(tmp_path):
    """`run sft` on a mistyped --workspace created a new one and failed 47 s later (Prefect booted) with a message
    that did not name it; a mistyped `source` failed after Prefect had started. Both are one line now, with no
    Prefect server booted; a stage reading a sampling run leaves it to the stage."""
    from pipeline_lib.models import build_tiny_model
    from pipeline_lib.store.db import open_store
    from pipeline_lib.store.ingest import ingest_file

    model = build_tiny_model(tmp_path / "m", ["1+2=3"], hidden_size=32, num_layers=1)
    config = tmp_path / "sft.yaml"
    config.write_text(f"model_path: {model}\ndata: problems\nsource: dmeo\n")
    workspace = tmp_path / "typo"
    result = alignflow("run", "sft", "-c", str(config), workspace=workspace)
    assert (result.returncode, result.stderr.strip()) == (
        2, f"error: no store at {workspace / 'store.duckdb'}; run `alignflow -w {workspace} ingest FILE` first")
    assert not workspace.exists()
    workspace = tmp_path / "ws"
    workspace.mkdir()
    with open_store(workspace / "store.duckdb") as store:
        ingest_file(DATA / "demo" / "problems.jsonl", store, source="demo")
    result = alignflow("run", "sft", "-c", str(config), workspace=workspace)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: no problems rows in the store with source='dmeo', split='train'; it holds "
                                     "source='demo', split='test': 200 rows; source='demo', split='train': 9800 rows")
    # prepare's corpus_sources: a mistyped one failed in the stage, whose advice (ingest demo) led nowhere; beside
    # another source it was left out in silence (a helper)
    config.write_text("corpus_sources: [demo, gsm8kk]\n")
    result = alignflow("run", "prepare", "-c", str(config), workspace=workspace)
    assert (result.returncode, result.stderr.strip()) == (
        2, "error: corpus_sources: no texts in the store under 'gsm8kk'; it holds 'demo'")
    assert not (workspace / "prefect" / "prefect.db").exists() and not (workspace / "mlflow.db").exists()


def test_forcing_a_stage_the_preset_does_not_run_is_one_line(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("base: {corpus_sources: [demo]}\nsft: {model_path: 'from:base'}\n")
    result = alignflow("run", "pipeline", "--config", str(preset), "--force", "dapo", workspace=tmp_path / "ws")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {preset}: force: ['dapo'] not run by this preset; it runs ['base', 'sft']"


def test_demo_with_a_bad_preset_fails_before_generating_its_data(tmp_path):
    preset = tmp_path / "bad.yaml"
    preset.write_text("base: {}\nsft: {model_path: 'from:base', max_step: 3}\n")
    result = alignflow("demo", "--config", str(preset), workspace=tmp_path / "ws")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {preset}: unknown field 'sft.max_step' (did you mean 'max_steps'?)"
    assert not (tmp_path / "ws" / "data").exists()


@pytest.mark.slow  # several CLI processes, each starting Prefect: 30-70 s on 2 cores
@pytest.mark.parametrize("task", ["prepare", "sample"])
def test_an_error_inside_a_stage_shows_once_in_prefects_lines_then_as_the_error_line(tmp_path, task):
    """`prepare` has no retries: Prefect logs the task's exception. `sample` has retries its retry condition
    refuses for this error: Prefect logs no exception record, only the task's `Finished in state Failed(...)`."""
    from pipeline_lib.models import build_tiny_model
    from pipeline_lib.store.db import open_store
    from pipeline_lib.store.ingest import ingest_file

    problems = tmp_path / "p.jsonl"
    problems.write_text('{"question": "1+2=", "answer": "3"}\n')
    (tmp_path / "ws").mkdir()
    with open_store(tmp_path / "ws" / "store.duckdb") as store:
        if task == "sample":
            ingest_file(problems, store, split="test")
    if task == "prepare":  # an empty store
        config = tmp_path / "prepare.yaml"
        config.write_text("hidden_size: 32\n")
        args = ["run", "prepare", "--config", str(config)]
        message = ("prepare: no texts in the store to build the tokenizer from; ingest some first "
                   f"(alignflow -w {tmp_path / 'ws'} ingest data/demo/problems.jsonl --source demo)")
    else:
        model = build_tiny_model(tmp_path / "m", ["1+2=3"], hidden_size=32, num_layers=1, max_position_embeddings=64)
        args = ["sample", "--model", str(model), "--max-new-tokens", "100"]
        message = ("prompts[0] ('1+2=') has 4 tokens + max_new_tokens 100, over the model's max_position_embeddings "
                   "64; sample problems whose prompts fit (a --problems source) or fewer new tokens")
    result = alignflow(*args, workspace=tmp_path / "ws")
    assert result.returncode == 2
    # Prefect's task run line names the task; its echoes (flow exception, both `Finished in state Failed`) are
    # dropped from the console
    shown = [line for line in result.stderr.splitlines() if message in line]
    assert len(shown) == 2, result.stderr
    assert "ERROR" in shown[0] and "Task run" in shown[0] and shown[1] == f"error: {message}"
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("stage", "text", "field", "hint"), [
    ("pipeline", "base: {corpus_sources: [demo]}\nsft:\n  model_path: from:base\n  max_step: 5\n", "sft.max_step",
     "did you mean 'max_steps'?"),
    ("grpo", "policy_path: /m\ngroup_sise: 4\n", "group_sise", "did you mean 'group_size'?"),
    ("sample", "model_path: /m\nwhatever: 4\n", "whatever", "misspelled? not a field of this config"),
])
def test_misspelled_field_in_any_run_config_is_one_line(tmp_path, stage, text, field, hint):
    """`alignflow run <stage>`, nested pipeline fields included: refused before any lock, store or Prefect."""
    config = tmp_path / f"{stage}.yaml"
    config.write_text(text)
    result = alignflow("run", stage, "--config", str(config), workspace=tmp_path / "ws")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {config}: unknown field '{field}' ({hint})"
    assert not (tmp_path / "ws" / "run.lock").exists() and not (tmp_path / "ws" / "store.duckdb").exists()


def test_frames_print_every_row_and_whole_source_names(capsys):
    """`alignflow data stats` names a sampling run's source by its model path: cut behind `…`, runs of two models
    under one dir looked alike."""
    import polars as pl

    from flows.cli import echo_frame

    long_name = "/tmp/workspace/models/sft/" + "0123456789abcdef" * 8 + "/final"
    echo_frame(pl.DataFrame({"source": [long_name] + [f"s{i}" for i in range(30)], "rows": list(range(31))}))
    printed = capsys.readouterr().out
    assert long_name in printed and "s29" in printed and "…" not in printed
    assert printed.startswith("┌") and "shape:" not in printed  # polars' `shape: (31, 2)` line is left out
