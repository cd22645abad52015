"""The pipeline flow: stage flows chained in plain Python from a PipelineConfig (a YAML preset in
flows/configs/). Each stage's task is cached on its config and input fingerprints, so a rerun recomputes
only what changed (and what depends on it); `force` names stages to recompute anyway. The pipeline's MLflow run
holds every model's Pass@K / Maj@K, each stage's output as an `outputs.<stage>` tag and, in `alignflow.reused`,
the stages that were cache hits (they have no run under it: their runs are those of the pipeline that made them)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from flows.common import stage_flow
from flows.dapo import dapo_flow
from flows.dpo import dpo_flow
from flows.evaluate import eval_flow
from flows.filters import filter_flow
from flows.grpo import grpo_flow
from flows.ingest import ingest_flow
from flows.ppo import ppo_flow
from flows.prepare import prepare_model_flow
from flows.rm import rm_flow
from flows.sample import sample_flow
from flows.sft import sft_flow
from pipeline_lib import tracking
from pipeline_lib.config import PipelineConfig
from pipeline_lib.config.pipeline import STAGE_ORDER
from pipeline_lib.errors import AlignflowError
from pipeline_lib.store.ingest import IngestReport
from pipeline_lib.train.common import reserve_deterministic_cublas
from tasks.common import current_workspace, run_tags
from tasks.evaluation import compare_task
from tasks.store import check_selections_task, corpus_sources_task

TRAINING_FLOWS = {"sft": sft_flow, "rm": rm_flow, "rs_sft": sft_flow, "dpo": dpo_flow,
                  "grpo": grpo_flow, "dapo": dapo_flow, "ppo": ppo_flow}


@contextmanager
def named(stage: str) -> Iterator[None]:
    """A stage's one-line error starts with the stage's name, so the pipeline's last line says which one failed."""
    try:
        yield
    except AlignflowError as exc:
        if not str(exc).startswith(f"{stage}: "):
            exc.args = (f"{stage}: {exc}",)
        raise


@stage_flow("pipeline")
def pipeline_flow(cfg: PipelineConfig, force: tuple[str, ...] = ()) -> dict[str, str]:
    """Run every enabled stage in order; returns each stage's output (model dir or sampling run id)."""
    cfg.check_force(force)
    if any(getattr(getattr(cfg, stage), "deterministic", False) for stage in STAGE_ORDER):
        reserve_deterministic_cublas()  # before the first stage's CUDA matmul: cuBLAS reads it once
    with tracking.pipeline_run(current_workspace(), cfg.name, cfg, tags=run_tags()) as pipeline_run_id:
        for ingest_cfg in cfg.ingest:  # each file's counts on stdout, as `alignflow ingest` prints them
            report = IngestReport(**ingest_flow(ingest_cfg))
            sys.stdout.write(report.summary(current_workspace().root) + "\n")
            if report.quarantined:
                sys.stdout.write(report.quarantine_hint(current_workspace().root) + "\n")
        base = cfg.base
        # a mistyped source fails here, not after stages trained
        check_selections_task(cfg.stored_selections(), base.corpus_sources if base is not None else None)
        if base is not None and base.corpus_sources is None:
            # every source but the pipeline's own West-of-N pairs, which each run adds to: with them the tokenizer's
            # corpus, so the base model's dir and every stage after it, would change from one run to the next
            base = base.model_copy(update={"corpus_sources": corpus_sources_task(exclude=cfg.west_of_n_source)})
        outputs: dict[str, str] = {}

        def finished(stage: str, output: str) -> None:
            """A stage's output, tagged `outputs.<stage>` on the pipeline run at once: a run failing later shows it."""
            outputs[stage] = output
            tracking.set_tags({f"outputs.{stage}": str(output)}, run_id=pipeline_run_id)

        with named("base"):
            finished("base", prepare_model_flow(base, force="base" in force) if base else cfg.base_model_path)
        for stage in ("sft", "rm", "sample", "rs_sft", "dpo", "grpo", "dapo", "ppo"):
            if getattr(cfg, stage) is None:
                continue
            stage_cfg = cfg.resolved(stage, outputs)
            if stage == "sample":
                with named("sample"):
                    finished("sample", sample_flow(stage_cfg, force="sample" in force)["run_id"])
                with named("best_of_n"):
                    filter_flow("best_of_n", outputs["sample"])
                with named("west_of_n"):
                    filter_flow("west_of_n", outputs["sample"], source=cfg.west_of_n_source)
                continue
            with named(stage):
                finished(stage, TRAINING_FLOWS[stage](stage_cfg, force=stage in force))
        rows = []
        for stage in cfg.evaluated:
            with named(f"eval-{stage}"):
                rows += eval_flow(cfg.eval_config(stage, outputs[stage]), force="eval" in force)
        if rows:  # each model's Pass@K / Maj@K on the pipeline run too, so pipeline runs compare in one table
            tracking.log_metrics({f"eval/{row['model']}/{kind}_at_{row['k']}": row[f"{kind}_at_k"]
                                  for row in rows for kind in ("pass", "maj")}, run_id=pipeline_run_id)
            sys.stdout.write(compare_task(rows, pipeline_run_id) + "\n")  # print() would go to Prefect's log
        tracking.log_dict(outputs, "outputs.json", run_id=pipeline_run_id)
        children = tracking.find_runs(current_workspace(), f"tags.mlflow.parentRunId = '{pipeline_run_id}'")
        ran = {run.info.run_name for run in children}
        filters = ("best_of_n", "west_of_n") if "sample" in outputs else ()
        reused = [stage for stage in [*outputs, *filters, *(f"eval-{stage}" for stage in cfg.evaluated)]
                  if stage not in ran and (stage != "base" or cfg.base)]  # a base_model_path is not a stage
        tracking.set_tags({"alignflow.reused": ",".join(reused)}, run_id=pipeline_run_id)
    return outputs
