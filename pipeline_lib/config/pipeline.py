"""The pipeline config: stage configs chained by `from:<stage>` references, and how keys read a config."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, model_validator

from pipeline_lib.config.base import (
    M,
    Config,
    ConfigError,
    IngestConfig,
    check_ingest_files,
    load_yaml,
    validate_config,
)
from pipeline_lib.config.sampling import EvalConfig, PipelineEvalConfig, SampleConfig, TinyModelConfig
from pipeline_lib.config.training import DAPOConfig, DPOConfig, GRPOConfig, PPOConfig, RMConfig, SFTConfig


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


def refuse_stage_references(cfg: object, origin: str) -> None:
    """A stage config run on its own (`alignflow run <stage>`, a stage's deployment) names paths and run ids: a
    `from:` reference is an output only a pipeline preset resolves, else a one-line ConfigError naming `origin`
    (a deployment took `from:base` for a hub id, relative to where `serve` ran)."""
    for field in REF_FIELDS:
        value = getattr(cfg, field, None)
        if isinstance(value, str) and value.startswith(FROM):
            instead = "a sampling run id (`alignflow sample` prints it)" if field == "samples_run_id" else \
                "a path (a stage's output is under the workspace's models/, and `alignflow run` prints it)"
            raise ConfigError(f"{origin}: {field}: {value!r} names a pipeline stage, which only a pipeline preset "
                              f"can; give {instead}")


KEEPING_FIELDS = frozenset({"save_every", "processes", "vllm_gpu_memory_utilization"})
"""Config fields that change how a run is kept or where it runs, not what it trains or logs (`processes`: the same
updates up to float rounding; a checkpoint resumed under another world size says so; the vLLM server's memory share:
the same rollouts). (`log_every` and `eval_every` change the run's logged curves: they stay in its keys.)"""


def config_key(cfg: BaseModel) -> str:
    """A config as cache keys and run keys read it: its JSON without `KEEPING_FIELDS`, so a new checkpoint
    interval reuses a finished stage and resumes an interrupted one, and without the paths of its model dirs
    (`MODEL_FIELDS`): every key holds their content's fingerprint beside this (`model_paths`), so the same model at
    another path is the same input (a base rebuilt to the same files under a new key retrained every stage after it;
    so did a path written relative instead of absolute)."""
    return cfg.model_dump_json(exclude=set(KEEPING_FIELDS) | set(MODEL_FIELDS))


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
        stage, preference pairs of the West-of-N source or of every source read by a stage after it: sft and rm
        train before the sample stage, so the store must already hold theirs)."""
        selections = []
        for stage in [*STAGE_ORDER[1:], *(["eval"] if self.evaluated else [])]:
            cfg = getattr(self, stage)
            if cfg is not None and (selection := stored_selection(cfg)) is not None:
                selections.append((stage, *selection))
        made_here = (None, self.west_of_n_source) if self.sample is not None else ()
        after_sample = STAGE_ORDER[STAGE_ORDER.index("sample") + 1:]  # sft and rm train before its pairs exist
        return [(stage, table, where) for stage, table, where in selections
                if not (stage in after_sample and table == "preference_pairs" and where["source"] in made_here)]

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


# ---- presets: a YAML file of one stage config or of a pipeline


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
