"""Config loading: one-line errors naming the file and field; the pipeline's from:<stage> references."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pipeline_lib.config import (
    ConfigError,
    DAPOConfig,
    DPOConfig,
    EvalConfig,
    GRPOConfig,
    IngestConfig,
    PipelineConfig,
    PipelineEvalConfig,
    PPOConfig,
    RMConfig,
    SampleConfig,
    SFTConfig,
    TinyModelConfig,
    config_key,
    load_config,
    load_yaml,
    validate_config,
)

PRESETS = Path(__file__).resolve().parents[1] / "flows" / "configs"


def test_misspelled_field_is_one_line_error_naming_file_and_field(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("model_path: m\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, path)
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message and "learning_rate" in message


@pytest.mark.parametrize("model, text, expected", [
    (SFTConfig, "model_pth: m\n", "unknown field 'model_pth' (did you mean 'model_path'?)"),
    (DPOConfig, "polcy_path: m\nbeta: 0.1\n", "unknown field 'polcy_path' (did you mean 'policy_path'?)"),
])
def test_a_misspelled_required_field_is_named_not_reported_missing(tmp_path, model, text, expected):
    path = tmp_path / "stage.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(model, path)
    assert str(err.value) == f"{path}: {expected}"


def test_an_empty_corpus_source_list_is_refused_not_read_as_all_sources():
    with pytest.raises(ConfigError, match=r"^p.yaml: field 'corpus_sources': .*at least 1 item"):
        validate_config(TinyModelConfig, {"corpus_sources": []}, origin="p.yaml")


def test_yaml_booleans_are_true_and_false_only(tmp_path):
    """YAML 1.1's yes/no/on/off are text (YAML 1.2): a source named `no` is that source, `yes` is no boolean."""
    path = tmp_path / "sft.yaml"
    path.write_text("model_path: m\nsource: no\nsplit: off\nchat_template: False\n")
    cfg = load_config(SFTConfig, path)
    assert (cfg.source, cfg.split, cfg.chat_template) == ("no", "off", False)
    path.write_text("model_path: m\ntrust_remote_code: yes\n")
    with pytest.raises(ConfigError, match=r"trust_remote_code: expected true or false, got 'yes'"):
        load_config(SFTConfig, path)
    path.write_text("policy_path: m\ndisable_dropout: FALSE\ntrust_remote_code: True\n")
    cfg = load_config(DPOConfig, path)
    assert (cfg.disable_dropout, cfg.trust_remote_code) == (False, True)


def test_yaml_numbers_are_yaml_1_2s(tmp_path):
    """PyYAML's YAML 1.1 read `max_steps: 010` as octal 8, `save_every: 1:30` as 90 (base 60), `lr: 1e-4` as text
    and `source: 2024-01-01` as a date; YAML 1.2 reads 10, text, 0.0001 and text."""
    path = tmp_path / "sft.yaml"
    path.write_text("model_path: m\nmax_steps: 010\nlr: 1e-4\nsource: 2024-01-01\nsplit: 1:30\nseed: 0x1F\n"
                    "batch_size: 1_024\nweight_decay: .5\n")
    cfg = load_config(SFTConfig, path)
    assert (cfg.max_steps, cfg.lr, cfg.source, cfg.split, cfg.seed, cfg.batch_size, cfg.weight_decay) == (
        10, 1e-4, "2024-01-01", "1:30", 31, 1024, 0.5)
    path.write_text("model_path: m\nsave_every: 1:30\n")
    with pytest.raises(ConfigError, match=r"field 'save_every': Input should be a valid integer, unable to parse "
                                          r"string as an integer \(got '1:30'\)$"):
        load_config(SFTConfig, path)


@pytest.mark.parametrize(("model", "data", "message"), [
    (SampleConfig, {"model_path": "m", "temperature": 1e-40}, "temperature: expected 0 (greedy) or >= 0.01, got 1e-40"),
    (EvalConfig, {"model_path": "m", "temperature": 0.005}, "temperature: expected 0 (greedy) or >= 0.01, got 0.005"),
    (GRPOConfig, {"policy_path": "m", "temperature": 0.001},
     "field 'temperature': Input should be greater than or equal to 0.01 (got 0.001)"),
    (PPOConfig, {"policy_path": "m", "reward_model_path": "r", "temperature": 0},
     "field 'temperature': Input should be greater than or equal to 0.01 (got 0)"),
    (SampleConfig, {"model_path": "m", "stop": ["\n", ""]}, "field 'stop.1': String should have at least 1 character"),
])
def test_sampling_values_the_samplers_would_refuse_are_refused_at_load(model, data, message):
    with pytest.raises(ConfigError) as err:
        validate_config(model, data, origin="p.yaml")
    assert str(err.value).startswith(f"p.yaml: {message}")


def test_wrong_type_names_field_and_value(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("model_path: m\nmax_steps: many\n")
    with pytest.raises(ConfigError, match=r"field 'max_steps'.*'many'"):
        load_config(SFTConfig, path)


@pytest.mark.parametrize("text, expected", [("", "empty config file"), ("# all commented out\n", "empty config file"),
                                            ("[1, 2]\n", "expected a mapping at the top level, got list"),
                                            ("a: [1\n", "invalid YAML"),
                                            ("a:\n  b: 1\n c: 2\n", "invalid YAML at line 3, column 2")])
def test_bad_yaml_files(tmp_path, text, expected):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_config(SFTConfig, path)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(SFTConfig, "/no/such/file.yaml")


def test_a_directory_given_as_config_is_named_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="a directory; expected a YAML config file"):
        load_config(SFTConfig, tmp_path)


def test_a_missing_required_field_is_named_without_the_whole_input():
    with pytest.raises(ConfigError) as err:
        validate_config(SFTConfig, {"lr": 1e-4, "max_steps": 3}, origin="sft.yaml")
    assert str(err.value) == "sft.yaml: missing required field 'model_path'"


def test_demo_preset_validates_and_resolves_references():
    cfg = load_config(PipelineConfig, PRESETS / "demo.yaml")
    refs = {(stage, field): target for stage, field, target in cfg.stage_refs()}
    assert refs[("ppo", "reward_model_path")] == "rm"
    assert refs[("rs_sft", "samples_run_id")] == "sample"
    assert cfg.resolved("dpo", {"sft": "/m/sft", "sample": "sample-1"}).samples_run_id == "sample-1"
    resolved = cfg.resolved("ppo", {"sft": "/m/sft", "rm": "/m/rm"})
    assert resolved.policy_path == "/m/sft" and resolved.reward_model_path == "/m/rm"
    assert cfg.ppo.policy_path == "from:sft"  # the preset itself is unchanged (frozen)


