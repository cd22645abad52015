"""Stage configs (one pydantic model per stage; also the flow parameters) and the YAML preset loader."""

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

REPO_ROOT = Path(__file__).resolve().parents[1]
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
    """yaml.safe_load (with YAML 1.2 booleans: _PresetLoader), refusing repeated keys (_refuse_repeated_keys)."""
    loader = _PresetLoader(text)
    try:
        root = loader.get_single_node()
        _refuse_repeated_keys(root)
        return loader.construct_document(root) if root is not None else None
    finally:
        loader.dispose()


def load_yaml(path: str | Path) -> dict:
    """Read a YAML preset (as given, else in the checkout) into a dict; one-line errors for a missing file or
    bad YAML."""
    path = shipped_path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: a directory; expected a YAML config file")
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
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


def load_config(model: type[M], path: str | Path) -> M:
    """Load a YAML (or JSON) preset file into a stage config (`check_preset`)."""
    data = load_yaml(path)
    cfg = validate_config(model, data, origin=str(path))
    check_preset(cfg, data, origin=str(path))
    return cfg


def check_preset(cfg: BaseModel, data: dict, origin: str) -> None:
    """What a preset file must hold beyond its config's validation, checked on the file, not on every validation
    (a config built in code may name a file written later; a config's dump, a deployment's parameters, lists every
    field): the files it ingests are there and readable, and a pipeline naming eval_models has an eval section."""
    if isinstance(cfg, PipelineConfig) and cfg.eval is None and data.get("eval_models"):  # `eval:` left empty
        raise ConfigError(f"{origin}: eval_models: set, but the preset has no eval section (an empty `eval:` is "
                          "none): give it the sampling settings (`eval: {n: 16}`), or leave eval_models out")
    check_ingest_files(cfg, origin)


