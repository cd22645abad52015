"""The config machinery: the strict base model, one-line validation errors, the YAML preset loader, the checks
several stages share."""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, ValidationError,
                      model_validator)

from pipeline_lib.errors import AlignflowError
from pipeline_lib.sampling.base import MIN_TEMPERATURE

REPO_ROOT = Path(__file__).resolve().parents[2]
M = TypeVar("M", bound=BaseModel)
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"
# Reward specs `{name, weight, **options}` keep their values as YAML gave them: the registry's checks
# (pipeline_lib.rewards.registry) refuse a boolean or a non-finite number, which pydantic would already have read
# as 1 (`weight: true`) or reported as a mismatch of one union member (`weight: .inf`).
RewardSpecs = tuple[dict[str, Any], ...]
# torch.manual_seed takes [-2**63, 2**64), but the stages seed with values derived from a seed (the data order of
# epoch e with seed * 100_003 + e, sampling batch b with seed + b), which a 32-bit seed keeps inside that range
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]
INT_LIMIT = 2**63  # every other integer fits in 64 bits, as torch, DuckDB and MLflow hold it


def _greedy_or_sampled(temperature: float) -> float:
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"expected 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}")
    return temperature


# a sampling run's temperature (0 = greedy); an RL rollout's must sample: Field(ge=MIN_TEMPERATURE)
SamplingTemperature = Annotated[float, Field(ge=0), AfterValidator(_greedy_or_sampled)]


def _auto_or_count(value: object) -> object:
    if value == "auto":
        return value
    count = int(value) if isinstance(value, str) and value.strip().isdigit() else value  # a UI parameter's text
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count < INT_LIMIT:
        raise ValueError(f"expected 'auto' or an integer >= 1, got {value!r}")
    return count


# a training stage's torchrun processes: `auto` or a count
Processes = Annotated[int | Literal["auto"], BeforeValidator(_auto_or_count)]


class ConfigError(AlignflowError, ValueError):
    """A one-line config error naming the file, the field and what was expected."""


def shipped_path(path: str | Path) -> Path:
    """`path` as given if it exists, else relative to the alignflow checkout (its data/ and flows/configs/),
    so the README's `data/...` and `flows/configs/...` work from any directory."""
    path = Path(path).expanduser()
    shipped = REPO_ROOT / path
    return path if path.exists() or path.is_absolute() or not shipped.exists() else shipped


def _value_types(annotation: object) -> set[object]:
    """The types of a field's values: {X} for `X`, `X | None`, `tuple[X, ...]` and `tuple[X, ...] | None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, tuple):
        return {kind for arg in typing.get_args(annotation) if arg not in (type(None), Ellipsis)
                for kind in _value_types(arg)}
    return {annotation}


class Config(BaseModel):
    """Base of every config: unknown fields, inf/NaN, a boolean given for a number, a float for an integer, anything
    but true/false for a boolean, and integers past 64 bits are errors; frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _exact_value_types(cls, data: object) -> object:
        # pydantic reads `max_steps: true` as 1, `ks: [1.0, 2]` as (1, 2) and `disable_dropout: 1` or 'off' as
        # booleans: each is a mistake in a preset, where YAML writes booleans true/false. A number written as a
        # string is still read (a quoted `lr: '1e-4'`, a Prefect UI parameter).
        for name, value in data.items() if isinstance(data, dict) else ():
            field = cls.model_fields.get(name)
            kinds = _value_types(field.annotation) if field is not None else set()
            values = value if isinstance(value, (list, tuple)) else (value,)
            if kinds & {int, float} and any(isinstance(v, bool) for v in values):
                raise ValueError(f"{name}: expected a number, got {value!r}")
            if kinds == {int} and any(isinstance(v, float) for v in values):
                raise ValueError(f"{name}: expected an integer, got {value!r}")
            if kinds == {bool} and value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}: expected true or false, got {value!r}")
        return data

    @model_validator(mode="after")
    def _integers_fit_64_bits(self):
        # checked after parsing: an integer may come as a string ('100000000000000000000000')
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            values = value if isinstance(value, tuple) else (value,)
            if _value_types(field.annotation) == {int} and any(v is not None and abs(v) >= INT_LIMIT for v in values):
                raise ValueError(f"{name}: {value!r} is out of range; expected an integer of magnitude below 2**63")
        return self