def test_reference_to_a_later_or_disabled_stage_is_rejected():
    base = {"base": {}, "sft": {"model_path": "from:base"}}
    with pytest.raises(ConfigError, match=r"dpo.policy_path: 'from:grpo' must name an enabled earlier stage: one "
                                          r"of base, sft$"):  # the stages this preset runs before dpo, no others
        validate_config(PipelineConfig, base | {"dpo": {"policy_path": "from:grpo"}})
    with pytest.raises(ConfigError, match="from:rm"):
        validate_config(PipelineConfig, base | {"dpo": {"policy_path": "from:rm"}})


def test_each_sft_section_holds_the_data_its_stage_is_named_after():
    base = {"base": {}, "sft": {"model_path": "from:base"}}
    with pytest.raises(ConfigError, match=r"^config: rs_sft.data: expected 'best_of_n' \(rejection-sampling SFT\), "
                                          r"got 'pairs'"):
        validate_config(PipelineConfig, base | {"rs_sft": {"model_path": "from:sft", "data": "pairs"}})
    with pytest.raises(ConfigError, match=r"^config: sft.data: 'best_of_n' is the rs_sft section"):
        validate_config(PipelineConfig, {"base": {}, "sft": {"model_path": "from:base", "data": "best_of_n",
                                                             "samples_run_id": "sample-1"}})


def test_dpo_reads_stored_pairs_or_one_sampling_runs_not_both():
    with pytest.raises(ConfigError, match=r"set one of source \(stored pairs\) and samples_run_id"):
        validate_config(DPOConfig, {"policy_path": "/m", "source": "west_of_n", "samples_run_id": "sample-1"})


def test_explicit_paths_are_kept():
    cfg = validate_config(PipelineConfig, {"base_model_path": "/m/base", "sft": {"model_path": "/m/other"}})
    assert cfg.stage_refs() == []
    assert cfg.resolved("sft", {"base": "/m/base"}).model_path == "/m/other"


def test_every_shipped_preset_validates():
    for preset in PRESETS.glob("*.yaml"):
        cfg = load_config(PipelineConfig, preset)
        assert cfg.evaluated, preset


def test_a_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_bytes(b"model_path: m\nlr: \xff\n")
    with pytest.raises(ConfigError, match=r"x.yaml: not UTF-8 text \(byte 18"):
        load_config(SFTConfig, path)


@pytest.mark.parametrize(("model", "data", "message"), [
    (SFTConfig, {"model_path": "m", "max_steps": True}, "max_steps: expected a number, got True"),
    (SFTConfig, {"model_path": "m", "lr": True}, "lr: expected a number, got True"),
    (EvalConfig, {"model_path": "m", "ks": [True]}, "ks: expected a number, got [True]"),
    (SFTConfig, {"model_path": "m", "lr": float("inf")}, "field 'lr': Input should be a finite number"),
    (RMConfig, {"model_path": "m", "margin": float("nan")}, "field 'margin': Input should be a finite number"),
    (SFTConfig, {"model_path": ""}, "field 'model_path': String should have at least 1 character"),
    (SFTConfig, {"model_path": "m", "device": "gpu"}, "field 'device': String should match pattern"),
    (IngestConfig, {"path": "x", "max_record_bytes": 0}, "field 'max_record_bytes': Input should be greater"),
    (TinyModelConfig, {"vocab_size": 5}, "field 'vocab_size': Input should be greater than or equal to 8"),
    (DAPOConfig, {"policy_path": "m", "clip_eps_high": 0.1, "clip_eps_low": 0.2,
                  "rewards": [{"name": "verifier"}]}, "clip_eps_high 0.1 < clip_eps_low 0.2"),
    (DPOConfig, {"policy_path": "m", "lora_r": 8, "lora_target_modules": []}, "lora_target_modules is empty"),
    (SFTConfig, {"model_path": "m", "device": "cuda:1", "processes": 2},
     "device cuda:1 is one GPU, and processes 2 take one GPU each: expected device auto or cuda"),
    (PPOConfig, {"policy_path": "m", "reward_model_path": "r", "prompts_table": "preference_pairs",
                 "rewards": [{"name": "verifier"}]}, "prompts_table 'preference_pairs' has no answers"),
])
def test_invalid_values_are_one_line_errors_naming_the_field(model, data, message):
    with pytest.raises(ConfigError) as err:
        validate_config(model, data, origin="cfg.yaml")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("cfg.yaml: ")


@pytest.mark.parametrize(("model", "data", "named"), [
    (SampleConfig, {"model_path": "m", "vllm_url": "http://127.0.0.1:8000"}, "vllm_url"),
    (EvalConfig, {"model_path": "m", "vllm_url": "http://127.0.0.1:8000"}, "vllm_url"),
    (PipelineConfig, {"eval": {"vllm_url": "http://127.0.0.1:8000"}}, "vllm_url"),
    (SampleConfig, {"model_path": "m", "vllm_max_model_len": 512}, "vllm_max_model_len"),
    (GRPOConfig, {"policy_path": "m", "vllm_max_model_len": 512}, "vllm_max_model_len"),
    (PPOConfig, {"policy_path": "m", "reward_model_path": "r", "vllm_max_model_len": 512}, "vllm_max_model_len"),
    (SampleConfig, {"model_path": "m", "vllm_gpu_memory_utilization": 0.5}, "vllm_gpu_memory_utilization"),
    (EvalConfig, {"model_path": "m", "vllm_gpu_memory_utilization": 0.5}, "vllm_gpu_memory_utilization"),
    (EvalConfig, {"model_path": "m", "vllm_max_model_len": 512}, "vllm_max_model_len"),
    (DAPOConfig, {"policy_path": "m", "vllm_gpu_memory_utilization": 0.5}, "vllm_gpu_memory_utilization"),
    (PPOConfig, {"policy_path": "m", "reward_model_path": "r", "vllm_gpu_memory_utilization": 0.5},
     "vllm_gpu_memory_utilization"),
])
def test_a_vllm_setting_without_the_vllm_backend_is_refused_when_the_config_loads(model, data, named):
    """With backend hf the setting would be ignored; an evaluation's sampling run refused vllm_url only once the
    flow built it (a traceback, after a pipeline's training stages). Every config refuses it when it loads."""
    with pytest.raises(ConfigError, match=rf"{named} is set but backend is not 'vllm'"):
        validate_config(model, data, origin="cfg.yaml")
    if model is not PipelineConfig:  # (a pipeline needs stages besides its eval section)
        validate_config(model, data | {"backend": "vllm"})


