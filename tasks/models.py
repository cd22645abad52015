"""Model preparation task: build the tiny offline model from the store's texts (cached by content)."""

from __future__ import annotations

from prefect import task

from pipeline_lib.config import TinyModelConfig
from pipeline_lib.fingerprint import keyed_dir
from pipeline_lib.models.tiny import build_tiny_model
from pipeline_lib.store.db import open_store
from tasks.common import CACHED, current_workspace


@task(name="build-tiny-model", **CACHED)
def build_tiny_model_task(cfg: TinyModelConfig, data_fingerprint: str) -> str:
    workspace = current_workspace()
    with open_store(workspace.store_path) as store:
        corpus = store.corpus_texts(list(cfg.corpus_sources) if cfg.corpus_sources else None)
    out_dir = keyed_dir(workspace.models_dir, "tiny_model", cfg.model_dump_json(), data_fingerprint)
    path = build_tiny_model(out_dir, corpus, **cfg.model_dump(exclude={"corpus_sources"}))
    print(f"tiny model: {path} ({len(corpus)} corpus texts)")
    return str(path)
