"""Sampling fixtures: the tiny model built once per session from the demo problems, its HF sampler, and a
store holding a few demo problems."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

from pipeline_lib.models import build_tiny_model
from pipeline_lib.sampling.hf import HFSampler
from pipeline_lib.store.db import Store, open_store

DEMO_PROBLEMS = Path(__file__).resolve().parents[2] / "data" / "demo" / "problems.jsonl"


@pytest.fixture(scope="session")
def demo_problems() -> pl.DataFrame:
    return pl.read_ndjson(DEMO_PROBLEMS)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_problems) -> Path:
    corpus = demo_problems["prompt"].to_list() + demo_problems["answer"].to_list()
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", corpus)


@pytest.fixture(scope="session")
def hf_sampler(tiny_model_dir) -> HFSampler:
    return HFSampler.from_pretrained(tiny_model_dir, device="cpu")


@pytest.fixture(scope="session")
def problems(demo_problems) -> pl.DataFrame:
    """6 test-split demo problems as rows of the problems table, ids `demo-00` .. `demo-05`, source `demo`."""
    rows = demo_problems.filter(pl.col("split") == "test").head(6)
    return rows.select(
        pl.format("demo-{}", pl.int_range(pl.len()).cast(pl.String).str.zfill(2)).alias("problem_id"),
        pl.lit("demo").alias("source"),
        pl.col("split"),
        pl.col("prompt"),
        pl.col("answer"),
    )


@pytest.fixture
def store(workspace, problems) -> Iterator[Store]:
    """The test workspace's store holding `problems`."""
    with open_store(workspace.store_path) as opened:
        opened.insert_new("problems", problems)
        yield opened
