"""Chunked per-token log-probs and entropies against the naive full log-softmax, with left padding and gradients;
the shared-prompt variant and DPO's packed pairs against the full rows."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from pipeline_lib.models import build_tiny_model, completion_logprob_sums, load_policy, sequence_logprobs
from pipeline_lib.models.logprobs import (
    UnsupportedModelError,
    _chunk_logps,
    packs_pairs,
    pair_logprob_sums,
    position_ids_from_mask,
    shared_prompt_logprobs,
)
from pipeline_lib.train.data import Encoded, collate, collate_pairs

CORPUS = [f"{a:02d}+{b:02d}={a + b}" for a in range(0, 100, 9) for b in range(0, 100, 13)] + ["hello world"]
ATOL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_policy(build_tiny_model(tmp_path_factory.mktemp("tiny") / "policy", CORPUS), device="cpu")


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt + completion rows of different lengths; completion = the last 3, 5 and 2 tokens."""
    g = torch.Generator().manual_seed(0)
    lengths, completion_lengths = [9, 12, 4], [3, 5, 2]
    width = max(lengths)
    ids = torch.zeros((3, width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    completion = torch.zeros_like(ids)
    for row, (n, c) in enumerate(zip(lengths, completion_lengths)):
        ids[row, width - n:] = torch.randint(7, 19, (n,), generator=g)
        attention[row, width - n:] = 1
        completion[row, width - c:] = 1
    return ids, attention, completion


def _naive(model, ids, attention, completion, temperature=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: full (B, T, V) log_softmax of logits / temperature, gather, shift by one, mask."""
    logits = model(ids, attention_mask=attention, position_ids=position_ids_from_mask(attention)).logits.float()
    logits = logits / temperature
    logp_all = logits.log_softmax(-1)  # (B, T, V)
    taken = logp_all[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]  # (B, T-1)
    zero = torch.zeros((ids.shape[0], 1))
    mask = completion.float()
    return torch.cat([zero, taken], 1) * mask, torch.cat([zero, entropy], 1) * mask


def test_position_ids_from_mask_by_hand():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 1, 2, 3, 4]])
    assert torch.equal(position_ids_from_mask(mask), expected)


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_matches_naive_log_softmax_with_entropy(model, chunk_size):
    ids, attention, completion = _batch()
    with torch.no_grad():
        logps, entropy = sequence_logprobs(model, ids, attention, completion, return_entropy=True, chunk_size=chunk_size)
        ref_logps, ref_entropy = _naive(model, ids, attention, completion)
    assert logps.shape == ids.shape and entropy.shape == ids.shape
    torch.testing.assert_close(logps, ref_logps, atol=ATOL, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=ATOL, rtol=0)
    assert torch.all(logps[completion == 0] == 0) and torch.all(logps[completion == 1] < 0)
    assert torch.all(entropy[completion == 1] > 0)
    assert torch.all(entropy <= torch.log(torch.tensor(float(model.config.vocab_size))) + ATOL)  # H ≤ log V


@pytest.mark.parametrize("temperature", [1.0, 0.1, 0.01])
def test_the_entropy_of_large_logits_is_that_of_float64_and_never_negative(temperature):
    """Logits of a confident model (~N(0, 8), one token 40 up) over a low temperature: lse(z) - Σ p z cancelled
    large numbers in float32 (a helper: -6e-3 at T = 0.01, in GRPO's policy/entropy); -Σ p log p keeps float64's
    value of the same logits."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, 512, generator=generator) * 8
    logits[..., 7] += 40.0
    targets = torch.randint(0, 512, (4, 64), generator=generator)
    _, entropy = _chunk_logps(lambda hidden: hidden, logits, targets, True, temperature)
    exact = torch.log_softmax((logits / temperature).double(), dim=-1)  # (the division's float32 rounding kept)
    exact_entropy = -(exact.exp() * exact).sum(-1)
    assert torch.all(entropy >= 0)
    torch.testing.assert_close(entropy.double(), exact_entropy, atol=1e-6, rtol=1e-5)


def test_left_padding_gives_the_unpadded_values(model):
    ids, attention, completion = _batch()
    with torch.no_grad():
        batched = sequence_logprobs(model, ids, attention, completion)
        for row in range(ids.shape[0]):
            valid = attention[row].bool()
            alone = sequence_logprobs(model, ids[row:row + 1, valid], attention[row:row + 1, valid],
                                      completion[row:row + 1, valid])
            torch.testing.assert_close(batched[row, valid], alone[0], atol=ATOL, rtol=0)


def test_position_zero_and_prompt_are_zero(model):
    ids = torch.tensor([[8, 9, 10, 11]])
    full = torch.ones_like(ids)
    with torch.no_grad():
        logps = sequence_logprobs(model, ids, full, full)
        nothing = sequence_logprobs(model, ids, full, torch.zeros_like(ids), return_entropy=True)
    assert logps[0, 0] == 0 and torch.all(logps[0, 1:] < 0)
    assert all(torch.count_nonzero(t) == 0 for t in nothing)


def test_a_row_without_prompt_scores_its_first_token_0_however_padded(model):
    """The first valid token of a row with no prompt has nothing before it: 0 left-padded (collate's layout) as
    right-padded and alone, not a log-prob predicted from the pad column before it."""
    ids = torch.tensor([[8, 9, 10, 11, 12], [0, 0, 13, 14, 15]])
    attention = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    completion = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 1]])
    with torch.no_grad():
        left = sequence_logprobs(model, ids, attention, completion)
        right = sequence_logprobs(model, torch.tensor([[8, 9, 10, 11, 12], [13, 14, 15, 0, 0]]),
                                  torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
                                  torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]]))
        alone = sequence_logprobs(model, ids[1:, 2:], attention[1:, 2:], completion[1:, 2:])
    assert left[1, 2] == 0 and right[1, 0] == 0 and alone[0, 0] == 0
    torch.testing.assert_close(left[1, 2:], alone[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(right[1, :3], alone[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(left[0], right[0], atol=ATOL, rtol=0)


def test_gradients_match_the_naive_reference(model):
    ids, attention, completion = _batch()
    model.zero_grad()
    logps, entropy = sequence_logprobs(model, ids, attention, completion, return_entropy=True, chunk_size=2)
    assert logps.requires_grad and not entropy.requires_grad  # the entropy is logged, never trained on
    logps.sum().backward()
    chunked = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    ref_logps, _ = _naive(model, ids, attention, completion)
    ref_logps.sum().backward()
    for name, p in model.named_parameters():
        assert chunked[name].abs().sum() > 0, name  # every parameter is reached, lm_head and embeddings too
        torch.testing.assert_close(chunked[name], p.grad, atol=ATOL, rtol=1e-4, msg=name)
    model.zero_grad()


def test_lm_head_only_sees_chunks(model):
    """No full (B, T, V) logits: the output layer runs on at most chunk_size positions at a time."""
    ids, attention, completion = _batch()
    widths: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: widths.append(o.shape[1]))
    try:
        with torch.no_grad():
            sequence_logprobs(model, ids, attention, completion, chunk_size=2)
    finally:
        hook.remove()
    assert max(widths) <= 2
    # Only the completion span is scored: columns 6..10 predict the 5-token completion of row 1.
    # + the single position transformers keeps itself (logits_to_keep=1), which is checked against ours
    assert sum(widths) == 1 + 1 + 5


def test_completion_logprob_sums(model):
    ids, attention, completion = _batch()
    with torch.no_grad():
        sums = completion_logprob_sums(model, ids, attention, completion)
        ref, _ = _naive(model, ids, attention, completion)
    assert sums.shape == (3,)
    torch.testing.assert_close(sums, ref.sum(-1), atol=ATOL, rtol=0)


def test_bad_shapes_are_one_line_errors(model):
    ids, attention, completion = _batch()
    with pytest.raises(ValueError, match="completion_mask"):
        sequence_logprobs(model, ids, attention, completion[:, 1:])
    with pytest.raises(ValueError, match="input_ids"):
        sequence_logprobs(model, ids[0], attention[0], completion[0])
    with pytest.raises(ValueError, match="chunk_size=0"):
        sequence_logprobs(model, ids, attention, completion, chunk_size=0)


def _grouped() -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Two prompts of different lengths (3 and 5 tokens), five completions of 1-4 tokens: rows 0-2 continue
    prompt 1, rows 3-4 prompt 0."""
    prompts = [[9, 10, 11], [12, 13, 14, 15, 16]]
    completions = [[7, 8], [17, 18, 7, 8], [9], [10, 11, 12], [13, 14]]
    return prompts, completions, [1, 1, 1, 0, 0]


def _grouped_tensors(prompts, completions, index):
    p_width, c_width = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[0] * (p_width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (p_width - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [0] * (c_width - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (c_width - len(c)) for c in completions])
    return prompt_ids, prompt_mask, torch.tensor(index), completion_ids, completion_mask


def _full_rows(prompts, completions, index):
    """The same rows as one left-padded (B, T) batch for sequence_logprobs."""
    rows = [prompts[i] + c for i, c in zip(index, completions)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    completion = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in completions])
    return ids, attention, completion


def test_shared_prompt_logprobs_equal_full_rows_values_entropies_and_gradients(model):
    prompts, completions, index = _grouped()
    grouped = _grouped_tensors(prompts, completions, index)
    ids, attention, completion = _full_rows(prompts, completions, index)
    weights = torch.tensor([0.5, -1.0, 2.0, 1.5, -0.3])

    model.zero_grad(set_to_none=True)
    full, full_entropy = sequence_logprobs(model, ids, attention, completion, return_entropy=True, chunk_size=2)
    (full.sum(-1) * weights).sum().backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    shared, shared_entropy = shared_prompt_logprobs(model, *grouped, return_entropy=True, chunk_size=2)
    (shared.sum(-1) * weights).sum().backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    # completion token j of row i sits at column width - len(completion i) + j of the full batch
    width = ids.shape[1]
    for row, tokens in enumerate(completions):
        columns = slice(width - len(tokens), width)
        torch.testing.assert_close(shared[row, :len(tokens)], full[row, columns], atol=ATOL, rtol=0)
        torch.testing.assert_close(shared_entropy[row, :len(tokens)], full_entropy[row, columns], atol=ATOL, rtol=0)
        assert torch.all(shared[row, len(tokens):] == 0) and torch.all(shared_entropy[row, len(tokens):] == 0)
    for a, b in zip(shared_grads, full_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _input_widths(model, run) -> list[tuple[int, int]]:
    """The (rows, columns) of every input the model's embedding sees while `run()` runs."""
    shapes: list[tuple[int, int]] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: shapes.append(tuple(i[0].shape)))
    try:
        with torch.no_grad():
            run()
    finally:
        hook.remove()
    return shapes


@pytest.mark.parametrize("completions", [None, [[7], [8], [9], [10], [11]]], ids=["mixed", "one_token_each"])
def test_the_model_never_runs_the_last_completion_column(model, completions):
    """The last completion token's hidden state would predict a token after the completion: neither function
    feeds it, and the values are still those of the full rows (one-token completions: only the prompt pass)."""
    prompts, mixed, index = _grouped()
    completions = completions or mixed
    grouped = _grouped_tensors(prompts, completions, index)
    ids, attention, completion = _full_rows(prompts, completions, index)
    width = max(map(len, completions))

    shared = []
    shapes = _input_widths(model, lambda: shared.append(shared_prompt_logprobs(model, *grouped)))
    assert shapes == [(2, 5)] + ([(5, width - 1)] if width > 1 else [])
    # trailing columns no row fills (a mini-batch of the shorter rows) are not run either, and come back as zeros
    padded = (*grouped[:3], *(torch.nn.functional.pad(t, (0, 2)) for t in grouped[3:]))
    assert _input_widths(model, lambda: shared.append(shared_prompt_logprobs(model, *padded))) == shapes
    torch.testing.assert_close(shared[1], torch.nn.functional.pad(shared[0], (0, 2)), atol=0, rtol=0)
    full = []
    assert _input_widths(model, lambda: full.append(sequence_logprobs(model, ids, attention, completion))) == \
        [(5, ids.shape[1] - 1)]
    for row, tokens in enumerate(completions):
        torch.testing.assert_close(shared[0][row, :len(tokens)], full[0][row, -len(tokens):], atol=ATOL, rtol=0)
    ids, attention, completion = _batch()
    assert _input_widths(model, lambda: sequence_logprobs(model, ids, attention, completion)) == [(3, 11)]


def test_shared_prompt_gradients_are_the_same_on_every_run(model):
    """GRPO's mini-batches gather a prompt's cache for its rows in shuffled order: the gradients summed back
    into the prompt must not depend on how CPU threads interleave (advanced indexing's backward made two identical
    GRPO runs diverge after one update)."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(7, 19, (16, 6), generator=g)
    index = torch.arange(16).repeat_interleave(8)[torch.randperm(128, generator=g)]
    completion_ids = torch.randint(7, 19, (128, 6), generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the race needs two threads (CI has 2 cores)
    try:
        grads = set()
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            shared_prompt_logprobs(model, prompt_ids, torch.ones_like(prompt_ids), index, completion_ids,
                                   torch.ones_like(completion_ids)).sum().backward()
            grads.add(b"".join(p.grad.numpy().tobytes() for p in model.parameters()))
        model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    assert len(grads) == 1


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_temperature_gives_the_log_probs_of_the_sampled_distribution(model, temperature):
    """Rollouts drawn at temperature T: log-probs and entropies of softmax(logits / T), shared prompt or not."""
    ids, attention, completion = _batch()
    with torch.no_grad():
        logps, entropy = sequence_logprobs(model, ids, attention, completion, return_entropy=True,
                                           temperature=temperature)
        ref_logps, ref_entropy = _naive(model, ids, attention, completion, temperature)
        assert not torch.allclose(logps, sequence_logprobs(model, ids, attention, completion), atol=1e-3)
        torch.testing.assert_close(logps, ref_logps, atol=ATOL, rtol=0)
        torch.testing.assert_close(entropy, ref_entropy, atol=ATOL, rtol=0)
        prompts, completions, index = _grouped()
        full_ids, full_attention, full_completion = _full_rows(prompts, completions, index)
        full = sequence_logprobs(model, full_ids, full_attention, full_completion, temperature=temperature)
        shared = shared_prompt_logprobs(model, *_grouped_tensors(prompts, completions, index), temperature=temperature)
    width = full_ids.shape[1]
    for row, tokens in enumerate(completions):
        torch.testing.assert_close(shared[row, :len(tokens)], full[row, width - len(tokens):], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="temperature=0: expected > 0"):
        sequence_logprobs(model, ids, attention, completion, temperature=0)


def test_shared_prompt_logprobs_rejects_mismatched_inputs(model):
    prompt_ids, prompt_mask, index, completion_ids, completion_mask = _grouped_tensors(*_grouped())
    with pytest.raises(ValueError, match="prompt_index: expected one entry per completion row"):
        shared_prompt_logprobs(model, prompt_ids, prompt_mask, index[:2], completion_ids, completion_mask)
    with pytest.raises(ValueError, match="prompt_mask / completion_mask"):
        shared_prompt_logprobs(model, prompt_ids, prompt_mask[:, 1:], index, completion_ids, completion_mask)
    with pytest.raises(ValueError, match="completion_ids: expected 2 dimensions"):
        shared_prompt_logprobs(model, prompt_ids, prompt_mask, index, completion_ids[0], completion_mask[0])
    with pytest.raises(ValueError, match="completion_ids: expected at least one column"):
        shared_prompt_logprobs(model, prompt_ids, prompt_mask, index, completion_ids[:, :0], completion_mask[:, :0])
    with pytest.raises(ValueError, match="prompt_mask: prompt 1 has no token"):
        shared_prompt_logprobs(model, prompt_ids, prompt_mask * torch.tensor([[1], [0]]), index, completion_ids,
                               completion_mask)


# Decoders whose forward turns lm_head(hidden) into their logits, each transform strong enough to change every value
HEAD_TRANSFORMS = {
    "gemma2 final_logit_softcapping": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=24, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        intermediate_size=64, final_logit_softcapping=0.05)),
    "cohere logit_scale": lambda: transformers.CohereForCausalLM(transformers.CohereConfig(
        vocab_size=24, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, logit_scale=8.0)),
    "granite logits_scaling": lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(
        vocab_size=24, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, logits_scaling=0.125)),
}


@pytest.mark.parametrize("name", HEAD_TRANSFORMS)
def test_a_model_that_transforms_its_logits_gets_the_log_probs_of_its_own_logits(name):
    """Gemma 2/3 soft-cap their logits, Cohere scales them, Granite divides them: the log-probs are those of the
    model's own logits (full and shared-prompt rows alike), not of its output layer's."""
    torch.manual_seed(0)
    model = HEAD_TRANSFORMS[name]().eval()
    ids, attention, completion = _batch()
    prompts, completions, index = _grouped()
    rows = _full_rows(prompts, completions, index)
    with torch.no_grad():
        logps, entropy = sequence_logprobs(model, ids, attention, completion, return_entropy=True, chunk_size=2)
        ref_logps, ref_entropy = _naive(model, ids, attention, completion)
        hidden = model(ids, attention_mask=attention, position_ids=position_ids_from_mask(attention),
                       output_hidden_states=True).hidden_states[-1]
        head_only = model.get_output_embeddings()(hidden).log_softmax(-1)[:, :-1]
        full = sequence_logprobs(model, *rows)
        shared = shared_prompt_logprobs(model, *_grouped_tensors(prompts, completions, index))
    torch.testing.assert_close(logps, ref_logps, atol=ATOL, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=ATOL, rtol=0)
    taken = head_only.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)[completion[:, 1:].bool()]
    assert float((taken - ref_logps[:, 1:][completion[:, 1:].bool()]).abs().min()) > 1e-3  # the transform matters
    width = rows[0].shape[1]
    for row, tokens in enumerate(completions):
        torch.testing.assert_close(shared[row, :len(tokens)], full[row, width - len(tokens):], atol=ATOL, rtol=0)


class _DoubledLogits(transformers.LlamaForCausalLM):
    """Remote code of a kind these log-probs cannot know: the forward doubles the output layer's logits."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_a_model_whose_logits_are_not_reproduced_is_a_one_line_error_not_wrong_log_probs(model):
    doubled = _DoubledLogits(model.config).eval()
    doubled.load_state_dict(model.state_dict())
    ids, attention, completion = _batch()
    with pytest.raises(UnsupportedModelError, match=r"^_DoubledLogits \(llama\): its forward makes its logits "
                       r"otherwise than from its output layer .*; max difference [0-9.e+-]+$"):
        sequence_logprobs(doubled, ids, attention, completion)
    with pytest.raises(UnsupportedModelError):
        shared_prompt_logprobs(doubled, *_grouped_tensors(*_grouped()))


# ---- DPO pairs packed a pair per row


def _pairs(seed: int = 0) -> Encoded:
    """Pairs (rows 2i, 2i + 1 share a prompt) of 1-7 prompt tokens and 1-6 answer tokens, one-token answers too."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for prompt_len, chosen_len, rejected_len in [(3, 2, 5), (7, 1, 1), (1, 6, 2), (4, 3, 3), (2, 1, 6), (5, 4, 1)]:
        prompt = torch.randint(7, 19, (prompt_len,), generator=g).tolist()
        prompts += [prompt, prompt]
        completions += [torch.randint(7, 19, (n,), generator=g).tolist() for n in (chosen_len, rejected_len)]
    return Encoded(prompts, completions)


def _packed_and_rows(model, encoded: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, 2) sums of the packed rows and of the two plain rows per pair (one batch each)."""
    pairs = list(range(len(encoded) // 2))
    batch = collate_pairs(encoded, pairs, pad_id=0)
    packed = pair_logprob_sums(model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.segments,
                               batch.sources, batch.targets, batch.target_sides, chunk_size=3)
    rows = collate(encoded, list(range(len(encoded))), pad_id=0)
    plain = completion_logprob_sums(model, rows.input_ids, rows.attention_mask, rows.completion_mask)
    return packed, plain.view(-1, 2)


def test_packed_pairs_give_their_two_rows_sums_and_gradients(model):
    """Prefix sharing: a pair's prompt runs once, its rejected answer never sees the chosen one, and each sum and
    every gradient is that of the pair's two plain rows."""
    encoded = _pairs()
    weights = torch.tensor([[1.0, -1.0], [0.5, 2.0], [-0.7, 0.3], [1.5, -2.0], [0.2, 0.9], [-1.1, 0.4]])
    grads = []
    for take in (0, 1):
        model.zero_grad(set_to_none=True)
        sums = _packed_and_rows(model, encoded)[take]
        (sums * weights).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        packed, plain = _packed_and_rows(model, encoded)
    torch.testing.assert_close(packed, plain, atol=ATOL, rtol=0)
    assert bool((packed < 0).all())
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    shapes = _input_widths(model, lambda: _packed_and_rows(model, encoded))
    assert shapes[0] == (6, max(len(encoded.prompt_ids[2 * i]) + len(encoded.completion_ids[2 * i])
                                + len(encoded.completion_ids[2 * i + 1]) - 2 for i in range(6)))


def test_a_rejected_answer_never_reads_the_chosen_one(model):
    """Changing a pair's chosen answer leaves its rejected sum as it was, to the last bit of the same batch."""
    encoded = _pairs()
    other = Encoded(encoded.prompt_ids, [list(ids) for ids in encoded.completion_ids])
    other.completion_ids[0] = [18 if token != 18 else 17 for token in other.completion_ids[0]]
    with torch.no_grad():
        before, after = _packed_and_rows(model, encoded)[0], _packed_and_rows(model, other)[0]
    assert float(before[0, 0]) != float(after[0, 0])
    torch.testing.assert_close(after[:, 1], before[:, 1], atol=0, rtol=0)


# Decoders of other families (other norms, rotary layouts, head transforms, eager-only attention)
OTHER_FAMILIES = {
    **HEAD_TRANSFORMS,
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=24, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64)),
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=24, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)),
}


