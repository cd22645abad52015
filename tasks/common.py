"""What every task needs: the workspace, Prefect run ids as MLflow tags, the cache settings of deterministic
stages, and the I/O-only retry rule."""

from __future__ import annotations

import re

import duckdb
from prefect.cache_policies import INPUTS, TASK_SOURCE, CacheKeyFnPolicy
from prefect.runtime import flow_run

from pipeline_lib import code_version
from pipeline_lib.config import config_key
from pipeline_lib.errors import AlignflowError
from pipeline_lib.sampling.vllm import VLLMServerError
from pipeline_lib.workspace import Workspace, resolve_workspace


def _workspace_key(context, parameters) -> str:
    return f"{resolve_workspace().root}|alignflow {code_version()}"


def _config_key(context, parameters) -> str:
    return config_key(parameters["cfg"]) if "cfg" in parameters else ""


# A stage task's inputs are its config (`config_key`: a new checkpoint interval is the same stage) and the
# fingerprints of what it reads, so an unchanged stage is a cache hit across processes; the workspace is part of
# the key (its paths are in the results), and so are alignflow's version and code (`code_version`: another release,
# or an edit of the library, may train differently); `force` is not (a forced run refreshes the entry the next
# unforced run hits); results persist under PREFECT_HOME (inside the workspace).
CACHED = {
    "cache_policy": (INPUTS - "cfg" - "force") + TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=_workspace_key)
    + CacheKeyFnPolicy(cache_key_fn=_config_key),
    "persist_result": True,
}


def current_workspace() -> Workspace:
    """The workspace chosen by the CLI (`--workspace` / ALIGNFLOW_HOME), created if missing."""
    return resolve_workspace().create()


def run_tags(inputs_fingerprint: str | None = None) -> dict[str, str]:
    """MLflow tags linking a stage run to its Prefect flow run, and to the fingerprint of what it read."""
    run_id = flow_run.get_id()
    tags = {"prefect.flow_run_id": str(run_id)} if run_id else {}
    return tags | ({"data.fingerprint": inputs_fingerprint} if inputs_fingerprint is not None else {})


def artifact_key(*names: str) -> str:
    """A Prefect artifact key from names (`rs_sft`, `result` -> `rs-sft-result`): Prefect accepts only lowercase
    letters, digits and dashes."""
    return re.sub(r"[^a-z0-9]+", "-", "-".join(names).lower()).strip("-")


def retry_on_io(task, task_run, state) -> bool:
    """Retry transient failures only: I/O (the OS's or DuckDB's), a store briefly locked by another process, a
    vLLM server that went away or failed on its side (VLLMServerError.transient). A user error (bad file, bad
    config), a request the server refused (4xx: a prompt over the model's context) or a bug would fail the same way
    again, leaving a second failed run."""
    try:
        state.result()
    except VLLMServerError as exc:
        return exc.transient
    except AlignflowError as exc:
        return "in use by another" in str(exc)  # the store is briefly locked by another process
    except (OSError, duckdb.IOException):
        return True
    except Exception:
        return False
    return False
