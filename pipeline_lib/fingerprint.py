"""Content fingerprints of files, frames and model dirs: the inputs part of a stage's cache key. No torch here:
the CLI and the flows import it."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import orjson
import polars as pl

from pipeline_lib.errors import AlignflowError
from pipeline_lib.model_dirs import FINAL_MARKER, resolve_model_dir

# The sha256 of a file at least this large is remembered by (path, inode, size, mtime) in the workspace
# (`$ALIGNFLOW_HOME/cache/file_sha256.json`, and in the process): a real model's multi-GB weights are read once per
# version of the file, not at every stage of every pipeline run; the tiny model's are read each time.
REMEMBER_FROM_BYTES = 64 * 1024 * 1024
_remembered: dict[str, str] = {}


def fingerprint_path(path: str | Path, *, skip_names: tuple[str, ...] = ()) -> str:
    """sha256 over a file, or over every file of a dir (relative name + content) but those named in
    `skip_names`, hex. A copy of a dir has its fingerprint; so has a file rewritten with the same bytes."""
    path = Path(path)
    digest = hashlib.sha256()
    try:
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*")
                                                     if p.is_file() and p.name not in skip_names)
        for file in files:
            digest.update(str(file.relative_to(path) if file != path else file.name).encode())
            digest.update(_file_sha256(file).encode())
    except FileNotFoundError as exc:  # a traceback, and a dir half read is no fingerprint of it
        raise AlignflowError(f"{path}: {exc.filename} went away while it was read (another process rewriting it?); "
                             "run again once it is written") from None
    return digest.hexdigest()


def _file_sha256(file: Path) -> str:
    """The file's sha256; a large one's from the workspace's memory of it while its path, inode, size and mtime
    stay (a file rewritten in place gets a new mtime, so it is read again)."""
    stat = file.stat()
    key = f"{file.resolve()}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}"
    large = stat.st_size >= REMEMBER_FROM_BYTES
    if large and key not in _remembered:
        _remembered.update(_read_memory())
    if large and key in _remembered:
        return _remembered[key]
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if large:
        _remembered[key] = digest.hexdigest()
        _write_memory(key)
    return digest.hexdigest()


def _memory_path() -> Path | None:
    home = os.environ.get("ALIGNFLOW_HOME")  # the workspace (`apply_environment`); none outside a command
    return Path(home) / "cache" / "file_sha256.json" if home else None


def _read_memory() -> dict[str, str]:
    path = _memory_path()
    try:
        return orjson.loads(path.read_bytes()) if path is not None else {}
    except (OSError, orjson.JSONDecodeError):  # none yet, or cut: the files are read again
        return {}


def _write_memory(key: str) -> None:
    """Add `key` to the workspace's memory, without the entries of the same path's earlier versions (written to a
    temporary file, then renamed: a reader never sees half of it)."""
    path = _memory_path()
    if path is None:
        return
    file = key.split("|", 1)[0]
    memory = {k: v for k, v in _read_memory().items() if k.split("|", 1)[0] != file} | {key: _remembered[key]}
    with contextlib.suppress(OSError):  # a read-only workspace: it is read again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_bytes(orjson.dumps(memory))
        os.replace(temporary, path)


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