@pytest.mark.parametrize(("model", "data", "error"), [
    (SFTConfig, {"model_path": "m", "data": "pairs", "split": "test"},
     "split selects the problems of data=problems; data=pairs has none: leave it out"),
    (SFTConfig, {"model_path": "m", "data": "best_of_n", "samples_run_id": "s", "source": "gsm8k"},
     "source selects stored problems or pairs; data=best_of_n reads the sampling run samples_run_id: leave it out"),
    (RMConfig, {"model_path": "m", "loss": "plackett_luce", "margin": 2.0},
     "margin 2.0 is Bradley-Terry's; loss plackett_luce has none: leave it out"),
    (DPOConfig, {"policy_path": "m", "lora_alpha": 32, "lora_target_modules": ["nonexistent"]},
     "lora_alpha, lora_target_modules set but lora_r is 0 (no LoRA: every weight trains): set lora_r to train "
     "adapters, or leave them out"),
    (GRPOConfig, {"policy_path": "m", "max_refill_rounds": 8},
     "max_refill_rounds 8 refills what dynamic sampling filters, and dynamic_sampling is false: set it true, or "
     "leave max_refill_rounds out"),
    (PPOConfig, {"policy_path": "m", "reward_model_path": "r", "kl_target": 3.0, "kl_horizon": 500},
     "kl_target, kl_horizon set but adaptive_kl is false (β_kl stays kl_coef): set adaptive_kl true, or leave them "
     "out"),
    (PPOConfig, {"policy_path": "m", "reward_model_path": "r", "vf_coef": 0, "critic_lr": 1e-4, "value_clip_eps": 1},
     "critic_lr, value_clip_eps set but vf_coef is 0 (the critic gets no gradient): set vf_coef > 0, or leave them "
     "out"),
])
def test_a_field_the_stage_would_ignore_is_refused(model, data, error):
    """Each trained the same weights as without it (the audit: bit-identical), under another cache key: a retraining
    for nothing, and a setting the user believes in. Their defaults, as a Prefect UI sends every field, still load."""
    with pytest.raises(ConfigError) as err:
        validate_config(model, data, origin="cfg.yaml")
    assert str(err.value) == f"cfg.yaml: {error}"
    defaults = {name: model.model_fields[name].default for name in data
                if name not in ("model_path", "policy_path", "reward_model_path", "data", "loss", "samples_run_id")}
    validate_config(model, data | defaults)


@pytest.mark.parametrize(("model", "data", "error"), [
    (PPOConfig, {"adaptive_kl": True, "kl_horizon": 12},
     "kl_horizon 12 <= prompts_per_step 64 / 5: the controller's factor 1 + clip(KL / kl_target - 1, ±0.2) · "
     "prompts_per_step / kl_horizon reaches 0 or below (a negative β_kl); expected kl_horizon > 12.8"),
    (PPOConfig, {"adaptive_kl": True, "kl_coef": 0},
     "adaptive_kl multiplies kl_coef by a factor each step, and kl_coef is 0: it would stay 0; expected kl_coef > 0 "
     "(its start value)"),
    (DPOConfig, {"label_smoothing": 0.5}, "field 'label_smoothing': Input should be less than 0.5 (got 0.5)"),
    (SFTConfig, {"lr": 1e-3, "weight_decay": 1000},
     "weight_decay 1000.0 x lr 0.001 >= 1: AdamW multiplies the weights by 1 - lr·weight_decay each update, which "
     "zeroes them; expected weight_decay < 1000"),
    (DAPOConfig, {"lr": 0.1, "weight_decay": 10},
     "weight_decay 10.0 x lr 0.1 >= 1: AdamW multiplies the weights by 1 - lr·weight_decay each update, which "
     "zeroes them; expected weight_decay < 10"),
    (PPOConfig, {"critic_lr": 0.5, "weight_decay": 2},
     "weight_decay 2.0 x critic_lr 0.5 >= 1: AdamW multiplies the weights by 1 - critic_lr·weight_decay each update, "
     "which zeroes them; expected weight_decay < 2"),
])
def test_settings_that_break_the_update_are_refused(model, data, error):
    """A KL controller whose factor turns β_kl negative (a helper saw 0.02 -> -0.012) or keeps it 0, DPO's loss at
    ε = 0.5 (no preference left: eval accuracy fell 0.94 -> 0.68), AdamW's decay past 1 (weights ~0)."""
    paths = {"model_path": "m"} if model is SFTConfig else {"policy_path": "m", "reward_model_path": "r"} \
        if model is PPOConfig else {"policy_path": "m"}
    with pytest.raises(ConfigError) as err:
        validate_config(model, paths | data, origin="cfg.yaml")
    assert str(err.value) == f"cfg.yaml: {error}"


@pytest.mark.parametrize("data", [{"samples_run_id": "sample-1"}, {"min_reward": 1.0},
                                  {"data": "pairs", "samples_run_id": "sample-1"}])
def test_best_of_n_settings_without_data_best_of_n_are_refused(data):
    """They would be ignored, and still change the stage's cache key (a retraining for nothing)."""
    with pytest.raises(ConfigError, match=r"samples_run_id and min_reward select a Best-of-N sampling run: they go "
                                          r"with data=best_of_n, not data=(problems|pairs)$"):
        validate_config(SFTConfig, {"model_path": "m", **data})


