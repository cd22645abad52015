"""Filter flow: Best-of-N, West-of-N or DAPO dynamic filtering of one sampling run."""

from __future__ import annotations

from typing import Literal

from flows.common import stage_flow
from tasks.filters import filter_task
from tasks.store import samples_fingerprint_task, west_of_n_missing_task


# runs named `best_of_n-<samples run id>`, not at random: the pipeline's filter runs differ by kind
@stage_flow("filter", flow_run_name="{kind}-{samples_run_id}")
def filter_flow(kind: Literal["best_of_n", "west_of_n", "dynamic"], samples_run_id: str, group_size: int | None = None,
                source: str = "west_of_n") -> dict:
    """West-of-N stores its pairs under `source`, those of a run that sampled with the chat template as
    conversations (the samples record it); `group_size` is the dynamic filter's (None: the run's samples per
    prompt). A cache hit whose West-of-N pairs have left the store since (`alignflow data delete --source`) filters
    again."""
    inputs = samples_fingerprint_task(samples_run_id)
    stats = filter_task(kind, samples_run_id, group_size, inputs, source)
    if kind == "west_of_n" and west_of_n_missing_task(samples_run_id, source):
        stats = filter_task.with_options(refresh_cache=True)(kind, samples_run_id, group_size, inputs, source)
    return stats