@pytest.mark.parametrize("name", OTHER_FAMILIES)
def test_packed_pairs_equal_their_rows_in_other_families(name):
    """In each attention implementation the family has (Gemma 2: eager only), a mask in that one's format."""
    torch.manual_seed(0)
    model = OTHER_FAMILIES[name]().eval()
    for attention in ("sdpa", "eager") if model._supports_sdpa else ("eager",):
        model.set_attn_implementation(attention)
        with torch.no_grad():
            packed, plain = _packed_and_rows(model, _pairs(seed=1))
        assert packs_pairs(model, 64)
        torch.testing.assert_close(packed, plain, atol=ATOL, rtol=0)


def test_packing_is_only_for_models_that_take_its_mask(model):
    assert packs_pairs(model, 64)
    flash = transformers.LlamaForCausalLM(copy.deepcopy(model.config))
    flash.config._attn_implementation = "flash_attention_2"  # takes no 4D mask (set without the kernel installed)
    assert not packs_pairs(flash, 64)
    doubled = _DoubledLogits(model.config)  # a class from outside transformers: its forward may not take the mask
    assert not packs_pairs(doubled, 64)
    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=24, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, sliding_window=16))
    assert packs_pairs(windowed, 16) and not packs_pairs(windowed, 17)
    local = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(  # GPT-Neo's local layers: window_size
        vocab_size=24, hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
        window_size=8, max_position_embeddings=64))
    assert packs_pairs(local, 8) and not packs_pairs(local, 9)
    short = copy.deepcopy(model.config)
    short.max_position_embeddings = 20
    assert packs_pairs(transformers.LlamaForCausalLM(short), 20)
    assert not packs_pairs(transformers.LlamaForCausalLM(short), 21)  # GPT-Neo crashed past its positions
    hybrid = copy.deepcopy(model.config)
    hybrid.layer_types = ["full_attention", "linear_attention"]  # as Jamba, Qwen3-Next, Mamba hybrids declare
    assert not packs_pairs(transformers.LlamaForCausalLM(hybrid), 8)


def test_packed_pair_gradients_are_the_same_on_every_run(model):
    """The gather that picks each target's predicting column adds its gradients back in a fixed order."""
    encoded = _pairs()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = set()
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            _packed_and_rows(model, encoded)[0].sum().backward()
            grads.add(b"".join(p.grad.numpy().tobytes() for p in model.parameters()))
        model.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    assert len(grads) == 1