@pytest.mark.parametrize(("model", "data", "message"), [
    (DPOConfig, {"policy_path": "m", "disable_dropout": 1}, "disable_dropout: expected true or false, got 1"),
    (DPOConfig, {"policy_path": "m", "disable_dropout": "yes"}, "disable_dropout: expected true or false, got 'yes'"),
    (DPOConfig, {"policy_path": "m", "disable_dropout": "off"}, "disable_dropout: expected true or false, got 'off'"),
    (SFTConfig, {"model_path": "m", "trust_remote_code": "yes"},
     "trust_remote_code: expected true or false, got 'yes'"),
    (SFTConfig, {"model_path": "m", "deterministic": "yes"}, "deterministic: expected true or false, got 'yes'"),
    (GRPOConfig, {"policy_path": "m", "deterministic": 1}, "deterministic: expected true or false, got 1"),
    (PPOConfig, {"policy_path": "m", "deterministic": "off"}, "deterministic: expected true or false, got 'off'"),
    (EvalConfig, {"model_path": "m", "n": 4, "ks": [1.0, 2]}, "ks: expected an integer, got [1.0, 2]"),
    (SFTConfig, {"model_path": "m", "max_steps": 10.0}, "max_steps: expected an integer, got 10.0"),
    (PipelineConfig, {"eval": {"n": 4, "ks": [1, 2.5]}},
     "eval: ks: expected an integer, got [1, 2.5]"),
])
def test_booleans_take_only_true_or_false_and_integers_only_integers(model, data, message):
    """pydantic's lax mode read 1, 'yes' and 'off' as booleans and 1.0 as the integer 1."""
    with pytest.raises(ConfigError) as err:
        validate_config(model, data, origin="cfg.yaml")
    assert str(err.value) == f"cfg.yaml: {message}"


@pytest.mark.parametrize(("model", "required"), [
    (SFTConfig, {"model_path": "m"}), (RMConfig, {"model_path": "m"}), (DPOConfig, {"policy_path": "m"}),
    (GRPOConfig, {"policy_path": "m"}), (DAPOConfig, {"policy_path": "m"}),
    (PPOConfig, {"policy_path": "m", "reward_model_path": "r"}),
])
def test_every_training_stage_takes_deterministic_off_by_default(model, required):
    assert validate_config(model, required).deterministic is False
    assert validate_config(model, required | {"deterministic": True}).deterministic is True


@pytest.mark.parametrize("value", [0, -2, 2.5, "many", "", None, 2**63])
@pytest.mark.parametrize(("model", "required"), [
    (SFTConfig, {"model_path": "m"}), (RMConfig, {"model_path": "m"}), (DPOConfig, {"policy_path": "m"}),
])
def test_a_training_stage_takes_auto_or_a_positive_count_of_processes(model, required, value):
    assert validate_config(model, required).processes == "auto"
    assert validate_config(model, required | {"processes": 2}).processes == 2
    assert validate_config(model, required | {"processes": "4"}).processes == 4  # a UI parameter's text
    with pytest.raises(ConfigError) as err:
        validate_config(model, required | {"processes": value}, origin="cfg.yaml")
    assert str(err.value) == f"cfg.yaml: processes: expected 'auto' or an integer >= 1, got {value!r}"


def test_processes_is_no_part_of_a_stages_keys():
    """Where a stage trains changes its results by float rounding only (`KEEPING_FIELDS`, as save_every)."""
    cfg = DPOConfig(policy_path="m")
    assert config_key(cfg.model_copy(update={"processes": 8})) == config_key(cfg)
    assert config_key(cfg.model_copy(update={"beta": 0.2})) != config_key(cfg)


def test_lora_targets_in_another_order_or_repeated_are_one_stage_key():
    """(q, v), (v, q) and (q, v, v) trained to the same weights under three keys: a reordered list trained again. The
    default written out in another order is still the default (no LoRA field set beside lora_r 0)."""
    keys = {config_key(validate_config(DPOConfig, {"policy_path": "m", "lora_r": 4, "lora_target_modules": names}))
            for names in (["q_proj", "v_proj"], ["v_proj", "q_proj"], ["q_proj", "v_proj", "v_proj"])}
    assert len(keys) == 1
    default = validate_config(DPOConfig, {"policy_path": "m", "lora_target_modules": ["q_proj", "k_proj", "v_proj",
                                                                                      "o_proj"]})
    assert config_key(default) == config_key(DPOConfig(policy_path="m"))


def test_a_started_servers_setting_beside_a_running_servers_url_is_refused():
    """With vllm_url no server is started: its memory share or context length were accepted and ignored."""
    for model, data in ((SampleConfig, {"model_path": "m", "vllm_max_model_len": 512}),
                        (EvalConfig, {"model_path": "m", "vllm_gpu_memory_utilization": 0.5})):
        field = next(iter(set(data) - {"model_path"}))
        with pytest.raises(ConfigError) as err:
            validate_config(model, data | {"backend": "vllm", "vllm_url": "http://127.0.0.1:8000"}, origin="cfg.yaml")
        assert str(err.value) == (f"cfg.yaml: {field} sets up the vLLM server alignflow starts; with vllm_url none "
                                  "is started (your server's own settings apply): leave it out")


@pytest.mark.parametrize("share", [0, -0.1, 1.5, "half"])
def test_a_vllm_memory_share_outside_0_to_1_is_one_line(share):
    with pytest.raises(ConfigError) as err:
        validate_config(GRPOConfig, {"policy_path": "m", "backend": "vllm", "vllm_gpu_memory_utilization": share},
                        origin="cfg.yaml")
    assert str(err.value).startswith("cfg.yaml: field 'vllm_gpu_memory_utilization': ") and "\n" not in str(err.value)


def test_the_vllm_memory_share_is_no_part_of_a_stages_keys_and_reaches_an_evaluations_sampling():
    """It changes where the rollouts' KV cache fits, not the rollouts: a new share resumes the same stage."""
    cfg = GRPOConfig(policy_path="m", backend="vllm")
    assert config_key(cfg.model_copy(update={"vllm_gpu_memory_utilization": 0.5})) == config_key(cfg)
    evaluation = EvalConfig(model_path="m", backend="vllm", vllm_gpu_memory_utilization=0.4, vllm_max_model_len=4096)
    assert evaluation.sample_config.vllm_gpu_memory_utilization == 0.4
    assert evaluation.sample_config.vllm_max_model_len == 4096  # an eval section had no way to fit a long model


def test_model_paths_are_no_part_of_a_stages_config_key():
    """Their content is in every key beside it (`model_paths`): the same model at another path is the same input."""
    cfg = PPOConfig(policy_path="/ws/models/sft/abc/final", reward_model_path="/ws/models/rm/def/final")
    moved = cfg.model_copy(update={"policy_path": "models/sft/abc/final/", "reward_model_path": "rm"})
    assert config_key(moved) == config_key(cfg)
    assert config_key(cfg.model_copy(update={"lr": 2e-5})) != config_key(cfg)


