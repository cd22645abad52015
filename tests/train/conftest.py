"""Fixtures shared by the training-loop tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pipeline_lib.models import RewardModel, load_tokenizer, save_model


@pytest.fixture
def one_thread():
    """Bit-exact comparisons run on one thread: with several, MKL may pick its thread count by machine load,
    which changes the summation order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def collect():
    """`logged, log = collect()`: a LogFn for the training loops that records (step, metrics) into `logged`."""

    def sink():
        logged: list[tuple[int, dict]] = []
        return logged, lambda metrics, step: logged.append((step, dict(metrics)))

    return sink


@pytest.fixture(scope="module")
def reward_model(tiny, tmp_path_factory) -> Path:
    """A reward model on the module's `tiny` backbone with a seeded random head: scores differ between
    completions, which is all the loop mechanics need (the slow learning tests train real ones)."""
    return RewardModel.from_policy(tiny, device="cpu", seed=1).save_pretrained(tmp_path_factory.mktemp("rm") / "rm",
                                                                               load_tokenizer(tiny))


@pytest.fixture(scope="module")
def short_positions(tiny, tmp_path_factory) -> dict[str, Path]:
    """GPT-2 (`n_positions`) and OPT (`max_position_embeddings`) policies with 16 learned absolute positions, on the
    module's `tiny` tokenizer: a row past them raises IndexError in the embedding lookup."""
    tokenizer = load_tokenizer(tiny)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    configs = {"gpt2": transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, **ids),
               "opt": transformers.OPTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64,
                                             word_embed_proj_dim=32, max_position_embeddings=16, **ids)}
    out = tmp_path_factory.mktemp("short_positions")
    paths = {}
    for family, config in configs.items():
        config.vocab_size, config.bos_token_id = len(tokenizer), tokenizer.bos_token_id
        torch.manual_seed(0)
        model = (transformers.GPT2LMHeadModel if family == "gpt2" else transformers.OPTForCausalLM)(config)
        model.generation_config = transformers.GenerationConfig(**ids)
        paths[family] = save_model(model, tokenizer, out / family)
    return paths


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chatml(tiny, tmp_path_factory) -> Path:
    """The module's `tiny` as an instruct model: a ChatML template ending turns with `<|im_end|>`, which its
    generation_config stops on beside eos."""
    tokenizer = load_tokenizer(tiny)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return save_model(model, tokenizer, tmp_path_factory.mktemp("chatml") / "chatml")
