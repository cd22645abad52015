"""Store fingerprint tasks: what a stage reads, reduced to a hash that keys the stage's cache."""

from __future__ import annotations

from prefect import task

from pipeline_lib.store.db import open_store
from tasks.common import current_workspace


@task(name="data-fingerprint")
def data_fingerprint_task(table: str, **equals: object) -> str:
    """Fingerprint of the rows of `table` matching `equals` (e.g. source="demo", split="train")."""
    with open_store(current_workspace().store_path) as store:
        return store.fingerprint(table, **equals)


@task(name="corpus-fingerprint")
def corpus_fingerprint_task(sources: tuple[str, ...] | None) -> str:
    """Fingerprint of the texts a tokenizer would be trained on."""
    with open_store(current_workspace().store_path) as store:
        tables = ("preference_pairs", "problems", "rankings")
        if sources is None:
            return ";".join(store.fingerprint(t) for t in tables)
        return ";".join(store.fingerprint(t, source=s) for t in tables for s in sorted(sources))