@pytest.mark.parametrize(("model", "data", "message"), [
    (TinyModelConfig, {"seed": 1180591620717411303424},
     "field 'seed': Input should be less than or equal to 4294967295"),
    (SFTConfig, {"model_path": "m", "seed": -1}, "field 'seed': Input should be greater than or equal to 0"),
    (SFTConfig, {"model_path": "m", "max_steps": 10**23},
     "max_steps: 100000000000000000000000 is out of range; expected an integer of magnitude below 2**63"),
    (SFTConfig, {"model_path": "m", "max_steps": str(2**63)},
     "max_steps: 9223372036854775808 is out of range; expected an integer of magnitude below 2**63"),
    (EvalConfig, {"model_path": "m", "n": 4, "ks": [1, 1, 2]}, "ks [1, 1, 2]: each K may appear once"),
])
def test_seeds_and_integers_out_of_range_and_repeated_ks_are_one_line_errors(model, data, message):
    """A seed past 64 bits crashed the stage ("Overflow when unpacking long long"); repeated ks wrote repeated rows."""
    with pytest.raises(ConfigError) as err:
        validate_config(model, data, origin="cfg.yaml")
    assert str(err.value).startswith(f"cfg.yaml: {message}") and "\n" not in str(err.value)


@pytest.mark.parametrize(("model", "data", "message"), [
    (GRPOConfig, {"policy_path": "m", "prompts_per_step": 4, "group_size": 4, "mini_batch_size": 3},
     "mini_batch_size 3 does not split the 16 completions of a step (prompts_per_step 4 * group_size 4) into equal "
     "updates: expected a divisor of 16"),
    (DAPOConfig, {"policy_path": "m", "mini_batch_size": 1000},
     "mini_batch_size 1000 does not split the 8192 completions of a step (prompts_per_step 512 * group_size 16) "
     "into equal updates: expected a divisor of 8192"),
    (PPOConfig, {"policy_path": "m", "reward_model_path": "r", "prompts_per_step": 24},  # the default 16
     "mini_batch_size 16 does not split the 24 completions of a step (prompts_per_step 24, one completion each) "
     "into equal updates: expected a divisor of 24"),
    (PipelineConfig, {"base": {}, "sft": {"model_path": "from:base"}, "grpo": {"policy_path": "from:sft",
                      "prompts_per_step": 6, "group_size": 8, "mini_batch_size": 32}},
     "grpo: mini_batch_size 32 does not split the 48 completions of a step (prompts_per_step 6 * group_size 8) into "
     "equal updates: expected a divisor of 48"),
])
def test_a_mini_batch_that_would_leave_a_short_last_update_is_a_one_line_error(model, data, message):
    """16 completions in mini-batches of 3 would update on 3, 3, 3, 3, 3 and then 1: a full optimizer step on a
    far noisier gradient."""
    with pytest.raises(ConfigError) as err:
        validate_config(model, data, origin="cfg.yaml")
    assert str(err.value) == f"cfg.yaml: {message}"


@pytest.mark.parametrize("mini_batch_size", [None, 1, 8, 16, 17, 1000])
def test_a_mini_batch_that_divides_the_step_or_covers_it_is_accepted(mini_batch_size):
    """A mini-batch at least as large as the step updates once on the whole step (the loops clamp it)."""
    grpo = {"policy_path": "m", "prompts_per_step": 4, "group_size": 4, "mini_batch_size": mini_batch_size}
    assert validate_config(GRPOConfig, grpo).mini_batch_size == mini_batch_size
    assert validate_config(DAPOConfig, grpo)
    assert validate_config(PPOConfig, {"policy_path": "m", "reward_model_path": "r", "prompts_per_step": 16,
                                       "mini_batch_size": mini_batch_size})


def test_the_largest_seed_seeds_torch_through_the_stages_derived_seeds():
    from pipeline_lib.train.common import epoch_order, seed_everything
    from pipeline_lib.train.data import holdout_split

    seed = validate_config(SFTConfig, {"model_path": "m", "seed": 2**32 - 1}).seed
    seed_everything(seed)
    assert sorted(epoch_order(8, seed=seed, epoch=1000)) == list(range(8))
    train, held = holdout_split(["a", "b", "c"], 0.5, seed=seed)
    assert sorted(train + held) == [0, 1, 2] and held


def test_numbers_written_as_strings_are_still_read():
    cfg = validate_config(SFTConfig, {"model_path": "m", "lr": "1e-4", "max_steps": "10", "device": "cuda:1"})
    assert (cfg.lr, cfg.max_steps, cfg.device) == (1e-4, 10, "cuda:1")


@pytest.mark.parametrize(("rewards", "message"), [
    ([{"name": "verifer"}], "rewards[0].name: unknown reward 'verifer'; expected one of"),
    ([{"name": "verifier", "foo": 1}], "rewards[0].foo: unknown option of reward 'verifier' (expected one of "
                                       "['weight', 'incorrect'])"),
    # a misspelled required option is named, not reported as the missing one
    ([{"name": "overlong", "max_len": 6, "cach_len": 2}], "rewards[0].cach_len: unknown option of reward 'overlong' "
                                                          "(did you mean 'cache_len'?)"),
    ([{"name": "verifier", "weigth": 2}], "rewards[0].weigth: unknown option of reward 'verifier' (did you mean "
                                          "'weight'?)"),
    ([{"name": "verifier"}, {"name": "verifier"}], "each reward may appear once"),
    ([{"name": "overlong", "cache_len": 2}], "missing a required argument: 'max_len'"),
    ([{"name": "verifier", "weight": "abc"}], "rewards[0].weight: expected a finite number, got 'abc'"),
    ([{"name": "overlong", "max_len": 6.7, "cache_len": 2}], "rewards[0].max_len: expected an integer, got 6.7"),
    ([{"name": "overlong", "max_len": 4, "cache_len": 6}], "cache_len: expected 0 < cache_len <= max_len=4"),
    # past 64 bits (torch's integers) or past a float's range: refused here, not an OverflowError when the stage runs
    ([{"name": "overlong", "max_len": 10**23, "cache_len": 1}],
     f"rewards[0].max_len: {10**23} is out of range; expected an integer of magnitude below 2**63"),
    ([{"name": "verifier", "weight": 10**400}], "rewards[0].weight: expected a finite number, got 1000"),
    ([], "expected at least one"),
    # YAML's `true`, `.inf` and `.nan` reach the registry's checks as they are (pydantic would read `true` as 1)
    ([{"name": "verifier", "weight": True}], "rewards[0].weight: expected a finite number, got True"),
    ([{"name": "verifier", "weight": float("inf")}], "rewards[0].weight: expected a finite number, got inf"),
    ([{"name": "verifier", "weight": float("nan")}], "rewards[0].weight: expected a finite number, got nan"),
    ([{"name": "overlong", "max_len": 8, "cache_len": True}], "rewards[0].cache_len: expected an integer, got True"),
    ([{"name": "verifier", "incorrect": 1}], "verifier incorrect=1: expected a score below a correct answer's 1"),
    ([{"name": "verifier", "incorrect": "low"}], "rewards[0].incorrect: expected a finite number, got 'low'"),
    # all weights 0: every reward 0, GRPO/PPO would update on zero advantages, silently
    ([{"name": "verifier", "weight": 0}], "rewards: every weight is 0"),
    ([{"name": "verifier", "weight": "0.0"}, {"name": "overlong", "max_len": 8, "cache_len": 2, "weight": -0.0}],
     "rewards: every weight is 0"),
])
@pytest.mark.parametrize("model", [SampleConfig, GRPOConfig, PPOConfig])
def test_reward_specs_are_checked_when_the_config_loads(model, rewards, message):
    """Every stage with rewards refuses a bad spec at load time, not after its models have loaded."""
    path_field = "model_path" if model is SampleConfig else "policy_path"
    data = {path_field: "m", "rewards": rewards, "max_new_tokens": 8, "reward_model_path": "r"}
    with pytest.raises(ConfigError) as err:
        validate_config(model, data, origin="cfg.yaml")
    assert message in str(err.value)


