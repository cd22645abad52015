"""Other decoder families than the tiny Llama, as tiny random models: the sampler draws what transformers' own
`generate` draws (num_return_sequences, same seed), and the shared-prompt log-probs GRPO trains on equal those of the
full rows, for grouped-query attention, tied embeddings, q/k norms, sliding windows, soft-capped logits, learned
absolute positions."""

from __future__ import annotations

import pytest
import torch
import transformers

from pipeline_lib.models import build_tiny_model, load_policy, load_tokenizer, save_model
from pipeline_lib.models.logprobs import sequence_logprobs
from pipeline_lib.sampling.hf import HFSampler
from pipeline_lib.train.rollout import completions_batch, grouped_completions_batch

PROMPTS = ["12+34=", "5+6=", "97+70="]  # different lengths: left padding
LAYERS = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128}
ARCHITECTURES = {
    "qwen2 (tied embeddings)": ("Qwen2", {**LAYERS, "tie_word_embeddings": True}),
    "qwen3 (q/k norm)": ("Qwen3", {**LAYERS, "head_dim": 32}),
    "mistral (sliding window 4)": ("Mistral", {**LAYERS, "sliding_window": 4}),
    "gemma2 (soft-capped logits, sliding window 4)": ("Gemma2", {**LAYERS, "head_dim": 32, "sliding_window": 4}),
    "phi3": ("Phi3", {**LAYERS, "max_position_embeddings": 64}),
    "gpt2 (learned positions)": ("GPT2", {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64}),
    "opt": ("OPT", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "ffn_dim": 128,
                    "word_embed_proj_dim": 64, "max_position_embeddings": 64}),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_tiny_model(tmp_path_factory.mktemp("tok") / "m", ["0123456789+=", "no idea!"],
                                           hidden_size=64, num_heads=2, intermediate_size=128))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_sampling_and_shared_prompt_log_probs_on_another_architecture(name, tokenizer, tmp_path):
    family, sizes = ARCHITECTURES[name]
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    config = getattr(transformers, f"{family}Config")(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                                     **ids, **sizes)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM" if family != "GPT2" else "GPT2LMHeadModel")(config)
    model.generation_config = transformers.GenerationConfig(**ids)
    policy = load_policy(save_model(model, tokenizer, tmp_path / "model"), dtype="float32", device="cpu")
    sampler = HFSampler(policy, tokenizer)

    groups = sampler.generate(PROMPTS, n=4, max_new_tokens=6, seed=11)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(11)
        plain = policy.generate(**batch, max_new_tokens=6, num_return_sequences=4, use_cache=True,
                                **sampler._generation_kwargs(1.0, 1.0))[:, batch["input_ids"].shape[1]:]
    rows = [completion for group in groups for completion in group]
    for row, completion in enumerate(rows):
        assert completion.token_ids == plain[row, :completion.n_tokens].tolist(), row

    prompts = [prompt for prompt in PROMPTS for _ in range(4)]
    full = completions_batch(tokenizer, prompts, rows)
    shared = grouped_completions_batch(tokenizer, prompts, rows)
    with torch.no_grad():
        expected = sequence_logprobs(policy, full.input_ids, full.attention_mask, full.completion_mask)
        got = shared.logprobs(policy)
    torch.testing.assert_close(got[shared.completion_mask.bool()], expected[full.completion_mask.bool()],
                               atol=1e-5, rtol=0)
