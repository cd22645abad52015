"""Config loading: one-line errors naming the file and field; the pipeline's from:<stage> references."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline_lib.config import ConfigError, PipelineConfig, SFTConfig, load_config, validate_config

PRESETS = Path(__file__).resolve().parents[1] / "flows" / "configs"


def test_misspelled_field_is_one_line_error_naming_file_and_field(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("model_path: m\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, path)
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message and "learning_rate" in message


def test_wrong_type_names_field_and_value(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("model_path: m\nmax_steps: many\n")
    with pytest.raises(ConfigError, match=r"field 'max_steps'.*'many'"):
        load_config(SFTConfig, path)


@pytest.mark.parametrize("text, expected", [("", "expected a mapping"), ("a: [1\n", "invalid YAML")])
def test_bad_yaml_files(tmp_path, text, expected):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_config(SFTConfig, path)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(SFTConfig, "/no/such/file.yaml")


def test_demo_preset_validates_and_resolves_references():
    cfg = load_config(PipelineConfig, PRESETS / "demo.yaml")
    refs = {(stage, field): target for stage, field, target in cfg.stage_refs()}
    assert refs[("ppo", "reward_model_path")] == "rm"
    assert refs[("rs_sft", "samples_run_id")] == "sample"
    resolved = cfg.resolved("ppo", {"sft": "/m/sft", "rm": "/m/rm"})
    assert resolved.policy_path == "/m/sft" and resolved.reward_model_path == "/m/rm"
    assert cfg.ppo.policy_path == "from:sft"  # the preset itself is unchanged (frozen)


def test_reference_to_a_later_or_disabled_stage_is_rejected():
    base = {"base": {}, "sft": {"model_path": "from:base"}}
    with pytest.raises(ConfigError, match=r"dpo.policy_path: 'from:grpo' must name an enabled earlier stage"):
        validate_config(PipelineConfig, base | {"dpo": {"policy_path": "from:grpo"}})
    with pytest.raises(ConfigError, match="from:rm"):
        validate_config(PipelineConfig, base | {"dpo": {"policy_path": "from:rm"}})


def test_explicit_paths_are_kept():
    cfg = validate_config(PipelineConfig, {"base_model_path": "/m/base", "sft": {"model_path": "/m/other"}})
    assert cfg.stage_refs() == []
    assert cfg.resolved("sft", {"base": "/m/base"}).model_path == "/m/other"


def test_every_shipped_preset_validates():
    for preset in PRESETS.glob("*.yaml"):
        cfg = load_config(PipelineConfig, preset)
        assert cfg.evaluated, preset
