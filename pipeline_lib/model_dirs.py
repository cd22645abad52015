"""Where a model is (a local dir, or a hub id's snapshot in the local Hugging Face cache, downloaded only when the
hub is online), whether its files are loadable (a config, safetensors weights inside the dir), and whether a model
dir a stage wrote is still whole (its final marker). No torch here, so the CLI checks a config's model dirs before
anything starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline_lib.errors import AlignflowError, one_line

PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
# What a training stage writes beside a final model about its run (wall time, metrics): not part of the model
FINAL_MARKER = "alignflow_final.json"
# Files a model dir needs besides weights; a hub download fetches only these plus the allowed weights.
_HUB_FILE_PATTERNS = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py", "*.safetensors"]


class ModelLoadError(AlignflowError, RuntimeError):
    """A model or tokenizer could not be loaded; the message is one line naming the path/id and the fix."""


def _hub_offline() -> bool:
    """The env var is read at call time too: huggingface_hub reads it once at import, a later export counts."""
    from huggingface_hub import constants

    offline = os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return constants.HF_HUB_OFFLINE or offline


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


def _inside(model_dir: Path, name: object) -> bool:
    """Whether the file name `name` (from config.json or an index) stays inside `model_dir`, lexically as transformers
    joins it: a hub snapshot's files are symlinks into its blob store, so links are not resolved."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        return False
    base = os.path.abspath(model_dir)
    return os.path.commonpath([base, os.path.abspath(os.path.join(base, name))]) == base


def _check_index(model_dir: Path, index: Path) -> None:
    """Every shard a safetensors index maps weights to is a safetensors file inside `model_dir`."""
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"model dir {model_dir}: unreadable {index.name} ({one_line(exc)})") from None
    # the index names the files transformers loads: a pickle shard behind it is still a pickle
    other = sorted(str(shard) for shard in shards if not str(shard).endswith(".safetensors"))
    if other:
        raise ModelLoadError(f"model dir {model_dir}: {index.name} maps weights to non-safetensors files "
                             f"({', '.join(other)}); convert them to safetensors")
    outside = sorted(str(shard) for shard in shards if not _inside(model_dir, shard))
    if outside:
        raise ModelLoadError(f"model dir {model_dir}: {index.name} maps weights to files outside the dir "
                             f"({', '.join(outside)}); expected shard names relative to it")


def _explicit_weights(model_dir: Path) -> Path | None:
    """The weights file config.json names in `transformers_weights` (transformers then reads it instead of
    model.safetensors, even a pickle `adapter_model.bin`), checked to be safetensors inside the dir; None if unset."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model dir {model_dir}: unreadable config.json ({one_line(exc)})") from None
    name = config.get("transformers_weights") if isinstance(config, dict) else None
    if name is None:
        return None
    if not (isinstance(name, str) and name.endswith((".safetensors", ".safetensors.index.json"))
            and _inside(model_dir, name)):
        raise ModelLoadError(f"model dir {model_dir}: config.json's transformers_weights={name!r} is not a "
                             "safetensors file or index inside the dir; remove the field or convert the weights")
    return model_dir / name


def stage_model_hint(path: Path) -> str:
    """Where the model is, for a path that names a training stage's dirs instead of one model: a stage run's dir
    (models/<stage>/<key>) holds it in final/; a stage's dir (models/<stage>, or models/<stage>/final, which does
    not exist) holds one run per key, the newest named. Empty for any other path."""
    if (path / "final" / "config.json").is_file():
        return f" (a stage's dir? its model is {path / 'final'})"
    stage = path.parent if path.name == "final" and not path.exists() else path
    runs = sorted(stage.glob("*/final/config.json"), key=lambda config: config.stat().st_mtime) \
        if stage.is_dir() else []
    return f" (a stage's dir? its newest model is {runs[-1].parent})" if runs else ""


def check_weights(model_dir: Path, *, allow_pickle: bool = False) -> bool:
    """Validate `model_dir` holds a config and loadable weights; return whether they are safetensors.

    Checks the files transformers will read: config.json's `transformers_weights` if set, else model.safetensors
    or its index (whose shards must be safetensors inside the dir), and only without any, pickle weights."""
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"model dir {model_dir}: no config.json; expected a Hugging Face model directory"
                             f"{stage_model_hint(model_dir)}")
    explicit = _explicit_weights(model_dir)
    if explicit is not None:
        if not explicit.is_file():
            raise ModelLoadError(f"model dir {model_dir}: config.json's transformers_weights names "
                                 f"{explicit.name}, which is not there")
        if explicit.name.endswith(".index.json"):
            _check_index(model_dir, explicit)
        return True
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        _check_index(model_dir, index)
        return True
    if (model_dir / "model.safetensors").is_file():  # the name transformers reads (a FIFO of that name is none)
        return True
    pickled = sorted(p.name for pattern in PICKLE_PATTERNS for p in model_dir.glob(pattern))
    if not pickled:
        others = sorted(p.name for p in model_dir.glob("*.safetensors"))  # an adapter's, a head's: not a model's
        raise ModelLoadError(f"model dir {model_dir}: no model.safetensors (nor model.safetensors.index.json)"
                             + (f"; {', '.join(others)} are not the model's weights" if others else ""))
    if not allow_pickle:
        # Pickle files can run arbitrary code when loaded.
        raise ModelLoadError(
            f"model dir {model_dir}: only pickle weights ({', '.join(pickled)}); convert them to safetensors "
            "or pass allow_pickle=True if you trust the source"
        )
    return False


def refuse_hub_kernels(model_dir: Path) -> None:
    """A one-line ModelLoadError if config.json (or a sub-config in it) sets its attention implementation to a
    Hugging Face Hub kernel repo (`kernels-community/flash-attn`): transformers would fetch and run that repo's
    code whatever trust_remote_code says. For callers that do not trust the dir's code."""
    pending = [json.loads((model_dir / "config.json").read_bytes())]
    while pending:
        config = pending.pop()
        for key, value in config.items():
            if isinstance(value, dict):
                pending.append(value)
            elif key in ("attn_implementation", "_attn_implementation") and isinstance(value, str) and "/" in value:
                raise ModelLoadError(f"model dir {model_dir}: config.json's {key} {value!r} is a Hub kernel repo, "
                                     "whose code transformers would run; remove it, or trust the dir's code "
                                     "(trust_remote_code)")


def read_marker(final: Path) -> dict:
    """A final's marker: a JSON object, else OSError/ValueError. Read with the json module that wrote it (its metrics
    may hold NaN, which orjson refuses)."""
    marker = json.loads((final / FINAL_MARKER).read_bytes())
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


def head_files(model_dir: Path, kind: str) -> tuple[Path, Path]:
    """The head files of a `kind` ("reward", "value") model dir: its config and weights; ModelLoadError when either
    is missing (a policy dir given as a reward model, say)."""
    config_file, head_file = model_dir / f"{kind}_config.json", model_dir / f"{kind}_head.safetensors"
    if not config_file.is_file() or not head_file.is_file():
        maker = "rm stage (`from:rm` in a pipeline)" if kind == "reward" else "PPO (its critic)"
        raise ModelLoadError(f"{model_dir}: not a {kind} model dir (needs {config_file.name} and {head_file.name}); "
                             f"alignflow's {maker} writes one")
    return config_file, head_file