def test_a_reward_weight_written_in_exponent_form_is_a_number():
    """A weight given as text (`'1e-1'` quoted, or from a form) still counts as 0.1."""
    from pipeline_lib.rewards.registry import build_reward

    cfg = validate_config(GRPOConfig, {"policy_path": "m", "rewards": [{"name": "verifier", "weight": "1e-1"}]})
    total, _ = build_reward(cfg.rewards)(["1+1="], ["2"], answers=["2"], lengths=[1])
    assert total == [pytest.approx(0.1)]


@pytest.mark.parametrize("text", ["eval:\n", ""])
def test_eval_models_without_an_eval_section_is_an_error_not_evaluation_turned_off(tmp_path, text):
    path = tmp_path / "p.yaml"
    path.write_text("base: {corpus_sources: [demo]}\nsft: {model_path: 'from:base'}\neval_models: [sft]\n" + text)
    with pytest.raises(ConfigError, match=r"^.*p\.yaml: eval_models: set, but the preset has no eval section \(an "
                                          r"empty `eval:` is none\): give it the sampling settings"):
        load_config(PipelineConfig, path)
    # a preset without evaluation still round-trips through its dump (a deployment's parameters list every field)
    path.write_text("base: {corpus_sources: [demo]}\nsft: {model_path: 'from:base'}\n")
    cfg = load_config(PipelineConfig, path)
    assert validate_config(PipelineConfig, cfg.model_dump(mode="json")) == cfg


def test_cross_field_errors_are_one_short_line():
    data = {"base": {}, "sft": {"model_path": "from:base"}, "eval": {}, "eval_models": ["sft", "dpoo"]}
    with pytest.raises(ConfigError) as err:
        validate_config(PipelineConfig, data, origin="p.yaml")
    assert str(err.value) == ("p.yaml: eval_models: ['dpoo'] are not policy stages; expected names from "
                              "('base', 'sft', 'rs_sft', 'dpo', 'grpo', 'dapo', 'ppo')")


@pytest.mark.parametrize(("stage", "field", "target"), [
    ("ppo", "reward_model_path", "sft"), ("rs_sft", "samples_run_id", "sft"), ("dpo", "policy_path", "rm")])
def test_a_reference_must_name_a_stage_whose_output_fits_the_field(stage, field, target):
    data = {"base": {}, "sft": {"model_path": "from:base"}, "rm": {"model_path": "from:sft"},
            "sample": {"model_path": "from:sft"}}
    stage_cfg = {"ppo": {"policy_path": "from:sft", "reward_model_path": "from:rm"}, "dpo": {"policy_path": "from:sft"},
                 "rs_sft": {"model_path": "from:sft", "data": "best_of_n", "samples_run_id": "from:sample"}}[stage]
    data[stage] = stage_cfg | {field: f"from:{target}"}
    with pytest.raises(ConfigError, match=f"{stage}.{field}: 'from:{target}' is not a stage whose output fits"):
        validate_config(PipelineConfig, data)


def test_a_pipeline_without_an_eval_section_evaluates_nothing():
    cfg = validate_config(PipelineConfig, {"base": {}, "sft": {"model_path": "from:base"}})
    assert cfg.evaluated == ()


@pytest.mark.parametrize(("text", "message"), [
    ("rewards: [{name: verifier, weight: true}]", "rewards[0].weight: expected a finite number, got True"),
    ("rewards: [{name: verifier, weight: .inf}]", "rewards[0].weight: expected a finite number, got inf"),
    ("max_new_tokens: 100\nrewards: [{name: verifier}, {name: overlong, max_len: 100, cache_len: true}]",
     "rewards[1].cache_len: expected an integer, got True"),
])
def test_a_reward_spec_from_yaml_gets_the_registrys_one_line_error(tmp_path, text, message):
    path = tmp_path / "grpo.yaml"
    path.write_text(f"policy_path: /m\n{text}\n")
    with pytest.raises(ConfigError) as err:
        load_config(GRPOConfig, path)
    assert str(err.value) == f"{path}: {message}"


@pytest.mark.parametrize(("model", "text", "where"), [
    (SFTConfig, "model_path: /m\nmax_steps: 10\nmax_steps: 20\n", "line 3, column 1: repeated key 'max_steps' (first at line 2)"),
    (PipelineConfig, "base: {}\ndpo: {policy_path: from:base, beta: 0.5}\nsft: {model_path: from:base}\n"
                     "dpo: {policy_path: from:sft}\n", "line 4, column 1: repeated key 'dpo' (first at line 2)"),
    (PipelineConfig, "base: {}\nsft:\n  model_path: from:base\n  lr: 0.1\n  lr: 0.2\n",
     "line 5, column 3: repeated key 'lr' (first at line 4)"),
])
def test_a_repeated_key_is_invalid_yaml_not_last_one_wins(tmp_path, model, text, where):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(model, path)
    assert str(err.value) == f"{path}: invalid YAML at {where}"


