"""Model preparation flow: the tiny offline model, its tokenizer trained on the store's texts."""

from __future__ import annotations

from flows.common import run_model_task, stage_flow
from pipeline_lib.config import TinyModelConfig
from tasks.models import build_tiny_model_task
from tasks.store import corpus_fingerprint_task


@stage_flow("prepare-model", flow_run_name="prepare")
def prepare_model_flow(cfg: TinyModelConfig, force: bool = False) -> str:
    return run_model_task(build_tiny_model_task, cfg, corpus_fingerprint_task(cfg.corpus_sources), refresh=force)
