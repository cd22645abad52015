"""Sample flow: N scored samples per problem from one policy into the workspace store (`alignflow sample`)."""

from __future__ import annotations

from flows.common import stage_flow
from pipeline_lib.config import SampleConfig
from tasks.sampling import sample_task
from tasks.store import inputs_fingerprint_task


@stage_flow("sample")
def sample_flow(cfg: SampleConfig, force: bool = False) -> dict:
    return sample_task.with_options(refresh_cache=force)(cfg, inputs_fingerprint_task(cfg))