class IngestConfig(Config):
    path: str
    """File to ingest: .jsonl, .json (array), .csv (each also gzipped: .jsonl.gz, .json.gz, .csv.gz) or .parquet."""
    format: Literal["auto", "pairs", "hh", "chat", "ranking", "problem"] = "auto"
    """Record shape; `auto` detects it from the first valid records' keys."""
    source: str | None = None
    """Source name stored with each row; defaults to the file name without its type ending (`.jsonl.gz`, ...)."""
    split: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)] | None = None
    """Split for problems (`train`/`test`, stripped as a record's own); a `split` field in the records wins;
    default `train`."""
    max_record_bytes: int = Field(1_000_000, ge=1)
    """Records larger than this many bytes are quarantined (default 1 MB)."""
    replace: bool = False
    """Delete the source's stored rows (its quarantine rows too) in the transaction that stores the file's: an edited
    file then replaces what its earlier version stored. Without it, rows are added by content, so a changed row is
    stored beside the old one."""

    @property
    def resolved_path(self) -> Path:
        """`path` as given if it exists, else relative to the alignflow checkout (its shipped data/)."""
        return shipped_path(self.path)


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the config nested at `loc` inside `model` (for a did-you-mean), or [] if not a config."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            if isinstance(part, int):  # an item of a tuple of configs (`ingest[0]`)
                continue
            return []
        nested = [arg for arg in (field.annotation, *typing.get_args(field.annotation))
                  if isinstance(arg, type) and issubclass(arg, BaseModel)]
        if not nested:
            return []
        model = nested[0]
    return list(model.model_fields)


def format_validation_error(exc: ValidationError, origin: str, model: type[BaseModel] | None = None) -> str:
    """`origin: field 'a.b': <what was expected> (got ...)` for the first error, on one line; a misspelled
    field gets the closest real one, a cross-field check its own message. An unknown field is reported before
    the rest: a misspelled required field also makes the real one missing, and the misspelling is the cause."""
    errors = exc.errors()
    err = next((error for error in errors if error["type"] == "extra_forbidden"), errors[0])
    field = ".".join(str(part) for part in err["loc"])
    if err["type"] == "extra_forbidden":
        known = _fields_at(model, err["loc"][:-1]) if model is not None else []
        close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "misspelled? not a field of this config"
        return f"{origin}: unknown field '{field}' ({hint})"
    if err["type"] == "value_error":  # a validator's own message names the fields and what it expected
        where = f"{field}: " if field else ""
        return f"{origin}: {where}{err['ctx']['error']}"
    if err["type"] == "missing":  # its input is the whole mapping around the field: naming the field says it all
        return f"{origin}: missing required field '{field}'"
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return f"{origin}: field '{field or '<root>'}': {err['msg']} (got {got})"


