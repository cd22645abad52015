"""Fingerprint tasks: what a stage reads, reduced to a hash that keys the stage's cache; and counts of what a
stage wrote, which tell a cache hit whose rows have left the store since."""

from __future__ import annotations

import polars as pl
from prefect import task
from pydantic import BaseModel

from pipeline_lib import tracking
from pipeline_lib.config import (
    DAPOConfig,
    DPOConfig,
    EvalConfig,
    GRPOConfig,
    PPOConfig,
    RMConfig,
    SampleConfig,
    SFTConfig,
    model_paths,
)
from pipeline_lib.errors import AlignflowError
from pipeline_lib.filters import west_of_n_of_run
from pipeline_lib.fingerprint import content_id, frame_fingerprint, model_fingerprint
from pipeline_lib.sampling.stage import sample_run_id, select_problems
from pipeline_lib.store.db import CORPUS_TABLES, open_store
from pipeline_lib.train.dpo import load_dpo_data
from pipeline_lib.train.grpo import load_grpo_data
from pipeline_lib.train.ppo import load_ppo_data
from pipeline_lib.train.rm import load_rm_data
from pipeline_lib.train.sft import load_sft_data
from tasks.common import current_workspace, run_tags

LOADERS = {SFTConfig: load_sft_data, RMConfig: load_rm_data, DPOConfig: load_dpo_data,
           GRPOConfig: load_grpo_data, DAPOConfig: load_grpo_data, PPOConfig: load_ppo_data,
           SampleConfig: select_problems, EvalConfig: lambda store, cfg: select_problems(store, cfg.sample_config)}


@task(name="inputs-fingerprint", task_run_name="{stage}-inputs")
def inputs_fingerprint_task(cfg: BaseModel, stage: str) -> str:
    """Fingerprint of the store rows a stage reads (its own loader, so exactly what it trains on or samples)
    and of the model dirs its config names: the cache key changes iff its inputs do.

    Inputs the stage cannot read (store rows, a model dir that is not there) fail it here, before it starts: the
    error names `stage` (a pipeline has several `source:` fields) and the stage's MLflow run is recorded FAILED with
    it. The CLI checks model dirs before the flow starts; a deployment run or a direct call meets them here."""
    workspace = current_workspace()
    try:
        with open_store(workspace.store_path) as store:
            data = LOADERS[type(cfg)](store, cfg)
        models = [model_fingerprint(path) for path in model_paths(cfg)]  # ModelLoadError for a model not there
    except AlignflowError as exc:
        exc.args = (f"{stage}: {exc}",)
        with tracking.stage_run(workspace, stage, cfg, tags=run_tags()):
            raise
    frames = [f for f in (data if isinstance(data, tuple) else (data,)) if isinstance(f, pl.DataFrame)]
    return content_id(*(frame_fingerprint(f) for f in frames), *models)


@task(name="check-selections")
def check_selections_task(selections: list[tuple[str, str, dict[str, str | None]]],
                          corpus_sources: tuple[str, ...] | None = None) -> None:
    """Refuse, in one line naming the stage, a (stage, table, filters) selection no store row matches, or a
    tokenizer's corpus source (the base stage's `corpus_sources`) holding no texts."""
    if not selections and not corpus_sources:
        return
    with open_store(current_workspace().store_path, read_only=True) as store:
        if corpus_sources:
            try:
                store.check_corpus_sources(corpus_sources)
            except AlignflowError as exc:
                exc.args = (f"base: {exc}",)
                raise
        for stage, table, where in selections:
            try:
                store.check_selected(table, **where)
            except AlignflowError as exc:
                exc.args = (f"{stage}: {exc}",)
                raise


@task(name="samples-fingerprint")
def samples_fingerprint_task(run_id: str) -> str:
    """Fingerprint of a sampling run's rows of stored problems: a run resumed with new problems, or whose
    problems were deleted since, is a new input to its filters."""
    with open_store(current_workspace().store_path) as store:
        return frame_fingerprint(store.run_samples(run_id))


@task(name="samples-count")
def samples_count_task(run_id: str) -> int:
    """How many rows a sampling run holds in the store now."""
    with open_store(current_workspace().store_path) as store:
        return store.count("samples", run_id=run_id)


@task(name="west-of-n-missing")
def west_of_n_missing_task(run_id: str, source: str) -> int:
    """How many of a sampling run's West-of-N pairs preference_pairs does not hold now (deleted since a cached
    filter run wrote them)."""
    with open_store(current_workspace().store_path) as store:
        return store.count_missing("preference_pairs", west_of_n_of_run(store, run_id, source)[0])


@task(name="eval-results-held")
def eval_results_held_task(cfg: EvalConfig) -> list[tuple[int, float, float]]:
    """The (k, pass_at_k, maj_at_k) rows the store holds now for this evaluation (its sampling run, its model
    name), by k."""
    with open_store(current_workspace().store_path) as store:
        problem_ids = select_problems(store, cfg.sample_config)["problem_id"].to_list()
        held = store.read("eval_results", run_id=sample_run_id(cfg.sample_config, problem_ids), model=cfg.label)
    return sorted(held.select("k", "pass_at_k", "maj_at_k").iter_rows())


@task(name="corpus-sources")
def corpus_sources_task(exclude: str) -> tuple[str, ...] | None:
    """Every source of the store's texts but `exclude` (None when no other is there)."""
    with open_store(current_workspace().store_path) as store:
        return tuple(source for source in store.corpus_sources() if source != exclude) or None


@task(name="corpus-fingerprint")
def corpus_fingerprint_task(sources: tuple[str, ...] | None) -> str:
    """Fingerprint of the texts a tokenizer would be trained on."""
    with open_store(current_workspace().store_path) as store:
        if sources is None:
            return ";".join(store.fingerprint(t) for t in CORPUS_TABLES)
        return ";".join(store.fingerprint(t, source=s) for t in CORPUS_TABLES for s in sorted(sources))
