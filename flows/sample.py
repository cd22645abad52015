"""Sample flow: N scored samples per problem from one policy into the workspace store (`alignflow sample`)."""

from __future__ import annotations

from prefect import flow

from pipeline_lib.config import SampleConfig
from tasks.sampling import sample_task


@flow(name="sample", log_prints=True)
def sample_flow(cfg: SampleConfig) -> dict:
    return sample_task(cfg)