def check_ingest_files(cfg: BaseModel, origin: str = "config") -> None:
    """The files an ingest config (or a pipeline's `ingest` list) names exist and ingest can read them as a whole
    (type, records, format), else one ConfigError line naming the field (`load_config`); a missing file would
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
            check_readable(resolved, ingest.format, ingest.max_record_bytes)
        except IngestError as exc:  # ingest would refuse it, after the pipeline ingested the files before it
            raise ConfigError(f"{origin}: field '{field}': {exc}") from None


# ---- training stages (SFT, RM, DPO); the loops live in pipeline_lib/train/


class TrainLoopConfig(Config):
    """Optimizer, schedule, batching and checkpoint settings shared by the SFT, RM and DPO loops."""

    max_steps: int = Field(500, ge=1)
    """Optimizer updates to run; the data order repeats in seeded epochs as needed."""
    batch_size: int = Field(64, ge=1)
    """Rows (SFT), pairs/rankings (RM) or pairs (DPO) per optimizer update, summed over all ranks."""
    grad_accum_steps: int = Field(1, ge=1)
    """Micro-batches per update (memory only: the update is the same); must divide batch_size / world size."""
    lr: float = Field(1e-4, gt=0)
    """Peak AdamW learning rate (SFT 1e-5..1e-3, RM 1e-5..1e-4, DPO 5e-7..1e-5 on real models)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay (Loshchilov & Hutter 2019), typically 0..0.1."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps before the schedule."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    """After warm-up: constant, linear decay to 0, or cosine decay to 10% of the peak."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; None disables clipping."""
    max_length: int = Field(256, ge=2)
    """Max tokens of prompt + response; longer rows lose prompt tokens from the left (a DPO pair one cut for both
    answers); a response alone too long is cut from the right, with a warning."""
    save_every: int = Field(100, ge=1)
    """Write a resumable checkpoint (model, optimizer, scheduler, RNG, step) every N steps."""
    eval_every: int = Field(0, ge=0)
    """Held-out evaluation every N steps (0: only before and after training)."""
    log_every: int = Field(10, ge=1)
    """Log training metrics every N steps."""
    seed: Seed = 0
    """Seeds the data order, the held-out split and torch's RNG."""
    deterministic: bool = False
    """torch's deterministic kernels (`torch.use_deterministic_algorithms`, deterministic cuDNN, no benchmarking),
    so two CUDA runs of one config on the same GPU and software give the same weights; slower on CUDA, and an op
    without such a kernel is an error. CPU training is deterministic already; the sample stage's vLLM server is not
    covered."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """`auto` (CUDA with bf16 autocast when available, else CPU fp32), `cpu`, `cuda` or `cuda:N`."""
    trust_remote_code: bool = False
    """Allow model code shipped with a hub checkpoint (off by default: it would run the checkpoint's Python)."""
    processes: Processes = "auto"
    """torchrun processes the stage trains in (DDP: each takes batch_size / processes rows of every update).
    `auto`: one per visible CUDA GPU when `device` is `auto` or `cuda` and more than one is visible, else 1 (in
    this process); an int >= 1 is used as given (2 on CPU trains on gloo, as the tests do). Not part of the
    stage's keys: the result is the same up to float rounding (`KEEPING_FIELDS`)."""

    @model_validator(mode="after")
    def _accumulation_divides_batch(self):
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of grad_accum_steps {self.grad_accum_steps}")
        return self


class SFTConfig(TrainLoopConfig):
    """Supervised fine-tuning: next-token loss on the response tokens only."""

    model_path: str = Field(min_length=1)
    """Starting causal LM: a local HF model dir (the tiny base model in the demo) or a cached hub id."""
    data: Literal["problems", "pairs", "best_of_n"] = "problems"
    """`problems`: gold answers of the problems table; `pairs`: the chosen responses of preference_pairs;
    `best_of_n`: the top-reward sample per prompt of a sampling run (rejection-sampling SFT, RS-SFT)."""
    split: str = "train"
    """Problems split to train on (data=problems); the `test` split, when present, gives eval/loss."""
    source: str | None = None
    """Only rows whose `source` column equals this (problems / preference_pairs); None keeps all."""
    samples_run_id: str | None = None
    """samples.run_id of the sampling run whose Best-of-N selection is the data (data=best_of_n)."""
    min_reward: float | None = None
    """data=best_of_n: drop prompts whose best sample scored below this (1.0 with the verifier keeps only
    verified answers); None keeps the best of every prompt."""
    chat_template: bool = False
    """Render plain prompts (problems, plain pairs, Best-of-N selections) as one user turn with the tokenizer's
    chat template, as SampleConfig does for instruct models; False trains on the raw text (`12+34=`). Pairs with
    stored messages always use it. With data=best_of_n it must be the sampling run's own setting (an error
    otherwise). A chat row's completion ends with the template's end of turn where the model stops on it, else eos
    (`train.data.turn_end_ids`)."""
    lr: float = Field(1e-3, gt=0)
    """Peak AdamW learning rate (1e-3 for the tiny demo model; 1e-5..2e-5 for real LMs)."""
    batch_size: int = Field(128, ge=1)
    """Rows per optimizer update, summed over all ranks."""

    @model_validator(mode="after")
    def _best_of_n_needs_run(self):
        if self.data == "best_of_n" and not self.samples_run_id:
            raise ValueError("data=best_of_n needs samples_run_id (the sampling run to select from)")
        if self.data != "best_of_n" and (self.samples_run_id is not None or self.min_reward is not None):
            raise ValueError(f"samples_run_id and min_reward select a Best-of-N sampling run: they go with "
                             f"data=best_of_n, not data={self.data}")
        return self


class RMConfig(TrainLoopConfig):
    """Reward model: causal-LM backbone + scalar head trained on preferences."""

    model_path: str = Field(min_length=1)
    """Backbone init: the SFT checkpoint (usual) or the base model."""
    loss: Literal["bradley_terry", "plackett_luce"] = "bradley_terry"
    """`bradley_terry` on preference_pairs (InstructGPT eq. 1) or `plackett_luce` on rankings (K responses)."""
    pooling: Literal["last_token", "mean", "last_two_layers"] = "last_token"
    """Hidden state fed to the head: last token, masked mean, or mean of the last two layers at the last token
    (both through the backbone's final norm)."""
    margin: float = 0.0
    """Bradley-Terry margin m in -log σ(r_w - r_l - m) (Llama 2 eq. 2); 0 is the plain loss."""
    disable_dropout: bool = True
    """Train with dropout off (TRL's RewardConfig default). False trains with the backbone's dropout on; a group's
    responses then run as rows of their own, each drawing its own dropout (packed behind their shared prompt they
    would share one draw over it)."""
    source: str | None = None
    """Only pairs/rankings whose `source` equals this; None keeps all."""
    eval_fraction: float = Field(0.1, gt=0, lt=1)
    """Seeded share of pairs/rankings held out for eval/rm_accuracy."""
    lr: float = Field(3e-4, gt=0)
    """Peak AdamW learning rate (3e-4 for the tiny demo model; 1e-5..1e-4 for real LMs)."""


class DPOConfig(TrainLoopConfig):
    """Direct Preference Optimization on preference_pairs, reference = the starting policy."""

    policy_path: str = Field(min_length=1)
    """Starting policy (usually the SFT checkpoint); also the frozen reference."""
    beta: float = Field(0.1, gt=0)
    """KL strength β, typically 0.1-0.5 (Rafailov et al. 2023)."""
    label_smoothing: float = Field(0.0, ge=0, le=0.5)
    """Conservative-DPO label noise ε (Mitchell 2023); 0 is plain DPO."""
    rpo_alpha: float = Field(0.0, ge=0)
    """Weight α of RPO's per-token NLL on the chosen response (Pang et al. 2024; they use 1.0 on GSM8K); 0 is
    plain DPO. Keeps DPO from lowering the chosen answers' likelihood on near-miss pairs."""
    source: str | None = None
    """Only pairs whose `source` equals this; None keeps all."""
    samples_run_id: str | None = None
    """Train on the West-of-N pairs of this sampling run alone (`from:sample` in a pipeline), instead of
    preference_pairs: the pairs the West-of-N filter makes from its samples, none of an earlier run."""
    eval_fraction: float = Field(0.1, gt=0, lt=1)
    """Seeded share of pairs held out for eval/pref_accuracy and eval/logp_margin."""
    ref_batch_size: int = Field(256, ge=1)
    """Rows per forward pass of the one-time reference log-prob computation (and the held-out evals); a pair counts
    as two rows, packed or not."""
    disable_dropout: bool = True
    """Train with dropout off (TRL's default): the policy is then the same function as the cached reference
    at step 0 (loss log 2). False trains with the model's dropout and lora_dropout on, and a pair's answers as two
    rows (packed behind their prompt they would share one dropout draw over it)."""
    lora_r: int = Field(0, ge=0)
    """LoRA rank through peft (Hu et al. 2021), e.g. 8-64; 0 trains all weights. With LoRA the reference is
    the policy with adapters disabled (no second copy) and the final model has the adapters merged."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator: the update is (alpha / r) · B A."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input, 0..0.1; needs disable_dropout false."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Module names that get adapters (Llama attention projections by default)."""
    lr: float = Field(5e-7, gt=0)
    """Peak AdamW learning rate (5e-7..5e-6 on real LMs; the tiny demo model needs ~1e-4)."""

    @model_validator(mode="after")
    def _fields_agree(self):
        if self.source and self.samples_run_id:
            raise ValueError("set one of source (stored pairs) and samples_run_id (a sampling run's West-of-N pairs)")
        if self.lora_r > 0 and not self.lora_target_modules:
            raise ValueError(f"lora_r {self.lora_r} but lora_target_modules is empty: name the modules to adapt")
        if self.lora_dropout > 0 and self.disable_dropout:
            raise ValueError(f"lora_dropout {self.lora_dropout} has no effect while disable_dropout is true: set "
                             "disable_dropout false to train with dropout")
        return self


# ---- sampling stage (pipeline_lib/sampling/stage.py)


class SampleConfig(Config):
    """N samples per problem from a policy, scored and written to the `samples` table (`alignflow sample`)."""

    model_path: str = Field(min_length=1)
    """Policy to sample from: a local HF model dir (a cached hub id also works with the hf backend)."""
    problems_source: str | None = None
    """Only problems whose `source` equals this (e.g. `problems` for data/demo/problems.jsonl); None keeps all."""
    split: str = "test"
    """Problems split to sample: `train` for Best-of-N / West-of-N data, `test` for evaluation."""
    max_problems: int | None = Field(None, ge=1)
    """Sample only the first K problems in problem_id order; None samples them all."""
    n: int = Field(16, ge=1)
    """Samples per prompt: N of Best-of-N, G of GRPO, the K budget of Pass@K (typically 4-64)."""
    max_new_tokens: int = Field(64, ge=1)
    """Generation budget per sample; longer samples end with finish_reason `length` (demo: 6, GSM8K: 256+)."""
    temperature: SamplingTemperature = 1.0
    """Softmax temperature; 0 is greedy (then all n samples are equal). RL rollouts use 1.0."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (Holtzman et al. 2020); 1.0 disables it."""
    seed: Seed = 0
    """Batch b of the run is sampled with seed + b, so a resumed run reproduces an uninterrupted one."""
    stop: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    """Strings that end a sample early (cut from the text, finish_reason `stop`); eos always stops."""
    chat_template: bool = False
    """Render each prompt as one user turn with the tokenizer's chat template (instruct models);
    False sends the problem text raw (the demo's `12+34=`)."""
    backend: Literal["hf", "vllm"] = "hf"
    """`hf`: in-process transformers generate; `vllm`: vLLM's server in its own venv (`make vllm-env`)."""
    vllm_url: str | None = None
    """Base URL of an already running vLLM server to use instead of starting one (backend vllm only)."""
    vllm_max_model_len: int | None = Field(None, ge=16)
    """Context length the started vLLM server reserves KV cache for; None: the model's maximum."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """Device of the hf backend: `auto` (CUDA when available), `cpu`, `cuda`, `cuda:N`."""
    batch_size: int = Field(32, ge=1)
    """Prompts per generate call and per store write (a crash loses at most one batch); part of the run id,
    since the hf backend's random stream depends on the batch."""
    rewards: RewardSpecs = ({"name": "verifier", "weight": 1.0},)
    """Reward specs `{name, weight, **options}` summed into `samples.reward` (pipeline_lib.rewards.registry):
    `verifier` (1 if correct, else its option `incorrect`, default 0), `overlong` (DAPO shaping,
    max_len/cache_len), `reward_model`."""
    reward_model_path: str | None = None
    """Reward model dir scoring prompt + completion, needed when `rewards` names `reward_model`."""
    run_id: str | None = None
    """samples.run_id; None derives it from this config and the fingerprints of the model dirs, so a rerun of the
    same config resumes (skips prompts already sampled) and a retrained model starts a new run. A crash-resumed
    run holds exactly the rows of an uninterrupted one; problems ingested after a run started are sampled in
    batches of their own (with the hf backend, other random draws than a fresh run's, from the same policy);
    `device` is not part of the id, and CPU and CUDA draw different random streams. With max_problems, the
    selected problems' ids are part of it too (another first K is another run). An explicit run_id reused with
    another `n` is an error; its rows are not checked against the rest of the config."""
    policy_name: str | None = None
    """samples.policy label; None uses model_path."""

    @model_validator(mode="after")
    def _check_backend_and_rewards(self):
        _check_vllm_settings(self.backend, vllm_url=self.vllm_url, vllm_max_model_len=self.vllm_max_model_len)
        _check_reward_specs(self.rewards, self.reward_model_path)
        return self


def _check_vllm_settings(backend: str, **settings: object) -> None:
    """Settings of the vLLM backend are set only with it: with `hf` they would be ignored."""
    named = next((name for name, value in settings.items() if value is not None), None)
    if named is not None and backend != "vllm":
        raise ValueError(f"{named} is set but backend is not 'vllm'")


# ---- online RL stages (pipeline_lib/train/grpo.py, ppo.py)


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


def _check_mini_batches(mini_batch_size: int | None, rows_per_step: int, rows_from: str) -> None:
    """A mini-batch smaller than the step must divide its rows: a short last mini-batch would get a full optimizer
    update of its own on a noisier gradient (TRL refuses such batch sizes too). One at least as large as the step
    updates once on the whole step."""
    if mini_batch_size is not None and mini_batch_size < rows_per_step and rows_per_step % mini_batch_size:
        raise ValueError(f"mini_batch_size {mini_batch_size} does not split the {rows_per_step} completions of a "
                         f"step ({rows_from}) into equal updates: expected a divisor of {rows_per_step}")


class GRPOConfig(Config):
    """GRPO (DeepSeekMath, arXiv:2402.03300): G samples per prompt from θ_old, group-normalized advantages,
    clipped surrogate + β·k3 KL to the reference, μ updates per rollout. Defaults are the paper's."""

    policy_path: str = Field(min_length=1)
    """Starting policy (the SFT checkpoint); also the frozen reference when beta > 0."""
    problems_source: str | None = None
    """Only problems whose `source` equals this; None keeps all."""
    split: str = "train"
    """Problems split whose prompts are the rollout prompts."""
    chat_template: bool = False
    """Render each problem as one user turn with the tokenizer's chat template (as the SFT stage did);
    False sends the problem text raw (the demo's `12+34=`)."""
    rewards: RewardSpecs = ({"name": "verifier", "weight": 1.0},)
    """Reward specs `{name, weight, **options}` summed per sample (pipeline_lib.rewards.registry):
    `verifier` (1 if correct, else its option `incorrect`, default 0), `overlong` (DAPO shaping,
    max_len/cache_len), `reward_model`."""
    reward_model_path: str | None = None
    """Reward model dir, needed when `rewards` names `reward_model`."""
    loss: Literal["grpo", "dr_grpo", "dapo"] = "grpo"
    """Policy loss from losses.LOSSES: `grpo` (per-sequence token mean, symmetric clip, k3 KL), `dr_grpo` (the
    same terms summed over tokens / (completions · max_new_tokens), with scale_rewards false: Dr.GRPO) or `dapo`
    (token-level mean, clip-higher, no KL term unless `beta` is given)."""
    max_steps: int = Field(200, ge=1)
    """Rollout steps: each generates one batch, then runs num_iterations passes of mini-batch updates."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts per rollout; completions per step = prompts_per_step * group_size (paper: 1024 completions)."""
    group_size: int = Field(64, ge=2)
    """G samples per prompt (DeepSeekMath: 64; DAPO: 16)."""
    num_iterations: int = Field(1, ge=1)
    """μ: passes over each rollout batch with θ_old fixed (DeepSeekMath: 1, a single update per rollout)."""
    mini_batch_size: int | None = Field(None, ge=1)
    """Completions per optimizer update, a divisor of prompts_per_step * group_size; None (or a value at least that
    large) updates once on the whole rollout batch per iteration. Each update's loss is reduced over its own
    mini-batch (DAPO's token mean: over the mini-batch's tokens, as verl does)."""
    lr: float = Field(1e-6, gt=0)
    """Peak AdamW learning rate (DeepSeekMath and DAPO: 1e-6; the tiny demo model: 2e-4; >= 3e-4 collapses it)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay (DAPO: 0.1)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up, in training steps (rollouts): every update of a step uses the same rate, and a step whose
    groups dynamic sampling all dropped still advances the schedule."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up, over max_steps: constant, linear decay to 0, or cosine decay to 10% of the peak."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; None disables clipping."""
    max_new_tokens: int = Field(1024, ge=1)
    """Generation budget per completion (DeepSeekMath: 1024; the demo: 6)."""
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE)
    """Sampling temperature of the rollouts. θ, θ_old and the reference log-probs divide the logits by it too
    (as TRL and verl do), so the ratio and the KL are taken on the distribution the rollouts were drawn from."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 disables it (anything else biases the ratio π/π_old)."""
    beta: float = Field(0.04, ge=0)
    """β of the k3 KL term to the reference (DeepSeekMath: 0.04); 0 loads no reference model."""
    clip_eps_low: float = Field(0.2, gt=0, lt=1)
    """ε (ε_low for DAPO): the ratio is clipped below at 1 - ε."""
    clip_eps_high: float = Field(0.2, gt=0)
    """ε_high: the ratio is clipped above at 1 + ε_high; DAPO's clip-higher uses 0.28, GRPO keeps it = ε_low."""
    scale_rewards: bool = True
    """Divide the group-centred rewards by the group std (GRPO); False centres only, as Dr.GRPO (arXiv:2503.20783)
    does; its other change, no 1/|o_i| length normalization, is `loss: dr_grpo`."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: keep only groups with 0 < #correct < G (raw verifier outcome) and refill."""
    max_refill_rounds: int = Field(4, ge=0)
    """Extra rollout rounds to refill a batch emptied by dynamic sampling; after them it trains on what it has."""
    backend: Literal["hf", "vllm"] = "hf"
    """`hf`: in-process transformers generate on the live policy; `vllm`: a vLLM server in its own venv that
    reloads the policy's saved weights before every rollout."""
    vllm_max_model_len: int | None = Field(None, ge=16)
    """Context length the vLLM server reserves KV cache for; None: the sampling client's default (256)."""
    save_every: int = Field(50, ge=1)
    """Write a resumable checkpoint (policy, optimizer, scheduler, RNG, data position) every N steps."""
    log_every: int = Field(1, ge=1)
    """Log metrics every N steps."""
    seed: Seed = 0
    """Seeds the prompt order, each rollout's sampling and the mini-batch order."""
    deterministic: bool = False
    """torch's deterministic kernels (`torch.use_deterministic_algorithms`, deterministic cuDNN, no benchmarking)
    for the HF rollouts and the updates, so two CUDA runs of one config on the same GPU and software give the same
    weights; slower on CUDA, and an op without such a kernel is an error. CPU training is deterministic already;
    vLLM sampling (`backend: vllm`) is not covered."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """`auto` (CUDA with bf16 autocast when available, else CPU fp32), `cpu`, `cuda` or `cuda:N`."""
    trust_remote_code: bool = False
    """Allow model code shipped with a hub checkpoint (off by default: it would run the checkpoint's Python)."""

    @model_validator(mode="before")
    @classmethod
    def _dapo_without_kl_by_default(cls, data: object) -> object:
        """`loss: dapo` has no KL term unless `beta` is given (DAPO §2.3), whatever this preset's default β."""
        if isinstance(data, dict) and data.get("loss") == "dapo" and "beta" not in data:
            return {**data, "beta": 0.0}
        return data

    @model_validator(mode="after")
    def _check_loss_options(self):
        _check_vllm_settings(self.backend, vllm_max_model_len=self.vllm_max_model_len)
        _check_reward_specs(self.rewards, self.reward_model_path)
        if self.loss in ("grpo", "dr_grpo") and self.clip_eps_high != self.clip_eps_low:
            raise ValueError(f"loss '{self.loss}' clips symmetrically: clip_eps_high must equal clip_eps_low "
                             "(use loss 'dapo')")
        if self.loss == "dr_grpo" and self.scale_rewards:
            raise ValueError("loss 'dr_grpo' centres the rewards without dividing by their std: scale_rewards must be "
                             "false (Dr.GRPO)")
        if self.clip_eps_high < self.clip_eps_low:
            raise ValueError(f"clip_eps_high {self.clip_eps_high} < clip_eps_low {self.clip_eps_low}: clip-higher "
                             "(DAPO §3.1) widens the upper bound, expected clip_eps_high >= clip_eps_low")
        if self.dynamic_sampling and not any(spec["name"] == "verifier" and spec.get("weight", 1.0) != 0
                                             for spec in self.rewards):
            raise ValueError("dynamic_sampling keeps the groups with 0 < #correct < G, which only a reward with the "
                             "verifier (weight != 0) varies: add {name: verifier} to rewards or set dynamic_sampling "
                             "false")
        for spec in self.rewards:
            if spec["name"] == "overlong" and int(spec.get("max_len", 0)) > self.max_new_tokens:
                raise ValueError(f"rewards overlong max_len {spec['max_len']} exceeds max_new_tokens {self.max_new_tokens}")
        return self

    @model_validator(mode="after")
    def _mini_batches_split_the_step(self):
        _check_mini_batches(self.mini_batch_size, self.rows_per_step,
                            f"prompts_per_step {self.prompts_per_step} * group_size {self.group_size}")
        return self

    @property
    def rows_per_step(self) -> int:
        """Completions one rollout step trains on when no group is filtered out: prompts_per_step * group_size."""
        return self.prompts_per_step * self.group_size


class DAPOConfig(GRPOConfig):
    """DAPO (arXiv:2503.14476) as a GRPO preset: clip-higher, token-level loss, overlong reward shaping,
    dynamic sampling, no KL (by default). Only the defaults differ; the loop is train_grpo."""

    rewards: RewardSpecs = (
        {"name": "verifier", "weight": 1.0, "incorrect": -1.0},
        {"name": "overlong", "weight": 1.0, "max_len": 20480, "cache_len": 4096},
    )
    """R = ±1 from the verifier (DAPO §2.4) plus the soft overlong punishment: L_max = 20480, L_cache = 4096
    (DAPO §3.4)."""
    loss: Literal["grpo", "dapo"] = "dapo"
    """Token-level policy-gradient loss (DAPO §3.3)."""
    prompts_per_step: int = Field(512, ge=1)
    """Prompt batch of 512 (DAPO §4.1)."""
    group_size: int = Field(16, ge=2)
    """16 responses per prompt (DAPO §4.1)."""
    mini_batch_size: int | None = Field(512, ge=1)
    """512 completions per update: 16 updates per rollout (DAPO §4.1)."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW weight decay 0.1 (DAPO §4.1)."""
    warmup_steps: int = Field(10, ge=0)
    """10 linear warm-up steps (rollouts)."""
    max_new_tokens: int = Field(20480, ge=1)
    """L_max: 16384 expected + 4096 soft-punishment cache (DAPO §4.1)."""
    beta: float = Field(0.0, ge=0)
    """No KL term by default (DAPO §2.3: the policy is meant to move away from the initial model); β > 0 adds
    GRPO's k3 term, reduced token-level with the rest."""
    clip_eps_high: float = Field(0.28, gt=0)
    """Clip-higher ε_high = 0.28 (DAPO §3.1)."""
    dynamic_sampling: bool = True
    """Keep only groups with 0 < #correct < G and refill (DAPO §3.2)."""


class PPOConfig(Config):
    """PPO for RLHF (InstructGPT; Ziegler et al. 2019): actor, frozen reference, reward model and critic;
    sequence reward + per-token KL penalty, GAE, clipped policy and value losses over several epochs."""

    policy_path: str = Field(min_length=1)
    """Starting policy (the SFT checkpoint); also the frozen reference."""
    rewards: RewardSpecs = ({"name": "reward_model", "weight": 1.0},)
    """Reward specs `{name, weight, **options}` summed into each completion's score (pipeline_lib.rewards.registry):
    the reward model (InstructGPT), the verifier on problems with answers (PPO on verifiable rewards, as in
    VAPO arXiv:2504.05118), or a weighted mix."""
    reward_model_path: str | None = None
    """Reward model dir from the RM stage (backbone + scalar head); needed when `rewards` names `reward_model`
    or the critic starts from it."""
    critic_init: Literal["reward_model", "policy"] = "reward_model"
    """Backbone the critic starts from (InstructGPT: the RM); its value head starts at zero."""
    prompts_table: Literal["problems", "preference_pairs"] = "problems"
    """Where the rollout prompts come from: problem prompts, or the prompts of preference pairs."""
    problems_source: str | None = None
    """Only rows whose `source` equals this; None keeps all."""
    split: str = "train"
    """Problems split whose prompts are used (prompts_table problems)."""
    chat_template: bool = False
    """Render plain prompts as one user turn with the tokenizer's chat template (as the SFT stage did);
    pair prompts stored as conversations always use it."""
    max_steps: int = Field(200, ge=1)
    """Rollout steps: each generates a batch, then runs ppo_epochs passes of mini-batch updates."""
    prompts_per_step: int = Field(64, ge=1)
    """Prompts per rollout (one completion each)."""
    ppo_epochs: int = Field(4, ge=1)
    """Passes over each rollout batch (PPO: 4; InstructGPT: 1..4)."""
    mini_batch_size: int | None = Field(16, ge=1)
    """Completions per optimizer update, a divisor of prompts_per_step; None (or a value at least that large)
    updates on the whole batch."""
    lr: float = Field(1e-5, gt=0)
    """Actor AdamW learning rate (InstructGPT 1.3B: ~1e-5)."""
    critic_lr: float = Field(5e-6, gt=0)
    """Critic AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up, in optimizer updates."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: constant, linear decay to 0, or cosine decay to 10% of the peak."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm (actor and critic together); None disables clipping."""
    max_new_tokens: int = Field(256, ge=1)
    """Generation budget per completion."""
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE)
    """Rollout sampling temperature; the actor, θ_old and reference log-probs divide the logits by it too."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 disables it."""
    kl_coef: float = Field(0.02, ge=0)
    """β_kl of the per-token penalty -β_kl·(log π - log π_ref) (InstructGPT: 0.02); the adaptive start value."""
    adaptive_kl: bool = False
    """Adapt β_kl toward kl_target (Ziegler et al. 2019, §2.2); False keeps it fixed."""
    kl_target: float = Field(6.0, gt=0)
    """Target sequence KL in nats for the adaptive controller (Ziegler et al.: 6)."""
    kl_horizon: int = Field(10000, ge=1)
    """Horizon of the adaptive controller, in samples (Ziegler et al.: 10000)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE discount γ (1.0 for RLHF: the reward comes at the end)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE λ (0.95)."""
    clip_eps: float = Field(0.2, gt=0, lt=1)
    """PPO ratio clip ε."""
    value_clip_eps: float = Field(0.2, gt=0)
    """Clip of the value update around the rollout values."""
    vf_coef: float = Field(0.1, ge=0)
    """Weight of the value loss in actor + critic loss."""
    whiten_advantages: bool = True
    """Normalize advantages over the batch's valid tokens (mean 0, std 1)."""
    backend: Literal["hf", "vllm"] = "hf"
    """`hf`: in-process transformers generate on the live policy; `vllm`: a vLLM server that reloads the
    policy's saved weights before every rollout."""
    vllm_max_model_len: int | None = Field(None, ge=16)
    """Context length the vLLM server reserves KV cache for; None: the sampling client's default (256)."""
    save_every: int = Field(50, ge=1)
    """Write a resumable checkpoint (actor, critic, optimizer, scheduler, RNG, KL coefficient) every N steps."""
    log_every: int = Field(1, ge=1)
    """Log metrics every N steps."""
    seed: Seed = 0
    """Seeds the prompt order, each rollout's sampling and the mini-batch order."""
    deterministic: bool = False
    """torch's deterministic kernels (`torch.use_deterministic_algorithms`, deterministic cuDNN, no benchmarking)
    for the HF rollouts and the updates, so two CUDA runs of one config on the same GPU and software give the same
    weights; slower on CUDA, and an op without such a kernel is an error. CPU training is deterministic already;
    vLLM sampling (`backend: vllm`) is not covered."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """`auto` (CUDA with bf16 autocast when available, else CPU fp32), `cpu`, `cuda` or `cuda:N`."""
    trust_remote_code: bool = False
    """Allow model code shipped with a hub checkpoint (off by default: it would run the checkpoint's Python)."""

    @model_validator(mode="after")
    def _check_rewards_and_critic(self):
        _check_vllm_settings(self.backend, vllm_max_model_len=self.vllm_max_model_len)
        _check_reward_specs(self.rewards, self.reward_model_path)
        if self.critic_init == "reward_model" and not self.reward_model_path:
            raise ValueError("critic_init 'reward_model' needs reward_model_path; set it or use critic_init 'policy'")
        if self.prompts_table == "preference_pairs" and any(spec["name"] == "verifier" for spec in self.rewards):
            raise ValueError("rewards name 'verifier' but prompts_table 'preference_pairs' has no answers; "
                             "use prompts_table 'problems'")
        return self

    @model_validator(mode="after")
    def _mini_batches_split_the_step(self):
        _check_mini_batches(self.mini_batch_size, self.prompts_per_step,
                            f"prompts_per_step {self.prompts_per_step}, one completion each")
        return self


# ---- model preparation (the tiny offline model of the demo and the tests)


class TinyModelConfig(Config):
    """A tiny Llama + character-level tokenizer built offline from the store's texts (pipeline_lib/models/tiny.py)."""

    corpus_sources: tuple[str, ...] | None = Field(None, min_length=1)
    """Store sources whose texts train the tokenizer (every character the model will see); None = all (in a
    pipeline: all but its `west_of_n_source`, the pairs its own runs add); an empty list is refused."""
    vocab_size: int | None = Field(None, ge=8)
    """BPE vocabulary size (more than the 7 special tokens); None = alphabet + specials only, every digit its own token (the demo's arithmetic needs them)."""
    hidden_size: int = Field(128, ge=8)
    """Model width (128 in the calibrated demo)."""
    num_layers: int = Field(2, ge=1)
    """Transformer blocks."""
    num_heads: int = Field(4, ge=1)
    """Attention heads."""
    head_dim: int = Field(32, ge=32)
    """Per-head width; >= 32 so vLLM's CPU attention can serve the model."""
    intermediate_size: int = Field(512, ge=8)
    """MLP width."""
    max_position_embeddings: int = Field(256, ge=16)
    """Longest sequence (prompt + response) the model accepts."""
    seed: Seed = 0
    """Init seed: same corpus + seed give byte-identical weights."""

    @model_validator(mode="after")
    def _heads_divide_the_width(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        return self


# ---- evaluation stage (pipeline_lib/evaluation.py: run_eval_stage)


class EvalConfig(Config):
    """Pass@K / Maj@K of one model on held-out problems: n samples per problem, then exact estimators."""

    model_path: str = Field(min_length=1)
    """Model to evaluate (a local HF model dir)."""
    model_name: str | None = None
    """Label of the model in eval_results, plots and metrics (e.g. `sft`, `grpo`); None uses model_path."""
    problems_source: str | None = None
    """Only problems whose `source` equals this; None keeps all."""
    split: str = "test"
    """Problems split evaluated (held out from training)."""
    max_problems: int | None = Field(None, ge=1)
    """Evaluate only the first K problems in problem_id order; None evaluates all."""
    n: int = Field(16, ge=1, le=1024)
    """Samples per problem (n >= the largest K; the unbiased estimators use all n; at most 1024, where Maj@K's
    subset counts still fit a float64: evaluation.MAX_SAMPLES)."""
    ks: tuple[int, ...] | None = None
    """K values of the Pass@K and Maj@K curves (each <= n); None: the powers of 2 up to n, and n (n = 16: 1, 2, 4,
    8, 16; n = 12: 1, 2, 4, 8, 12)."""
    max_new_tokens: int = Field(64, ge=1)
    """Generation budget per sample."""
    temperature: SamplingTemperature = 1.0
    """Sampling temperature (1.0: the policy's own distribution, the sampled Pass@1 the README quotes)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 disables it."""
    seed: Seed = 0
    """Sampling seed (per batch, so reruns reproduce)."""
    chat_template: bool = False
    """Render prompts with the tokenizer's chat template (instruct models)."""
    backend: Literal["hf", "vllm"] = "hf"
    """Sampling backend: in-process transformers or a vLLM server."""
    vllm_url: str | None = None
    """An already running vLLM server to use (backend vllm)."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """Device of the hf backend."""
    batch_size: int = Field(32, ge=1)
    """Prompts per generate call."""

    @model_validator(mode="after")
    def _check_backend_and_ks(self):
        _check_vllm_settings(self.backend, vllm_url=self.vllm_url)  # now, not when the flow builds its sampling run
        if self.ks is None:
            return self
        if not self.ks or max(self.ks) > self.n or min(self.ks) < 1:
            raise ValueError(f"ks {list(self.ks)}: expected values in 1..n={self.n}")
        if len(set(self.ks)) < len(self.ks):  # each K is one row of eval_results
            raise ValueError(f"ks {list(self.ks)}: each K may appear once")
        return self

    @property
    def k_values(self) -> tuple[int, ...]:
        """`ks`, or its default for n."""
        if self.ks is not None:
            return self.ks
        return tuple(k for k in sorted({2**i for i in range(self.n.bit_length())} | {self.n}) if k <= self.n)

    @property
    def label(self) -> str:
        return self.model_name or self.model_path

    @property
    def sample_config(self) -> SampleConfig:
        """The sampling run this evaluation reads (verifier reward; resumable like any sampling run)."""
        return SampleConfig(
            model_path=self.model_path, problems_source=self.problems_source, split=self.split,
            max_problems=self.max_problems, n=self.n, max_new_tokens=self.max_new_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, chat_template=self.chat_template,
            backend=self.backend, vllm_url=self.vllm_url, device=self.device, batch_size=self.batch_size,
            policy_name=self.label,
        )


class PipelineEvalConfig(EvalConfig):
    """A pipeline's `eval` section: the settings every model of its eval_models is evaluated with; each model is a
    stage's output, named after the stage (`PipelineConfig.eval_config`)."""

    model_path: str | None = None
    """Not set in a pipeline: the stages of eval_models give the models."""

    @model_validator(mode="after")
    def _models_come_from_the_stages(self):
        for field in ("model_path", "model_name"):
            if getattr(self, field) is not None:
                raise ValueError(f"{field}: a pipeline evaluates the output of each stage in eval_models, named after "
                                 f"the stage; leave {field} out (`alignflow eval --model DIR` evaluates a given model)")
        return self


# ---- the pipeline: stage configs chained by `from:<stage>` references (flows/pipeline.py)

FROM = "from:"
# Stages in the order the pipeline runs them; a `from:X` reference must name an enabled earlier stage.
STAGE_ORDER = ("base", "sft", "rm", "sample", "rs_sft", "dpo", "grpo", "dapo", "ppo")
POLICY_STAGES = ("base", "sft", "rs_sft", "dpo", "grpo", "dapo", "ppo")  # their output is a causal LM
# what a `from:` reference in each field may name: a policy, the reward model, or the sampling run
REF_TARGETS = {"model_path": POLICY_STAGES, "policy_path": POLICY_STAGES, "reward_model_path": ("rm",),
               "samples_run_id": ("sample",)}
REF_FIELDS = tuple(REF_TARGETS)
MODEL_FIELDS = ("model_path", "policy_path", "reward_model_path")  # the references that are model dirs
FORCEABLE = (*STAGE_ORDER, "eval")  # what a pipeline run's `force` may name


KEEPING_FIELDS = frozenset({"save_every", "processes"})
"""Config fields that change how a run is kept or where it runs, not what it trains or logs (`processes`: the same
updates up to float rounding; a checkpoint resumed under another world size says so). (`log_every` and
`eval_every` change the run's logged curves: they stay in its keys.)"""


def config_key(cfg: BaseModel) -> str:
    """A config as cache keys and run keys read it: its JSON without `KEEPING_FIELDS`, so a new checkpoint
    interval reuses a finished stage and resumes an interrupted one."""
    return cfg.model_dump_json(exclude=set(KEEPING_FIELDS))


def model_paths(cfg: BaseModel) -> list[str]:
    """The model dirs (or hub ids) a stage config names: starting policy, reward model."""
    return [path for path in (getattr(cfg, field, None) for field in MODEL_FIELDS) if path]


def stored_selection(cfg: BaseModel) -> tuple[str, dict[str, str | None]] | None:
    """(table, column filters) of the ingested rows a stage config reads, as its data loader selects them; None
    when it reads a sampling run."""
    if isinstance(cfg, SFTConfig):
        if cfg.data == "problems":
            return "problems", {"source": cfg.source, "split": cfg.split}
        return ("preference_pairs", {"source": cfg.source}) if cfg.data == "pairs" else None
    if isinstance(cfg, RMConfig):
        return ("preference_pairs" if cfg.loss == "bradley_terry" else "rankings"), {"source": cfg.source}
    if isinstance(cfg, DPOConfig):
        return None if cfg.samples_run_id else ("preference_pairs", {"source": cfg.source})
    if isinstance(cfg, PPOConfig) and cfg.prompts_table == "preference_pairs":
        return "preference_pairs", {"source": cfg.problems_source}
    return "problems", {"source": cfg.problems_source, "split": cfg.split}  # sample, GRPO, DAPO, PPO, eval


class PipelineConfig(Config):
    """A whole pipeline: the stages to run, each with its own config. A path field written `from:<stage>`
    (e.g. `policy_path: from:sft`) takes that stage's output when the pipeline runs; an explicit path is
    used as is. Omitted stages are skipped."""

    name: str = "pipeline"
    """Name of the pipeline's MLflow parent run and Prefect deployments."""
    schedule_cron: str | None = None
    """Cron schedule of the pipeline deployment registered by `alignflow serve` (e.g. `0 3 * * *`); a triggered run's
    own value changes nothing (the schedule is the deployment's)."""
    ingest: tuple[IngestConfig, ...] = ()
    """Files ingested first (relative paths resolve against the working dir, then the alignflow checkout)."""
    base: TinyModelConfig | None = None
    """Build the tiny offline model as the base policy (demo, tests); else set base_model_path."""
    base_model_path: str | None = None
    """A local HF model dir (or cached hub id) used as the base policy, for `from:base`."""
    sft: SFTConfig | None = None
    """Supervised fine-tuning of the base model."""
    rm: RMConfig | None = None
    """Reward model (Bradley-Terry or Plackett-Luce)."""
    sample: SampleConfig | None = None
    """N-way sampling whose groups feed Best-of-N (rs_sft) and West-of-N (pairs for dpo)."""
    west_of_n_source: str = "west_of_n"
    """preference_pairs.source under which the West-of-N pairs of the `sample` stage are stored (for a reward
    model or a later DPO run); a `dpo` stage with `samples_run_id: from:sample` trains on that run's alone."""
    rs_sft: SFTConfig | None = None
    """Rejection-sampling SFT on the Best-of-N selection of the `sample` stage (data: best_of_n)."""
    dpo: DPOConfig | None = None
    """Direct Preference Optimization."""
    grpo: GRPOConfig | None = None
    """GRPO online RL."""
    dapo: DAPOConfig | None = None
    """DAPO online RL (a GRPO preset)."""
    ppo: PPOConfig | None = None
    """PPO with actor, critic, reference and reward model."""
    eval: PipelineEvalConfig | None = None
    """Evaluation settings: every enabled stage of eval_models is evaluated with them (`eval_config`)."""
    eval_models: tuple[str, ...] = ("sft", "rs_sft", "dpo", "grpo", "dapo", "ppo")
    """Stages whose output models are evaluated (those enabled), compared in one Pass@K / Maj@K plot."""

    @model_validator(mode="after")
    def _references_point_back(self):
        if (self.base is None) == (self.base_model_path is None) and self.stage_refs():
            raise ValueError("set exactly one of base (tiny model) and base_model_path")
        enabled = {"base"} | {s for s in STAGE_ORDER[1:] if getattr(self, s) is not None}
        for stage, field, target in self.stage_refs():
            if target not in enabled or STAGE_ORDER.index(target) >= STAGE_ORDER.index(stage):
                earlier = [s for s in STAGE_ORDER[:STAGE_ORDER.index(stage)] if s in enabled]
                raise ValueError(f"{stage}.{field}: 'from:{target}' must name an enabled earlier stage: one of "
                                 f"{', '.join(earlier)}")
            if target not in REF_TARGETS[field]:
                raise ValueError(f"{stage}.{field}: 'from:{target}' is not a stage whose output fits {field}; "
                                 f"expected one of {REF_TARGETS[field]}")
        # MLflow, models/ and eval name an SFT run by its data (rs_sft = Best-of-N): each section must be its stage
        if self.rs_sft is not None and self.rs_sft.data != "best_of_n":
            raise ValueError(f"rs_sft.data: expected 'best_of_n' (rejection-sampling SFT), got {self.rs_sft.data!r}; "
                             "SFT on other data is the sft section")
        if self.sft is not None and self.sft.data == "best_of_n":
            raise ValueError("sft.data: 'best_of_n' is the rs_sft section (it runs after the sample stage)")
        unknown = set(self.eval_models) - set(POLICY_STAGES)
        if unknown:
            raise ValueError(f"eval_models: {sorted(unknown)} are not policy stages; expected names from {POLICY_STAGES}")
        if self.eval is not None and not self.evaluated:  # the eval section would evaluate nothing, silently
            runs = [s for s in POLICY_STAGES if s == "base" or getattr(self, s) is not None]
            raise ValueError(f"eval_models: none of {list(self.eval_models)} is run by this preset; its models are "
                             f"{runs}: name some of them, or leave the eval section out")
        return self

    def stage_refs(self) -> list[tuple[str, str, str]]:
        """(stage, field, referenced stage) of every `from:` field."""
        refs = []
        for stage in STAGE_ORDER[1:]:
            cfg = getattr(self, stage)
            for field in REF_FIELDS:
                value = getattr(cfg, field, None) if cfg is not None else None
                if isinstance(value, str) and value.startswith(FROM):
                    refs.append((stage, field, value[len(FROM):]))
        return refs

    def stored_selections(self) -> list[tuple[str, str, dict[str, str | None]]]:
        """(stage, table, column filters) of the ingested store rows each enabled stage and the evaluation read, so
        that a pipeline refuses a mistyped source or split before its first stage trains. Left out: what the
        pipeline makes itself (Best-of-N samples, a sampling run's West-of-N pairs, and, when it has a sample
        stage, preference pairs of the West-of-N source or of every source)."""
        selections = []
        for stage in [*STAGE_ORDER[1:], *(["eval"] if self.evaluated else [])]:
            cfg = getattr(self, stage)
            if cfg is not None and (selection := stored_selection(cfg)) is not None:
                selections.append((stage, *selection))
        made_here = (None, self.west_of_n_source) if self.sample is not None else ()
        return [(stage, table, where) for stage, table, where in selections
                if not (table == "preference_pairs" and where["source"] in made_here)]

    def resolved(self, stage: str, outputs: dict[str, str]) -> BaseModel:
        """The stage's config with its `from:` fields replaced by the outputs of earlier stages."""
        cfg = getattr(self, stage)
        update = {field: outputs[target] for s, field, target in self.stage_refs() if s == stage}
        return cfg.model_copy(update=update)

    def check_force(self, force: tuple[str, ...] | list[str]) -> None:
        """ConfigError unless every name in `force` is a stage this preset runs (or `eval`, with an eval section):
        forcing a stage it does not run would silently do nothing."""
        unknown = sorted(set(force) - set(FORCEABLE))
        if unknown:
            raise ConfigError(f"force: unknown stage(s) {unknown}; expected names from {FORCEABLE}")
        runs = [s for s in FORCEABLE if (s == "base" and self.base is not None)
                or (s not in ("base", "eval") and getattr(self, s) is not None) or (s == "eval" and self.evaluated)]
        absent = sorted(set(force) - set(runs))
        if absent:
            raise ConfigError(f"force: {absent} not run by this preset; it runs {runs}")

    def eval_config(self, stage: str, model_path: str) -> EvalConfig:
        """The evaluation of one stage's output model, labelled with the stage's name."""
        settings = self.eval.model_dump(exclude={"model_path", "model_name"})
        return EvalConfig(**settings, model_path=model_path, model_name=stage)

    @property
    def evaluated(self) -> tuple[str, ...]:
        """The enabled stages of eval_models; none without an `eval` section (it holds the sampling settings)."""
        if self.eval is None:
            return ()
        return tuple(s for s in self.eval_models if s == "base" or getattr(self, s) is not None)
