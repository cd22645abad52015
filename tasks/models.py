"""Model preparation task: build the tiny offline model from the store's texts (cached by content), logged
as the `base` MLflow run (its config, parameter count and the model)."""

from __future__ import annotations

from prefect import task
from safetensors.torch import load_file

from pipeline_lib import code_version, tracking
from pipeline_lib.config import TinyModelConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.fingerprint import keyed_dir
from pipeline_lib.models.tiny import build_tiny_model
from pipeline_lib.store.db import open_store
from tasks.common import CACHED, current_workspace, run_tags


@task(name="build-tiny-model", **CACHED)
def build_tiny_model_task(cfg: TinyModelConfig, data_fingerprint: str) -> str:
    workspace = current_workspace()
    out_dir = keyed_dir(workspace.models_dir, "tiny_model", cfg.model_dump_json(), data_fingerprint, code_version())
    with tracking.stage_run(workspace, "base", cfg, tags=run_tags(data_fingerprint)) as log:
        with open_store(workspace.store_path) as store:
            if cfg.corpus_sources:
                store.check_corpus_sources(cfg.corpus_sources)
            corpus = store.corpus_texts(list(cfg.corpus_sources) if cfg.corpus_sources else None)
        if not corpus:
            raise AlignflowError("prepare: no texts in the store to build the tokenizer from; ingest some first "
                                 f"({workspace.command('ingest', 'data/demo/problems.jsonl', '--source', 'demo')})")
        path = build_tiny_model(out_dir, corpus, **cfg.model_dump(exclude={"corpus_sources"}))
        parameters = sum(tensor.numel() for file in path.glob("*.safetensors") for tensor in load_file(file).values())
        log({"model/parameters": float(parameters), "data/corpus_texts": float(len(corpus))}, 0)
        tracking.log_model(path)
    return str(path)