def test_merge_keys_still_let_a_mapping_override_what_it_merged(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("base: {}\nshort: &short {max_steps: 5, lr: 0.01}\n"
                    "sft:\n  <<: *short\n  model_path: from:base\n  max_steps: 7\n"
                    "rm:\n  <<: *short\n  model_path: from:sft\n")
    data = load_yaml(path)
    assert data["sft"] == {"max_steps": 7, "lr": 0.01, "model_path": "from:base"}
    assert data["rm"] == {"max_steps": 5, "lr": 0.01, "model_path": "from:sft"}
    nested = tmp_path / "nested.yaml"  # an anchor that itself overrides a merged key, merged before it is built
    nested.write_text("defaults:\n  train: &train\n    <<: {lr: 1.0, epochs: 1}\n    lr: 2.0\nsft:\n  <<: *train\n")
    assert load_yaml(nested) == {"defaults": {"train": {"lr": 2.0, "epochs": 1}}, "sft": {"lr": 2.0, "epochs": 1}}


def test_a_yaml_alias_bomb_is_one_line_at_once(tmp_path):
    """A 'billion laughs' preset (aliases of aliases, under 500 bytes) took 33 s and 1.6 GB to become one line with
    8 levels and ran past 5 minutes with 9: pydantic walked and printed the expanded value. Aliases that expand to
    a real preset's size, and a recursive one, still load."""
    levels = [f"&l0 [{', '.join(['x'] * 10)}]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("model_path: /m\nmax_steps: [\n  " + ",\n  ".join(levels) + "]\n")
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, path)
    assert str(err.value) == f"{path}: invalid YAML at line 7, column 3: its aliases expand to over 100,000 values " \
                             "(an alias bomb?)"
    assert time.monotonic() - started < 5  # the refusal comes before anything walks the expanded value
    fine = tmp_path / "fine.yaml"  # 10^4 values through aliases: a list no preset field takes, refused as such
    fine.write_text("model_path: /m\nmax_steps: [\n  " + ",\n  ".join(levels[:4]) + "]\n")
    with pytest.raises(ConfigError, match=r"field 'max_steps': Input should be a valid integer \(got \[\["):
        load_config(SFTConfig, fine)
    recursive = tmp_path / "recursive.yaml"
    recursive.write_text("model_path: &x [*x]\n")
    with pytest.raises(ConfigError, match=r"field 'model_path': Input should be a valid string \(got \[\[\.\.\.\]\]\)"):
        load_config(SFTConfig, recursive)


@pytest.mark.parametrize(("n", "ks"), [(16, (1, 2, 4, 8, 16)), (12, (1, 2, 4, 8, 12)), (4, (1, 2, 4)), (1, (1,))])
def test_eval_ks_default_to_the_powers_of_two_up_to_n_and_n(n, ks):
    """`alignflow eval --n 4` without --ks, and a preset's eval section with `n: 4` and no ks, evaluate K = 1, 2, 4
    (a fixed 1..16 default was refused for naming K > n, values the user never wrote)."""
    assert validate_config(EvalConfig, {"model_path": "m", "n": n}).k_values == ks
    assert validate_config(PipelineEvalConfig, {"n": n}).k_values == ks  # a preset's eval section
    assert validate_config(EvalConfig, {"model_path": "m", "n": 16, "ks": [2, 8]}).k_values == (2, 8)


def test_an_ingest_split_is_stripped_and_a_blank_one_is_refused():
    assert validate_config(IngestConfig, {"path": "p.jsonl", "split": " test\t"}).split == "test"
    with pytest.raises(ConfigError, match=r"^config: field 'split': String should have at least 1 character "
                                          r"\(got ' '\)$"):
        validate_config(IngestConfig, {"path": "p.jsonl", "split": " "})


def test_a_missing_ingest_file_is_reported_when_the_preset_loads(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("base: {}\ningest:\n  - {path: data/demo/problems.jsonl}\n  - {path: data/demo/nope.jsonl}\n")
    with pytest.raises(ConfigError) as err:
        load_config(PipelineConfig, path)
    assert str(err.value) == (f"{path}: field 'ingest.1.path': no such file 'data/demo/nope.jsonl' (looked in the "
                              f"working directory and in the alignflow checkout {PRESETS.parents[1]})")
    single = tmp_path / "ingest.yaml"
    single.write_text(f"path: {tmp_path / 'nope.jsonl'}\n")
    with pytest.raises(ConfigError) as err:
        load_config(IngestConfig, single)
    assert str(err.value) == f"{single}: field 'path': no such file '{tmp_path / 'nope.jsonl'}'"
    single.write_text(f"path: {tmp_path}\n")
    with pytest.raises(ConfigError, match=f"field 'path': {tmp_path}: is a directory, expected a data file"):
        load_config(IngestConfig, single)
    os.mkfifo(tmp_path / "pipe.jsonl")  # a FIFO would block the ingest until someone writes to it
    single.write_text(f"path: {tmp_path / 'pipe.jsonl'}\n")
    with pytest.raises(ConfigError, match=r"field 'path': .*pipe\.jsonl: is a named pipe \(FIFO\), expected a data file"):
        load_config(IngestConfig, single)


def test_an_ingest_file_of_an_unsupported_type_is_reported_when_the_preset_loads(tmp_path):
    """ingest refuses the file too, but only when the pipeline reaches it: after the files before it were ingested."""
    (tmp_path / "notes.txt").write_text("hello\n")
    path = tmp_path / "p.yaml"
    path.write_text(f"base: {{}}\ningest:\n  - {{path: data/demo/problems.jsonl}}\n  - {{path: {tmp_path}/notes.txt}}"
                    "\n")
    with pytest.raises(ConfigError) as err:
        load_config(PipelineConfig, path)
    assert str(err.value) == (f"{path}: field 'ingest.1.path': {tmp_path / 'notes.txt'}: unknown file type; expected "
                              f"one of .jsonl.gz, .json.gz, .csv.gz, .jsonl, .json, .parquet, .csv")


def test_a_file_ingested_with_replace_shares_its_source_with_no_other_file_of_the_preset(tmp_path):
    """Its replace would delete what the other file stored under the source in the same run."""
    path = tmp_path / "p.yaml"
    path.write_text("base: {}\ningest:\n  - {path: data/demo/pairs.jsonl}\n"
                    "  - {path: data/demo/problems.jsonl, source: pairs, replace: true}\n")
    with pytest.raises(ConfigError) as err:
        load_config(PipelineConfig, path)
    assert str(err.value) == (f"{path}: field 'ingest.1.replace': true deletes what ingest.0 and ingest.1 store under "
                              "the one source 'pairs'; give each file its own `source`")
    path.write_text("base: {}\ningest:\n  - {path: data/demo/pairs.jsonl, replace: true}\n"
                    "  - {path: data/demo/problems.jsonl, replace: true}\n")
    assert [ingest.replace for ingest in load_config(PipelineConfig, path).ingest] == [True, True]


def test_ingest_files_resolve_against_the_checkout_and_are_not_checked_when_built_in_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # data/demo/... is not here, but in the checkout
    path = tmp_path / "ingest.yaml"
    path.write_text("path: data/demo/pairs.jsonl\n")
    cfg = load_config(IngestConfig, path)
    assert cfg.resolved_path.is_file()
    # a config built in code (a test, a flow parameter) may name a file written later
    assert validate_config(IngestConfig, {"path": "later.jsonl"}).path == "later.jsonl"


def test_stored_selections_name_what_each_stage_reads_but_not_what_the_pipeline_makes():
    demo = validate_config(PipelineConfig, load_yaml(PRESETS / "demo.yaml"))
    train, test = {"source": "demo", "split": "train"}, {"source": "demo", "split": "test"}
    # rs_sft and dpo read this pipeline's sampling run; eval reads the test split
    assert demo.stored_selections() == [
        ("sft", "problems", train), ("rm", "preference_pairs", {"source": "demo"}), ("sample", "problems", train),
        ("grpo", "problems", train), ("dapo", "problems", train), ("ppo", "problems", train),
        ("eval", "problems", test)]

    def selections(**stages):
        return validate_config(PipelineConfig, {"base": {}, **stages}).stored_selections()

    pairs_sft = {"model_path": "from:base", "data": "pairs", "source": "hh"}
    rankings_rm = {"model_path": "from:base", "loss": "plackett_luce", "source": "ranked"}
    pairs_ppo = {"policy_path": "from:base", "reward_model_path": "from:rm", "prompts_table": "preference_pairs",
                 "rewards": [{"name": "reward_model"}]}
    assert selections(sft=pairs_sft, rm=rankings_rm, dpo={"policy_path": "from:sft"}, ppo=pairs_ppo) == [
        ("sft", "preference_pairs", {"source": "hh"}), ("rm", "rankings", {"source": "ranked"}),
        ("dpo", "preference_pairs", {"source": None}), ("ppo", "preference_pairs", {"source": None})]
    # with a sample stage, pairs of every source or of the West-of-N source may be the ones it adds, for the stages
    # after it; sft and rm train before it, so the store must hold theirs already (an rm reading West-of-N pairs
    # failed only once sft had trained, or trained on an earlier run's pairs)
    sample = {"model_path": "from:base", "problems_source": "math"}
    assert selections(sample=sample, dpo={"policy_path": "from:base"}) == [
        ("sample", "problems", {"source": "math", "split": "test"})]
    assert selections(rm={"model_path": "from:base"}, sample=sample,
                      dpo={"policy_path": "from:base", "source": "west_of_n"},
                      ppo=pairs_ppo | {"problems_source": "hh"}) == [
        ("rm", "preference_pairs", {"source": None}), ("sample", "problems", {"source": "math", "split": "test"}),
        ("ppo", "preference_pairs", {"source": "hh"})]
    assert selections(sft=pairs_sft | {"source": "west_of_n"}, rm={"model_path": "from:base", "source": "west_of_n"},
                      sample=sample) == [
        ("sft", "preference_pairs", {"source": "west_of_n"}), ("rm", "preference_pairs", {"source": "west_of_n"}),
        ("sample", "problems", {"source": "math", "split": "test"})]
    # the eval section reads its problems when a stage it evaluates runs
    assert selections(sft={"model_path": "from:base"}, eval={"problems_source": "demo"}, eval_models=["sft"]) == [
        ("sft", "problems", {"source": None, "split": "train"}),
        ("eval", "problems", {"source": "demo", "split": "test"})]


@pytest.mark.parametrize(("eval_section", "eval_models", "error"), [
    # the model and its name come from each stage of eval_models: a model given here was silently not evaluated
    ({"model_path": "/models/ppo/final"}, ["sft"],
     "eval: model_path: a pipeline evaluates the output of each stage in eval_models, named after the stage; leave "
     "model_path out (`alignflow eval --model DIR` evaluates a given model)"),
    ({"model_name": "mine"}, ["sft"], "eval: model_name: a pipeline evaluates the output of each stage in eval_models"),
    # an eval section that evaluates nothing ran silently
    ({}, ["dpo", "grpo"], "eval_models: none of ['dpo', 'grpo'] is run by this preset; its models are ['base', 'sft']: "
                          "name some of them, or leave the eval section out"),
])
def test_a_pipeline_eval_section_that_would_not_evaluate_what_it_names_is_refused(eval_section, eval_models, error):
    data = {"base": {}, "sft": {"model_path": "from:base"}, "eval": eval_section, "eval_models": eval_models}
    with pytest.raises(ConfigError) as err:
        validate_config(PipelineConfig, data, origin="p.yaml")
    assert str(err.value).startswith(f"p.yaml: {error}")


def test_a_pipeline_evaluates_each_stage_with_its_eval_settings():
    cfg = validate_config(PipelineConfig, {"base": {}, "sft": {"model_path": "from:base"},
                                           "eval": {"n": 4, "ks": [1, 4], "problems_source": "demo"}})
    assert cfg.evaluated == ("sft",)
    sft_eval = cfg.eval_config("sft", "/ws/models/sft/abc/final")
    assert type(sft_eval) is EvalConfig
    assert (sft_eval.model_path, sft_eval.label, sft_eval.n, sft_eval.ks, sft_eval.problems_source) == (
        "/ws/models/sft/abc/final", "sft", 4, (1, 4), "demo")


def test_an_evaluation_samples_with_its_own_trust_remote_code():
    """Off unless set; an eval config that sets it (`alignflow eval --trust-remote-code`, a pipeline's eval section)
    hands it to the sampling run it reads."""
    assert EvalConfig(model_path="m").sample_config.trust_remote_code is False
    assert EvalConfig(model_path="m", trust_remote_code=True).sample_config.trust_remote_code is True
    cfg = validate_config(PipelineConfig, {"base": {}, "sft": {"model_path": "from:base"},
                                           "eval": {"trust_remote_code": True}})
    assert cfg.eval_config("sft", "/ws/models/sft/abc/final").sample_config.trust_remote_code is True
