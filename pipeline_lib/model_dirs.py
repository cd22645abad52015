"""Where a model is: a local dir, or a hub id's snapshot in the local Hugging Face cache (downloaded only when the
hub is online). No torch here, so the CLI checks a config's model dirs before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline_lib.errors import AlignflowError

PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
# Files a model dir needs besides weights; a hub download fetches only these plus the allowed weights.
_HUB_FILE_PATTERNS = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py", "*.safetensors"]


class ModelLoadError(AlignflowError, RuntimeError):
    """A model or tokenizer could not be loaded; the message is one line naming the path/id and the fix."""


def _hub_offline() -> bool:
    """The env var is read at call time too: huggingface_hub reads it once at import, a later export counts."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve_model_dir(path_or_id: str | Path, *, allow_pickle: bool = False) -> Path:
    """A local model dir for `path_or_id`: the dir itself, or the hub id's snapshot (cache only when offline)."""
    local = Path(path_or_id).expanduser()
    if local.is_dir():
        return local.resolve()
    name = str(path_or_id)
    if local.exists():
        raise ModelLoadError(f"model {name!r}: {local.resolve()} is not a model directory")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelLoadError(f"model {name!r}: no such directory {local.resolve()}")
    from huggingface_hub import snapshot_download

    offline = _hub_offline()
    patterns = _HUB_FILE_PATTERNS + (list(PICKLE_PATTERNS) if allow_pickle else [])
    try:
        return Path(snapshot_download(name, local_files_only=offline, allow_patterns=patterns))
    except Exception as exc:  # noqa: BLE001 - every hub failure becomes the same one-line error
        where = "is not in the local Hugging Face cache and HF_HUB_OFFLINE=1" if offline else \
            f"could not be downloaded ({type(exc).__name__}); set HF_HUB_OFFLINE=1 to fail fast offline"
        raise ModelLoadError(
            f"model {name!r}: no local directory at {local.resolve()} and the hub id {where}; "
            f"pass a local model dir or pre-download it into {_hub_cache()}"
        ) from None


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
