"""Content fingerprints of files, frames and model dirs: the inputs part of a stage's cache key. No torch here:
the CLI and the flows import it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson
import polars as pl

from pipeline_lib.model_dirs import FINAL_MARKER, resolve_model_dir

# Files above this size are fingerprinted by (size, mtime) instead of content: hashing the multi-GB
# weights of a real model on every pipeline run would cost minutes; the tiny model is hashed fully.
FULL_HASH_LIMIT = 256 * 1024 * 1024


def fingerprint_path(path: str | Path, *, skip_names: tuple[str, ...] = ()) -> str:
    """sha256 over a file, or over every file of a dir (relative name + content) but those named in
    `skip_names`, hex.

    Cheap for small files; large files contribute (size, mtime_ns)."""
    path = Path(path)
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and p.name not in skip_names)
    for file in files:
        stat = file.stat()
        digest.update(str(file.relative_to(path) if file != path else file.name).encode())
        if stat.st_size > FULL_HASH_LIMIT:
            digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
            continue
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def model_fingerprint(model_path: str | Path) -> str:
    """A model dir's content fingerprint, a hub id's that of its snapshot (`resolve_model_dir`: offline, the one
    the local cache's refs name; its id stood for itself, so an updated snapshot was a cache hit on the old one): a
    model retrained into the same dir is a new input, an identical copy the same one. The final marker is left out:
    it records the run (its wall time), so a stage retrained to the same weights leaves every stage after it
    cached. ModelLoadError if there is no such model."""
    return fingerprint_path(resolve_model_dir(model_path), skip_names=(FINAL_MARKER,))


def content_id(*parts: str) -> str:
    """sha256 hex of the parts joined with the unit separator "\\x1f": the row id of every store table
    (re-ingesting is idempotent) and the key of content-addressed stage dirs.

    A part that holds "\\x1f" itself would make the join ambiguous (`a\\x1fb`, `c` vs `a`, `b\\x1fc`): then the
    parts are hashed as a JSON array behind a 0xFF byte, which no UTF-8 join can contain. So no two part lists
    share an id, and the ids of every other text stay what they always were (stores keep deduplicating)."""
    if not any("\x1f" in part for part in parts):
        return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()
    return hashlib.sha256(b"\xff" + orjson.dumps(parts)).hexdigest()


def keyed_dir(root: str | Path, stage: str, *parts: str) -> Path:
    """`root/<stage>/<hash of parts>`: the same inputs land in the same dir, so a killed stage rerun finds its
    checkpoint and resumes, a finished one is returned as it is, and different inputs never overwrite each other."""
    return Path(root) / stage / content_id(*parts)[:16]


def frame_fingerprint(frame: pl.DataFrame) -> str:
    """sha256 over a frame's shape, columns and row hashes (polars' seeded row hash: stable within an
    install, so a polars upgrade at worst recomputes a cached stage once)."""
    digest = hashlib.sha256(f"{frame.shape}:{frame.columns}".encode())
    digest.update(frame.hash_rows(seed=0).to_numpy().tobytes())
    return digest.hexdigest()
