"""Tiny offline model factory: determinism, character-level digits, special tokens, chat template, HF loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from pipeline_lib.models.tiny import ROLE_TOKENS, SPECIAL_TOKENS, build_tiny_model

CORPUS = [f"{a:02d}+{b:02d}={a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)] + ["hello world"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", CORPUS)


def test_same_corpus_and_seed_give_identical_files(tiny_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", CORPUS)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    other_seed = build_tiny_model(tmp_path / "seed1", CORPUS, seed=1)
    assert (other_seed / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()
    assert (other_seed / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_build_does_not_reset_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", CORPUS)
    assert torch.equal(torch.rand(3), expected)


def test_arithmetic_prompt_is_one_token_per_character(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tokenizer("12+34=")["input_ids"]
    assert len(ids) == 6  # no bos/eos added by default
    assert [tokenizer.decode([i]) for i in ids] == list("12+34=")
    assert tokenizer.decode(ids) == "12+34="
    assert tokenizer("12+34=", add_special_tokens=True)["input_ids"] == ids
    assert tokenizer.decode(tokenizer("hello world")["input_ids"]) == "hello world"


def test_no_merges_by_default_and_merges_on_request(tiny_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    alphabet = set("".join(CORPUS))
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(alphabet)  # 7 specials + the corpus's characters
    merged = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "bpe", CORPUS, vocab_size=40))
    assert len(tokenizer) < len(merged) <= 40  # merges added, capped by vocab_size
    assert len(merged("hello world")["input_ids"]) < len("hello world")
    assert len(merged("12+34=")["input_ids"]) == 6  # digits stay single tokens even with merges


def test_special_tokens_and_left_padding_survive_reload(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2, 3)
    assert tokenizer.padding_side == "left"
    assert tokenizer.model_max_length == 256
    batch = tokenizer(["1+2=", "12+34="], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]
    for marker in ROLE_TOKENS:
        assert len(tokenizer(marker)["input_ids"]) == 1


def test_chat_template(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "user", "content": "12+34="}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>12+34=</s><|assistant|>"
    turn = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "46"}], tokenize=False)
    assert turn == "<|user|>12+34=</s><|assistant|>46</s>"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == 1 + 6 + 1 + 1 and ids[7] == tokenizer.eos_token_id


def test_model_config_and_hf_loading(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    config = model.config
    assert isinstance(config, LlamaConfig)
    assert config.tie_word_embeddings is False and config.head_dim == 32 and config.num_hidden_layers == 2
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    n_params = sum(p.numel() for p in model.parameters())
    assert 450_000 < n_params < 600_000
    assert (model.generation_config.pad_token_id, model.generation_config.eos_token_id) == (0, 2)
    assert not any(p.suffix in {".bin", ".pt"} for p in tiny_dir.iterdir())


def test_generate_runs_with_left_padding(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    batch = tokenizer(["1+2=", "12+34="], padding=True, return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 6 + 3)


def test_bad_arguments_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="head_dim=16"):
        build_tiny_model(tmp_path / "m", CORPUS, head_dim=16)
    with pytest.raises(ValueError, match="corpus"):
        build_tiny_model(tmp_path / "m", [])
    with pytest.raises(ValueError, match="vocab_size=5"):
        build_tiny_model(tmp_path / "m", CORPUS, vocab_size=5)
