"""Stage configs (one pydantic model per stage; also the flow parameters) and the YAML preset loader."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline_lib.errors import AlignflowError

STRICT = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
M = TypeVar("M", bound=BaseModel)


class ConfigError(AlignflowError, ValueError):
    """A one-line config error naming the file, the field and what was expected."""


class IngestConfig(BaseModel):
    model_config = STRICT

    path: str
    """File to ingest: .jsonl, .jsonl.gz, .json (array), .parquet or .csv."""
    format: Literal["auto", "pairs", "hh", "chat", "ranking", "problem"] = "auto"
    """Record shape; `auto` detects it from the first valid record's keys (DESIGN.md shapes a-e)."""
    source: str | None = None
    """Source name stored with each row; defaults to the file name without extensions."""
    split: str | None = None
    """Split for problems (`train`/`test`); a `split` field in the records wins; default `train`."""
    max_record_bytes: int = 1_000_000
    """Records larger than this many bytes are quarantined (default 1 MB)."""


def format_validation_error(exc: ValidationError, origin: str) -> str:
    """`origin: field 'a.b': <what was expected>` for the first error, on one line."""
    err = exc.errors()[0]
    field = ".".join(str(part) for part in err["loc"]) or "<root>"
    if err["type"] == "extra_forbidden":
        return f"{origin}: unknown field '{field}' (misspelled? not a field of this config)"
    return f"{origin}: field '{field}': {err['msg']} (got {err.get('input')!r})"


def validate_config(model: type[M], data: object, origin: str = "config") -> M:
    """Validate `data` into `model`, turning pydantic's report into one ConfigError line."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, origin)) from None


def load_yaml(path: str | Path) -> dict:
    """Read a YAML preset into a dict; one-line errors for a missing file or bad YAML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def load_config(model: type[M], path: str | Path) -> M:
    """Load a YAML (or JSON) preset file into a stage config."""
    return validate_config(model, load_yaml(path), origin=str(path))
