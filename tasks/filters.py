"""Filter tasks over a sampling run: Best-of-N (RS-SFT data), West-of-N (synthetic preference pairs),
DAPO dynamic filtering; each logs its counts to MLflow."""

from __future__ import annotations

from prefect import task

from pipeline_lib import tracking
from pipeline_lib.filters import run_best_of_n_stage, run_dynamic_filter_stage, run_west_of_n_stage
from pipeline_lib.store.db import open_store
from tasks.common import CACHED, current_workspace, retry_on_io, run_tags

STAGES = {"best_of_n": run_best_of_n_stage, "west_of_n": run_west_of_n_stage, "dynamic": run_dynamic_filter_stage}


# cached on the sampling run's rows (its id and their fingerprint); retries: store writes
@task(name="filter", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_on_io, **CACHED)
def filter_task(kind: str, run_id: str, group_size: int | None = None, inputs_fingerprint: str | None = None,
                source: str = "west_of_n") -> dict:
    workspace = current_workspace()
    extra = {"dynamic": {"group_size": group_size}, "west_of_n": {"source": source}}.get(kind, {})
    params = {"kind": kind, "samples_run_id": run_id} | extra
    with tracking.stage_run(workspace, kind, params, tags=run_tags(inputs_fingerprint), echo=False) as log:
        with open_store(workspace.store_path) as store:
            stats = STAGES[kind](store, run_id=run_id, **extra)
        log(stats, 0)
    print(f"{kind} on {run_id}: " + ", ".join(f"{k.split('/')[-1]} {v:.4g}" for k, v in stats.items()))
    return stats