def validate_config(model: type[M], data: object, origin: str = "config") -> M:
    """Validate `data` into `model`, turning pydantic's report into one ConfigError line."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, origin, model)) from None


def _refuse_repeated_keys(root: yaml.Node | None) -> None:
    """A key repeated among one mapping's own keys is a YAML error (PyYAML keeps the last one silently, so a second
    `dpo:` section would replace the first). Checked on the composed document, before construction: merging an
    anchor (`<<: *defaults`) rewrites the anchored mapping in place, so a key it merged in and then overrides
    would look repeated there. Merge keys are not own keys, so a mapping may override what it merged."""
    stack, seen = [root] if root is not None else [], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:  # an alias: checked where it was anchored
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            first_lines: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                stack.append(value_node)
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = (key_node.tag, key_node.value)
                if key in first_lines:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"repeated key {key_node.value!r} (first at line {first_lines[key]})", key_node.start_mark)
                first_lines[key] = key_node.start_mark.line + 1


MAX_EXPANDED_NODES = 100_000
"""A preset's values, counted with every alias expanded: a few hundred in a real one. A "billion laughs" file of
400 bytes (aliases of aliases) expands to 10^8 and more, which pydantic then walks (minutes, gigabytes)."""


def _refuse_alias_bombs(root: yaml.Node | None) -> None:
    """A YAML error if the document, its aliases expanded, holds over MAX_EXPANDED_NODES nodes. Counted on the
    composed graph, each distinct node once (a recursive alias, finite in memory, counts as one node)."""
    sizes: dict[int, int] = {}
    stack = [(root, False)] if root is not None else []
    while stack:
        node, children_counted = stack.pop()
        children = [part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        if children_counted:
            sizes[id(node)] = min(1 + sum(sizes.get(id(child), 1) for child in children), MAX_EXPANDED_NODES + 1)
            if sizes[id(node)] > MAX_EXPANDED_NODES:
                raise yaml.constructor.ConstructorError(
                    None, None, f"its aliases expand to over {MAX_EXPANDED_NODES:,} values (an alias bomb?)",
                    node.start_mark)
        elif id(node) not in sizes:
            sizes[id(node)] = 1  # while its children are counted: a child aliasing it counts as one
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)


class _PresetLoader(yaml.SafeLoader):
    """yaml.SafeLoader whose plain scalars read as YAML 1.2's: booleans are true/false (any case), so YAML 1.1's
    yes/no/on/off stay text (`source: no` names the source 'no', `chat_template: yes` is an error rather than true);
    integers are decimal (`010` is 10, not octal 8) or 0x hexadecimal, never base 60 (`1:30` stays text, not 90);
    floats need no sign in their exponent (`lr: 1e-4` and `1e5` are numbers); dates stay text (`source: 2024-01-01`)."""

    def construct_decimal_int(self, node):
        text = self.construct_scalar(node).replace("_", "")
        return int(text, 16) if text.lstrip("+-").startswith("0x") else int(text, 10)


_YAML_1_1_ONLY = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
                  "tag:yaml.org,2002:timestamp"}
_PresetLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML_1_1_ONLY]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_PresetLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))
_PresetLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:[0-9][0-9_]*|0x[0-9a-fA-F_]+)$"),
                                    list("-+0123456789"))
_PresetLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))
_PresetLoader.add_constructor("tag:yaml.org,2002:int", _PresetLoader.construct_decimal_int)


def _safe_load_unique(text: str) -> object:
    """yaml.safe_load (with YAML 1.2 booleans: _PresetLoader), refusing repeated keys (_refuse_repeated_keys) and
    alias bombs (_refuse_alias_bombs)."""
    loader = _PresetLoader(text)
    try:
        root = loader.get_single_node()
        _refuse_repeated_keys(root)
        _refuse_alias_bombs(root)
        return loader.construct_document(root) if root is not None else None
    finally:
        loader.dispose()


def load_yaml(path: str | Path) -> dict:
    """Read a YAML preset (as given, else in the checkout) into a dict; one-line errors for a missing file or
    bad YAML."""
    path = shipped_path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: a directory; expected a YAML config file")
    if not path.exists():
        raise ConfigError(f"{path}: config file not found")
    if not path.is_file():  # `--config <(...)`, /dev/null: read once here, the flows would read nothing
        raise ConfigError(f"{path}: not a regular file (a pipe or a device); save the config to a file")
    try:
        data = _safe_load_unique(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        raise ConfigError(f"{path}: empty config file; expected the stage's fields (`name: value` lines)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def check_ingest_files(cfg: BaseModel, origin: str = "config") -> None:
    """The files an ingest config (or a pipeline's `ingest` list) names exist and ingest can read them as a whole
    (type, records, format), and a file ingested with `replace` shares its source with no other file (it would
    delete their rows), else one ConfigError line naming the field (`load_config`); a missing file would
    otherwise surface only when the pipeline reaches its ingest step."""
    if isinstance(cfg, IngestConfig):
        files = {"path": cfg}
    else:
        files = {f"ingest.{i}.path": ingest for i, ingest in enumerate(getattr(cfg, "ingest", ()))}
    from pipeline_lib.store.ingest import IngestError, check_readable  # imports polars and DuckDB: only here

    for field, ingest in files.items():
        resolved = ingest.resolved_path
        if not resolved.exists():
            where = "" if Path(ingest.path).expanduser().is_absolute() else (
                f" (looked in the working directory and in the alignflow checkout {REPO_ROOT})")
            raise ConfigError(f"{origin}: field '{field}': no such file {ingest.path!r}{where}")
        try:
            check_readable(resolved, ingest.format, ingest.max_record_bytes, ingest.split)
        except IngestError as exc:  # ingest would refuse it, after the pipeline ingested the files before it
            raise ConfigError(f"{origin}: field '{field}': {exc}") from None
    ingests = list(files.values())
    if (shared := replaced_source_shared(ingests)) is not None:  # (a single file shares its source with none)
        source, indices = shared
        replacing = next(i for i in indices if ingests[i].replace)
        raise ConfigError(f"{origin}: field 'ingest.{replacing}.replace': true deletes what "
                          f"{' and '.join(f'ingest.{i}' for i in indices)} store under the one source {source!r}; "
                          "give each file its own `source`")


def replaced_source_shared(ingests: list[IngestConfig]) -> tuple[str, list[int]] | None:
    """The first source that a file ingested with `replace` shares with another file of `ingests` (its replace would
    delete their rows), with the positions of the files it holds; None when there is none."""
    from pipeline_lib.store.ingest import default_source  # imports polars and DuckDB: only here

    positions: dict[str, list[int]] = {}
    for i, ingest in enumerate(ingests):
        positions.setdefault(ingest.source or default_source(ingest.resolved_path), []).append(i)
    return next(((source, indices) for source, indices in positions.items()
                 if len(indices) > 1 and any(ingests[i].replace for i in indices)), None)


# ---- checks several stage configs share


def _check_vllm_settings(backend: str, **settings: object) -> None:
    """Settings of the vLLM backend are set only with it: with `hf` they would be ignored; so would those of the
    server alignflow starts (all but `vllm_url`) beside the `vllm_url` of a server already running."""
    named = next((name for name, value in settings.items() if value is not None), None)
    if named is not None and backend != "vllm":
        raise ValueError(f"{named} is set but backend is not 'vllm'")
    server = next((name for name, value in settings.items() if value is not None and name != "vllm_url"), None)
    if server is not None and settings.get("vllm_url") is not None:
        raise ValueError(f"{server} sets up the vLLM server alignflow starts; with vllm_url none is started (your "
                         "server's own settings apply): leave it out")


def _check_reward_specs(rewards: tuple[dict, ...], reward_model_path: str | None) -> None:
    """The registry's checks of every spec (name, weight, options), now rather than when the stage starts; one
    weight at least is not 0; `reward_model` also needs the RM dir."""
    from pipeline_lib.rewards.registry import check_reward_specs  # imports torch: only when validating

    check_reward_specs(rewards)
    if all(float(spec.get("weight", 1.0)) == 0 for spec in rewards):
        raise ValueError("rewards: every weight is 0, so every sample's reward would be 0 (no learning signal, nothing "
                         "to rank); give one reward a nonzero weight")
    if any(spec["name"] == "reward_model" for spec in rewards) and not reward_model_path:
        raise ValueError("rewards name 'reward_model' but reward_model_path is not set")
