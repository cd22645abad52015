"""Sampling task: N scored samples per problem into the samples table, metrics to MLflow, a Prefect artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from pipeline_lib import tracking
from pipeline_lib.config import SampleConfig
from pipeline_lib.sampling.stage import run_sample_stage
from pipeline_lib.store.db import open_store
from tasks.common import CACHED, current_workspace, retry_on_io, run_tags


# retries: a vLLM server or the store file can fail transiently; a retry resumes, skipping prompts already
# written. Cached on the config and the inputs' fingerprint (the problems it samples, the content of the
# policy and reward model dirs): a new problem or a model retrained into the same dir is a new key, and the
# run id then resumes, sampling only what is missing.
@task(name="sample", retries=1, retry_delay_seconds=5, retry_condition_fn=retry_on_io, **CACHED)
def sample_task(cfg: SampleConfig, inputs_fingerprint: str) -> dict:
    workspace = current_workspace()
    with tracking.stage_run(workspace, "sample", cfg, tags=run_tags(inputs_fingerprint), echo=False) as log:
        with open_store(workspace.store_path) as store:
            report = run_sample_stage(cfg, store, log=log)
        log(report.metrics(), 0)
        tracking.set_tags(report.tags())
    print(report.summary())
    create_markdown_artifact(report.markdown(), key="sample-report", description=report.summary())
    return report.as_dict()
