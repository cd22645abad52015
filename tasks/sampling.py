"""Sampling task: N scored samples per problem into the samples table, metrics to MLflow, a Prefect artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from pipeline_lib import tracking
from pipeline_lib.config import SampleConfig
from pipeline_lib.sampling.stage import run_sample_stage
from pipeline_lib.store.db import open_store
from tasks.common import CACHED, current_workspace, run_tags


# retries: a vLLM server or the store file can fail transiently; a retry resumes, skipping prompts already
# written. Cached on the config and the model's content fingerprint (a model retrained into the same dir
# is a new key); without the cache a rerun would still write nothing (the run id resumes).
@task(name="sample", retries=1, retry_delay_seconds=5, **CACHED)
def sample_task(cfg: SampleConfig, model_fingerprint: str) -> dict:
    workspace = current_workspace()
    with tracking.stage_run(workspace, "sample", cfg, tags=run_tags(), echo=False) as log:
        with open_store(workspace.store_path) as store:
            report = run_sample_stage(cfg, store, log=log)
        log(report.metrics(), 0)
        tracking.set_tags({"samples.run_id": report.run_id, "samples.policy": report.policy})
    print(report.summary())
    create_markdown_artifact(report.markdown(), key="sample-report", description=report.summary())
    return report.as_dict()
