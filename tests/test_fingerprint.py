"""Content fingerprints of model dirs: a copy or a rewrite with the same bytes is the same input, other bytes
another; a large file is read once per version, its sha256 remembered in the workspace."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pipeline_lib import fingerprint
from pipeline_lib.errors import AlignflowError
from pipeline_lib.fingerprint import fingerprint_path


def test_large_files_are_fingerprinted_by_content_once_per_version(tmp_path, monkeypatch):
    """Files over 256 MiB (any real model's weights) stood for their size and mtime: a `cp -r` of the SFT model, or
    `--force sft` retraining it to the same bytes, reran sampling and the filters (a helper, 268 MB model). Now the
    content counts, and a large file's sha256 is remembered by (path, inode, size, mtime) in the workspace."""
    monkeypatch.setattr(fingerprint, "REMEMBER_FROM_BYTES", 16)
    monkeypatch.setattr(fingerprint, "_remembered", {})
    monkeypatch.setenv("ALIGNFLOW_HOME", str(tmp_path / "ws"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"w" * 64)
    first = fingerprint_path(model)
    memory = tmp_path / "ws" / "cache" / "file_sha256.json"
    assert [key.split("|")[0] for key in json.loads(memory.read_text())] == [str(weights.resolve())]

    shutil.copytree(model, tmp_path / "copy")
    assert fingerprint_path(tmp_path / "copy") == first  # read once more, at its own path
    weights.write_bytes(b"w" * 64)  # the same bytes, a new mtime
    assert fingerprint_path(model) == first
    assert len([key for key in json.loads(memory.read_text()) if key.startswith(str(weights.resolve()))]) == 1
    weights.write_bytes(b"v" * 64)
    other = fingerprint_path(model)
    assert other != first

    stat = weights.stat()  # bytes changed in place with size and mtime put back: the remembered sha256 stands
    with weights.open("r+b") as handle:
        handle.write(b"u")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    monkeypatch.setattr(fingerprint, "_remembered", {})  # another process: the workspace's memory
    assert fingerprint_path(model) == other
    memory.write_text("{cut")  # a memory cut short is no memory: the files are read again
    monkeypatch.setattr(fingerprint, "_remembered", {})
    assert fingerprint_path(model) != other


def test_a_file_gone_while_its_dir_is_read_is_one_line_not_a_fingerprint(tmp_path, monkeypatch):
    """Another process replacing a model dir that a stage fingerprints (a helper: a traceback, and once the
    fingerprint of a half-deleted dir, a wrong cache key)."""
    (tmp_path / "a.json").write_text("a")
    (tmp_path / "b.json").write_text("b")
    read = fingerprint._file_sha256

    def read_then_remove_the_next(file):
        digest = read(file)
        (tmp_path / "b.json").unlink(missing_ok=True)  # the other process, between two files
        return digest

    monkeypatch.setattr(fingerprint, "_file_sha256", read_then_remove_the_next)
    with pytest.raises(AlignflowError, match=rf"^{tmp_path}: {tmp_path / 'b.json'} went away while it was read"):
        fingerprint_path(tmp_path)
