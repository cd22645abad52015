"""Content fingerprints of files and model dirs: the inputs part of a stage's cache key; whether a model dir a
stage wrote is whole. No torch here: the CLI and the flows import it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson
import polars as pl

# Files above this size are fingerprinted by (size, mtime) instead of content: hashing the multi-GB
# weights of a real model on every pipeline run would cost minutes; the tiny model is hashed fully.
FULL_HASH_LIMIT = 256 * 1024 * 1024
# What a training stage writes beside a final model about its run (wall time, metrics): not part of the model
FINAL_MARKER = "alignflow_final.json"


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
    """A model dir's content fingerprint (a hub id stands for itself): a model retrained into the same dir is a
    new input, an identical copy the same one. The final marker is left out: it records the run (its wall time),
    so a stage retrained to the same weights leaves every stage after it cached."""
    path = Path(model_path).expanduser()
    return fingerprint_path(path, skip_names=(FINAL_MARKER,)) if path.is_dir() else str(model_path)


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


def read_marker(final: Path) -> dict:
    """A final's marker: a JSON object, else OSError/ValueError."""
    marker = orjson.loads((final / FINAL_MARKER).read_bytes())
    if not isinstance(marker, dict):
        raise ValueError(f"expected a JSON object, got {type(marker).__name__}")
    return marker


def missing_files(final: Path, marker: dict) -> list[str]:
    """Files of `final` that are gone or whose size is not the recorded one (a marker without sizes, from before
    they were recorded: a config.json and safetensors weights must be there)."""
    sizes = marker.get("files")
    if not isinstance(sizes, dict):
        return [name for name, there in (("config.json", (final / "config.json").is_file()),
                                          ("*.safetensors", any(final.glob("*.safetensors")))) if not there]
    return [name for name, size in sizes.items()
            if not (final / name).is_file() or (final / name).stat().st_size != size]


def model_dir_complete(path: str | Path) -> bool:
    """Whether a model dir a stage handed on is still all there: the files its final marker records, at their
    sizes (a dir without a marker, such as the tiny base model: a config.json and safetensors weights)."""
    path = Path(path)
    if not path.is_dir():
        return False
    try:
        marker = read_marker(path) if (path / FINAL_MARKER).is_file() else {}
    except (OSError, ValueError):
        return False
    return not missing_files(path, marker)
