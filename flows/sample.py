"""Sample flow: N scored samples per problem from one policy into the workspace store (`alignflow sample`)."""

from __future__ import annotations

from flows.common import stage_flow
from pipeline_lib.config import SampleConfig
from tasks.sampling import sample_task
from tasks.store import inputs_fingerprint_task, samples_count_task


@stage_flow("sample")
def sample_flow(cfg: SampleConfig, force: bool = False) -> dict:
    """A cache hit whose rows have left the store since (deleted by hand, another store file) samples again: the
    run resumes and writes what is missing, instead of handing the filters an empty run."""
    inputs = inputs_fingerprint_task(cfg, "sample")
    report = sample_task.with_options(refresh_cache=force)(cfg, inputs)
    if samples_count_task(report["run_id"]) != report["n_rows"]:
        report = sample_task.with_options(refresh_cache=True)(cfg, inputs)
    return report
