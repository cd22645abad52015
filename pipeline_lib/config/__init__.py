"""Stage configs (one pydantic model per stage; also the flow parameters) and the YAML preset loader: the machinery
in `base`, the training stages in `training`, sampling, evaluation and the tiny model in `sampling`, the pipeline
and how cache keys read a config in `pipeline`."""

from pipeline_lib.config.base import (
    DEVICE_PATTERN,
    REPO_ROOT,
    Config,
    ConfigError,
    IngestConfig,
    check_ingest_files,
    format_validation_error,
    load_yaml,
    replaced_source_shared,
    shipped_path,
    validate_config,
)
from pipeline_lib.config.pipeline import (
    FORCEABLE,
    FROM,
    KEEPING_FIELDS,
    MODEL_FIELDS,
    POLICY_STAGES,
    REF_FIELDS,
    REF_TARGETS,
    STAGE_ORDER,
    PipelineConfig,
    check_preset,
    config_key,
    load_config,
    model_paths,
    refuse_stage_references,
    stored_selection,
)
from pipeline_lib.config.sampling import EvalConfig, PipelineEvalConfig, SampleConfig, TinyModelConfig
from pipeline_lib.config.training import (
    DAPOConfig,
    DPOConfig,
    GRPOConfig,
    OnlineRLConfig,
    PPOConfig,
    RMConfig,
    SFTConfig,
    TrainLoopConfig,
)

__all__ = [
    "DEVICE_PATTERN", "FORCEABLE", "FROM", "KEEPING_FIELDS", "MODEL_FIELDS", "POLICY_STAGES", "REF_FIELDS",
    "REF_TARGETS", "REPO_ROOT", "STAGE_ORDER", "Config", "ConfigError", "DAPOConfig", "DPOConfig", "EvalConfig",
    "GRPOConfig", "IngestConfig", "OnlineRLConfig", "PPOConfig", "PipelineConfig", "PipelineEvalConfig", "RMConfig",
    "SFTConfig", "SampleConfig", "TinyModelConfig", "TrainLoopConfig", "check_ingest_files", "check_preset",
    "config_key", "format_validation_error", "load_config", "load_yaml", "model_paths", "refuse_stage_references",
    "replaced_source_shared", "shipped_path", "stored_selection", "validate_config",
]
