"""HFSampler on the tiny model: output schema, seeded reproducibility, greedy = an unpadded argmax loop,
log-probs = a teacher-forced forward pass, stop strings, one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tokenizers.processors import TemplateProcessing
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pipeline_lib.models import build_tiny_model, load_policy, load_tokenizer
from pipeline_lib.rewards.math import is_correct
from pipeline_lib.sampling import hf as hf_module
from pipeline_lib.sampling.base import Completion, SamplingError
from pipeline_lib.sampling.hf import HFSampler, _ReservedLayer
from pipeline_lib.train.data import encode
from pipeline_lib.train.rollout import completions_batch, grouped_completions_batch

PROMPTS = ["12+34=", "5+6=", "97+70="]  # different lengths: exercises left padding


def test_schema_n_per_prompt_and_finish_reasons(hf_sampler):
    out = hf_sampler.generate(PROMPTS, n=4, max_new_tokens=6, seed=0, logprobs=True)
    tok = hf_sampler.tokenizer
    assert [len(group) for group in out] == [4, 4, 4]
    for group in out:
        for c in group:
            assert isinstance(c, Completion)
            assert c.finish_reason in ("stop", "length")
            assert 1 <= c.n_tokens <= 6 and len(c.logprobs) == c.n_tokens
            assert all(isinstance(t, int) for t in c.token_ids)
            assert all(isinstance(x, float) and x <= 0 for x in c.logprobs)
            # eos is kept (RL needs its log-prob), and only as the last token of a stopped sample
            assert (c.token_ids[-1] == tok.eos_token_id) == (c.finish_reason == "stop")
            assert tok.eos_token_id not in c.token_ids[:-1]
            assert c.finish_reason == "stop" or c.n_tokens == 6
            assert tok.decode(c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids) == c.text


def test_same_seed_same_samples_other_seed_other_samples(hf_sampler):
    first = hf_sampler.generate(PROMPTS, n=4, max_new_tokens=6, seed=7)
    again = hf_sampler.generate(PROMPTS, n=4, max_new_tokens=6, seed=7)
    other = hf_sampler.generate(PROMPTS, n=4, max_new_tokens=6, seed=8)
    assert first == again
    assert first != other
    # the n samples of a prompt are distinct draws, not copies (random 19-token model, 6 tokens each)
    assert len({tuple(c.token_ids) for c in first[0]}) > 1


def test_seeded_call_leaves_the_callers_rng_alone(hf_sampler):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    hf_sampler.generate(PROMPTS[:1], n=2, max_new_tokens=3, seed=5)
    assert torch.equal(torch.rand(3), expected)


def _plain_generate(sampler: HFSampler, prompts: list[str], *, n: int, max_new_tokens: int, seed: int,
                    temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """The generated ids (rows p0 x n, p1 x n, ...) of transformers' own generate with num_return_sequences=n
    (every prompt copy run n times, DynamicCache) under the sampler's settings, seeded like the sampler."""
    batch = sampler.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(seed)
        out = sampler.model.generate(**batch, max_new_tokens=max_new_tokens, num_return_sequences=n, use_cache=True,
                                     **sampler._generation_kwargs(temperature, top_p))
    return out[:, batch["input_ids"].shape[1]:]


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (1.5, 1.0)])
def test_prompt_cache_draws_the_samples_of_num_return_sequences(hf_sampler, temperature, top_p):
    """Each prompt runs once, its first tokens are drawn from its logits and its cache is copied n times; the
    same seed then draws exactly the tokens that generate's own num_return_sequences=n (every prompt copy run n
    times) draws, under temperature and top-p too."""
    out = hf_sampler.generate(PROMPTS, n=4, max_new_tokens=6, seed=11, temperature=temperature, top_p=top_p)
    plain = _plain_generate(hf_sampler, PROMPTS, n=4, max_new_tokens=6, seed=11, temperature=temperature,
                            top_p=top_p)
    for row, completion in enumerate(c for group in out for c in group):
        assert completion.token_ids == plain[row, :completion.n_tokens].tolist()


def test_one_sample_per_prompt_draws_the_samples_of_plain_generate(hf_sampler):
    """n = 1 also starts from the prefilled prompt cache (in growing buffers)."""
    out = hf_sampler.generate(PROMPTS, n=1, max_new_tokens=8, seed=4, logprobs=True)
    plain = _plain_generate(hf_sampler, PROMPTS, n=1, max_new_tokens=8, seed=4)
    for row, (completion,) in enumerate(out):
        assert completion.token_ids == plain[row, :completion.n_tokens].tolist()


@pytest.mark.parametrize("ending, max_new_tokens, forwards", [
    ("eos only", 1, {1}),  # one new token: the prompt pass alone
    # rows ended by their first token run on unseen by generate, then are cut; the others end before 6 tokens
    ("half the vocabulary", 6, {2, 3, 4, 5}),
    ("the whole vocabulary", 6, {1})])  # every row ended by its first token: no decode step
def test_rows_ended_by_their_first_token_are_the_samples_of_num_return_sequences(tiny_model_dir, ending,
                                                                                  max_new_tokens, forwards):
    tok = load_tokenizer(tiny_model_dir)
    sampler = HFSampler.from_pretrained(tiny_model_dir, device="cpu")
    sampler.eos_ids = {"eos only": {tok.eos_token_id}, "half the vocabulary": set(range(0, len(tok), 2)),
                       "the whole vocabulary": set(range(len(tok)))}[ending]
    calls = []
    hook = sampler.model.register_forward_hook(lambda *args: calls.append(1))
    try:
        out = sampler.generate(PROMPTS, n=4, max_new_tokens=max_new_tokens, seed=5, logprobs=True)
    finally:
        hook.remove()
    plain = _plain_generate(sampler, PROMPTS, n=4, max_new_tokens=max_new_tokens, seed=5)
    rows = [c for group in out for c in group]
    for row, completion in enumerate(rows):
        assert completion.token_ids == plain[row, :completion.n_tokens].tolist()
        assert len(completion.logprobs) == completion.n_tokens
    assert len(calls) in forwards
    if ending != "eos only":
        assert any(c.n_tokens == 1 and c.finish_reason == "stop" for c in rows)


def test_reserved_cache_layer_writes_in_place_grows_and_falls_back_to_concatenation():
    keys, values = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    layer = _ReservedLayer(keys, values, 2, room=6)
    expected_keys, expected_values = keys.repeat_interleave(2, dim=0), values.repeat_interleave(2, dim=0)
    assert torch.equal(layer.keys, expected_keys) and layer._key_buffer.shape[2] == 8  # twice the prompt
    for step in range(6):
        new_keys, new_values = torch.randn(4, 3, 1, 5), torch.randn(4, 3, 1, 5)
        got_keys, got_values = layer.update(new_keys, new_values)
        expected_keys = torch.cat([expected_keys, new_keys], dim=2)
        expected_values = torch.cat([expected_values, new_values], dim=2)
        assert torch.equal(got_keys, expected_keys) and torch.equal(got_values, expected_values)
        assert got_keys.data_ptr() == layer._key_buffer.data_ptr()  # a view of the buffer, written in place
        assert layer._key_buffer.shape[2] == (8 if step < 4 else 10)  # grown once, to the limit 4 + 6
    got_keys, _ = layer.update(new_keys, new_values)  # past the room: grows to what is needed
    assert got_keys.shape[2] == 11 and torch.equal(got_keys[:, :, -1:], new_keys)
    layer.batch_select_indices(torch.tensor([3, 0]))  # generate reordering rows: no longer the buffer
    got_keys, _ = layer.update(new_keys[:2], new_values[:2])  # concatenates
    assert got_keys.shape == (2, 3, 12, 5) and torch.equal(got_keys[:, :, -1:], new_keys[:2])
    assert torch.equal(got_keys[:, :, :4], keys[[1, 0]])


@pytest.mark.parametrize("prompts, heads, kv_heads, q_len, padded", [
    (3, 4, 4, 1, True), (3, 4, 2, 1, False), (3, 6, 2, 3, True), (3, 2, 1, 2, False), (1, 4, 2, 1, False),
    (1, 6, 2, 2, True)])
def test_shared_prefix_attention_equals_sdpa_on_rows_holding_their_own_prefix_copy(prompts, heads, kv_heads, q_len,
                                                                                   padded):
    """Rows u * n + j (sample j of prompt u) attending to [prompt u's prefix, own keys] through one prefix per
    prompt give sdpa's output on full rows; grouped-query heads, one prompt, several queries (causal among the
    row's own positions when there is no mask) and left-padded prefixes included."""
    n, prefix_len, own_len, dim = 4, 5, 4, 8
    torch.manual_seed(0)
    prefix_keys, prefix_values = torch.randn(2, prompts, kv_heads, prefix_len, dim).unbind(0)
    keys, values = torch.randn(2, prompts * n, kv_heads, own_len, dim).unbind(0)
    # transformers hands attention a transposed (N, q, H, D) projection: a non-contiguous query
    query = torch.randn(prompts * n, q_len, heads, dim).transpose(1, 2)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    allowed = torch.ones(prompts * n, 1, q_len, prefix_len + own_len, dtype=torch.bool)
    allowed[:, :, :, prefix_len:] = torch.ones(q_len, own_len, dtype=torch.bool).tril(own_len - q_len)
    if padded:
        allowed[:n, :, :, :2] = False  # prompt 0 is left-padded by two positions
    expected, _ = sdpa_attention_forward(
        module, query, torch.cat([prefix_keys.repeat_interleave(n, dim=0), keys], dim=2),
        torch.cat([prefix_values.repeat_interleave(n, dim=0), values], dim=2), allowed)
    token = hf_module._current_prefix.set((prefix_keys, prefix_values))
    try:  # without padding transformers passes no mask
        got, _ = hf_module._shared_prefix_attention_forward(module, query, keys, values, allowed if padded else None)
    finally:
        hf_module._current_prefix.reset(token)
    assert got.shape == expected.shape == (prompts * n, q_len, heads, dim)
    assert torch.allclose(got, expected, atol=1e-5)


def test_one_prompt_on_a_grouped_query_model_draws_the_samples_of_num_return_sequences(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    sampler = HFSampler(LlamaForCausalLM(config), tok)
    out = sampler.generate(PROMPTS[:1], n=4, max_new_tokens=6, seed=3)
    plain = _plain_generate(sampler, PROMPTS[:1], n=4, max_new_tokens=6, seed=3)
    for row, completion in enumerate(out[0]):
        assert completion.token_ids == plain[row, :completion.n_tokens].tolist()


def test_a_prompt_pass_that_attends_to_other_keys_than_it_caches_does_not_share_its_prefix():
    layers = [DynamicLayer(), DynamicLayer()]
    for layer in layers:
        layer.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    cache = DynamicCache()
    cache.layers = layers
    cached = [(layer.keys, layer.values, True) for layer in layers]
    assert hf_module._attends_to_its_cache(cached, cache)
    # e.g. a compressed latent cached, then expanded into the keys attention gets (DeepSeek's MLA)
    assert not hf_module._attends_to_its_cache([cached[0], (layers[1].keys.clone(), layers[1].values, True)], cache)
    assert not hf_module._attends_to_its_cache([cached[0], (layers[1].keys, layers[1].values, False)], cache)  # sinks
    assert not hf_module._attends_to_its_cache(cached[:1], cache)


def test_shared_prefix_sampling_is_used_on_cpu_and_the_model_attends_as_before_afterwards(hf_sampler):
    model = hf_sampler.model
    before = model.config._attn_implementation
    calls = []

    def counting(module, query, *args, **kwargs):
        calls.append(hf_module._current_prefix.get() is not None)
        return hf_module._shared_prefix_attention_forward(module, query, *args, **kwargs)

    AttentionInterface.register(hf_module.SHARED_PREFIX_ATTENTION, counting)
    try:
        hf_sampler.generate(PROMPTS, n=2, max_new_tokens=3, seed=0)
    finally:
        AttentionInterface.register(hf_module.SHARED_PREFIX_ATTENTION, hf_module._shared_prefix_attention_forward)
    layers = model.config.num_hidden_layers
    # the prompt pass (checked, plain sdpa; the first token comes from its logits), then 2 decode steps whose
    # every attention read the shared prefix
    assert calls == [False] * layers + [True] * 2 * layers
    assert model.config._attn_implementation == before
    assert hf_module._current_prefix.get() is None


def _greedy_reference(model, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Argmax decoding one token at a time on the unpadded prompt, no cache."""
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(next_id)
            if next_id == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out


def test_greedy_batched_left_padded_equals_unpadded_argmax_loop(hf_sampler):
    out = hf_sampler.generate(PROMPTS, n=3, max_new_tokens=6, temperature=0)
    for prompt, group in zip(PROMPTS, out):
        assert group[0] == group[1] == group[2]
        prompt_ids = hf_sampler.tokenizer(prompt)["input_ids"]
        assert group[0].token_ids == _greedy_reference(hf_sampler.model, hf_sampler.tokenizer, prompt_ids, 6)


def test_a_tokenizer_appending_eos_to_every_text_samples_and_trains_after_prompts_without_it(tiny_model_dir):
    """A `<s> $A </s>` post-processor (what Llama's `add_eos_token` writes) ended every raw prompt with eos, in
    sampling and training alike, without a warning: the model sampled, and trained, past its own end. Both now
    read the prompt as bos + its tokens, which is also what the vLLM backend is sent."""
    tokenizer = load_tokenizer(tiny_model_dir)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A </s>",
                                                                    special_tokens=[("<s>", bos), ("</s>", eos)])
    assert tokenizer("5+6=")["input_ids"][-1] == eos
    expected = [[bos, *tokenizer(prompt, add_special_tokens=False)["input_ids"]] for prompt in PROMPTS]
    sampler = HFSampler(load_policy(tiny_model_dir, device="cpu"), tokenizer)
    out = sampler.generate(PROMPTS, n=1, max_new_tokens=6, temperature=0)
    for prompt_ids, [completion] in zip(expected, out):
        assert completion.token_ids == _greedy_reference(sampler.model, tokenizer, prompt_ids, 6)
    completions = [group[0] for group in out]
    batch = completions_batch(tokenizer, PROMPTS, completions)
    prompt_rows = [row[mask.bool() & ~done.bool()].tolist() for row, mask, done
                   in zip(batch.input_ids, batch.attention_mask, batch.completion_mask)]
    grouped = grouped_completions_batch(tokenizer, PROMPTS, completions)
    assert prompt_rows == [row[mask.bool()].tolist() for row, mask in zip(grouped.prompt_ids, grouped.prompt_mask)]
    assert prompt_rows == expected
    assert encode(tokenizer, PROMPTS, ["1"] * len(PROMPTS), max_length=64).prompt_ids == expected


def test_sampling_leaves_the_tokenizer_it_saves_as_it_was(hf_sampler, tmp_path):
    """The padded prompt batch left the fast tokenizer's padding on, so a stage that saved its tokenizer after HF
    rollouts (DAPO with no update) wrote `padding` into tokenizer.json: its model dir, equal to its start's in
    weights, got another fingerprint and another sampling run."""
    hf_sampler.tokenizer.save_pretrained(tmp_path / "before")
    hf_sampler.generate(PROMPTS, n=2, max_new_tokens=3, temperature=1.0, seed=0)
    hf_sampler.tokenizer.save_pretrained(tmp_path / "after")
    assert (tmp_path / "after" / "tokenizer.json").read_bytes() == (tmp_path / "before" / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "after" / "tokenizer.json").read_text())["padding"] is None


@pytest.mark.parametrize("setting", [{"suppress_tokens": "digits"}, {"max_time": 1e-6}, {"num_beams": 3},
                                     {"repetition_penalty": 5.0, "top_k": 2, "min_p": 0.9, "bad_words_ids": "digits"}])
def test_a_model_dirs_generation_config_changes_no_sample(hf_sampler, tiny_model_dir, tmp_path, setting):
    """The settings the sampler passes are the only ones (vLLM reads no generation_config.json): a file that
    suppressed the digits changed every sample, `max_time` cut rows at 2 tokens as `length`, `num_beams` raised a
    RuntimeError traceback. Its eos ids still end a row."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    file = model_dir / "generation_config.json"
    digits = [hf_sampler.tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    values = {key: ([[d] for d in digits] if key == "bad_words_ids" else digits) if value == "digits" else value
              for key, value in setting.items()}
    file.write_text(json.dumps(json.loads(file.read_text()) | values))
    sampler = HFSampler.from_pretrained(model_dir, device="cpu")
    assert sampler.eos_ids == hf_sampler.eos_ids
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 3}):
        ours = sampler.generate(PROMPTS, n=2, max_new_tokens=8, **kwargs)
        assert ours == hf_sampler.generate(PROMPTS, n=2, max_new_tokens=8, **kwargs)
    assert sampler.model.generation_config.to_dict() | values == sampler.model.generation_config.to_dict()  # kept


def test_logprobs_match_a_teacher_forced_forward_pass(hf_sampler):
    out = hf_sampler.generate(PROMPTS, n=2, max_new_tokens=6, seed=3, temperature=0.7, logprobs=True)
    tok, model = hf_sampler.tokenizer, hf_sampler.model
    for prompt, group in zip(PROMPTS, out):
        prompt_ids = tok(prompt)["input_ids"]
        for c in group:
            ids = torch.tensor([prompt_ids + c.token_ids])
            with torch.no_grad():
                logps = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # (T, V)
            # the token at position p is predicted by the logits at p - 1; raw logits: temperature not applied
            positions = range(len(prompt_ids), ids.shape[1])
            expected = [float(logps[p - 1, ids[0, p]]) for p in positions]
            assert c.logprobs == pytest.approx(expected, abs=1e-4)


def test_stop_string_cuts_the_text_and_keeps_the_prefix(hf_sampler):
    free = hf_sampler.generate(PROMPTS, n=4, max_new_tokens=6, seed=11)
    # a character some sample produced after its first character, so the stop cuts a non-empty prefix
    sample = next(c for group in free for c in group if len(c.text) >= 2)
    stop = sample.text[1]
    cut = hf_sampler.generate(PROMPTS, n=4, max_new_tokens=6, seed=11, stop=[stop])
    for free_group, cut_group in zip(free, cut):
        for before, after in zip(free_group, cut_group):
            if stop in before.text:
                assert after.finish_reason == "stop"
                assert after.text == before.text[: before.text.index(stop)]
                assert before.token_ids[: after.n_tokens] == after.token_ids
            else:
                assert after == before


def test_a_row_that_ends_inside_a_character_drops_its_bytes_as_vllm_does(tmp_path):
    """Byte-level tokens of a character cut off by max_new_tokens (or eos) decode to U+FFFD; vLLM's incremental
    detokenizer holds such bytes back, so both backends store the text before them."""
    model_dir = build_tiny_model(tmp_path / "m", ["0123456789+=", "日本"])
    sampler = HFSampler.from_pretrained(model_dir, device="cpu")
    tok = sampler.tokenizer
    seven, nichi = (tok(text, add_special_tokens=False)["input_ids"] for text in ("7", "日"))
    assert len(nichi) == 3 and tok.decode(seven + nichi[:2]) == "7\ufffd"  # the three bytes of 日, two of them
    assert sampler._completion(seven + nichi[:2], None, ()).text == "7"
    assert sampler._completion(seven + nichi[:2] + [tok.eos_token_id], None, ()).text == "7"
    assert sampler._completion(seven + nichi, None, ()).text == "7日"


def test_a_stop_string_is_matched_in_the_completion_alone(hf_sampler):
    """A stop string that spans the prompt's end ('=' + a completion's first two characters) is not in the
    completion text: vLLM, which matches generated text only, samples on, and so must we. transformers' own
    stop_strings matched across the prompt, stopped such rows and padded them (pad ids counted as tokens,
    finish_reason 'length')."""
    free = hf_sampler.generate(PROMPTS, n=8, max_new_tokens=6, seed=3)
    sample = next(c for group in free for c in group if len(c.text) >= 2 and "=" not in c.text[:2])
    stop = "=" + sample.text[:2]
    cut = hf_sampler.generate(PROMPTS, n=8, max_new_tokens=6, seed=3, stop=[stop])
    assert sample in [c for group in cut for c in group]  # its prompt ends with '=': spanning, not matched
    for free_group, cut_group in zip(free, cut):
        for before, after in zip(free_group, cut_group):
            if stop in before.text:
                assert after.finish_reason == "stop" and after.text == before.text[: before.text.index(stop)]
            else:
                assert after == before


def test_a_special_token_inside_a_completion_stays_in_its_text_and_a_stop_string_can_name_it(hf_sampler):
    """Only the ending eos leaves the text: a special token the model sampled mid-answer stays, as in vLLM's text
    with skip_special_tokens off, so a verifier does not read `4<|user|>6` as 46, and a stop string naming the
    token ends the sample there."""
    tok = hf_sampler.tokenizer
    special = next(t for t in tok.all_special_tokens if t not in (tok.eos_token, tok.pad_token, tok.bos_token))
    special_id = tok.convert_tokens_to_ids(special)
    four, six = (tok("4", add_special_tokens=False)["input_ids"], tok("6", add_special_tokens=False)["input_ids"])
    written = hf_sampler._completion(four + [special_id] + six + [tok.eos_token_id], None, ())
    assert (written.text, written.finish_reason) == (f"4{special}6", "stop")
    assert not is_correct(written.text, "46") and is_correct(hf_sampler._completion(four + six, None, ()).text, "46")

    boost = torch.zeros(len(tok))
    boost[special_id] = 3.0  # frequent, so most rows hold it
    hook = hf_sampler.model.lm_head.register_forward_hook(lambda module, args, logits: logits + boost)
    try:
        free = hf_sampler.generate(PROMPTS, n=4, max_new_tokens=6, seed=1)
        cut = hf_sampler.generate(PROMPTS, n=4, max_new_tokens=6, seed=1, stop=[special])
    finally:
        hook.remove()
    holding = [c for group in free for c in group if special_id in c.token_ids]
    assert len(holding) >= 4 and all(special in c.text for c in holding)
    for free_group, cut_group in zip(free, cut):
        for before, after in zip(free_group, cut_group):
            if special in before.text:
                assert after.finish_reason == "stop" and after.text == before.text[: before.text.index(special)]
                assert after.token_ids == before.token_ids[: before.token_ids.index(special_id) + 1]
            else:
                assert after == before


def test_non_finite_logits_are_one_line_errors(hf_sampler):
    """A diverged model (a GRPO update at a huge learning rate) gives inf/NaN logits: torch.multinomial's raw
    RuntimeError became the stage's traceback. In the prompt pass and while decoding, it is one line now."""
    for finite_calls, where in ((0, "not finite"), (2, "while decoding")):  # the prompt pass is the first call
        calls = []

        def hook_fn(module, args, logits):
            calls.append(1)
            return logits if len(calls) <= finite_calls else logits * float("nan")

        hook = hf_sampler.model.lm_head.register_forward_hook(hook_fn)
        try:
            with pytest.raises(SamplingError, match=f"logits .*{where}.*its weights have diverged"):
                hf_sampler.generate(PROMPTS, n=2, max_new_tokens=4, seed=0)
        finally:
            hook.remove()


def test_bad_arguments_are_one_line_errors(hf_sampler):
    with pytest.raises(SamplingError, match="n=0"):
        hf_sampler.generate(PROMPTS, n=0, max_new_tokens=4)
    with pytest.raises(SamplingError, match=r"prompts\[1\]: empty"):
        hf_sampler.generate(["1+1=", ""], n=1, max_new_tokens=4)
    with pytest.raises(SamplingError, match=r"^prompts\[1\] \('12\+34='\) has \d+ tokens \+ max_new_tokens 300, "
                                            r"over the model's max_position_embeddings 256; sample problems whose "
                                            r"prompts fit \(a --problems source\) or fewer new tokens$"):
        hf_sampler.generate(["1=", "12+34="], n=1, max_new_tokens=300)
    with pytest.raises(SamplingError, match="top_p"):
        hf_sampler.generate(["1+1="], n=1, max_new_tokens=4, top_p=0)
    # logits / 1e-40 overflow to inf: multinomial failed with a RuntimeError traceback (vLLM raises it to 0.01)
    with pytest.raises(SamplingError, match=r"temperature=1e-40: expected 0 \(greedy\) or >= 0.01"):
        hf_sampler.generate(["1+1="], n=1, max_new_tokens=4, temperature=1e-40)
    # an empty stop string ended every sample at its first token, silently (vLLM refuses it)
    with pytest.raises(SamplingError, match=r"stop=\[''\]: expected a list of non-empty strings"):
        hf_sampler.generate(["1+1="], n=1, max_new_tokens=4, stop=[""])



def test_stop_string_is_cut_when_rows_are_padded_with_eos(hf_sampler, tiny_model_dir):
    # tokenizers without a pad token pad with eos (load_tokenizer); generate then pads stopped rows with eos
    tok = load_tokenizer(tiny_model_dir)
    tok.pad_token = tok.eos_token
    eos_padded = HFSampler(hf_sampler.model, tok)
    stop = ["+"]
    expected = hf_sampler.generate(PROMPTS, n=4, max_new_tokens=6, seed=2, stop=stop)
    got = eos_padded.generate(PROMPTS, n=4, max_new_tokens=6, seed=2, stop=stop)
    assert got == expected
    assert all("+" not in c.text for group in got for c in group)


def test_a_token_completing_two_stop_strings_cuts_at_the_one_it_completes_first(hf_sampler):
    """vLLM's rule (the same as reading the text a character at a time): the stop string that ends first in the
    text, ties broken by the stop list's order. `<|user|>` as one token completes `|` (ending after `4<|`) before
    `<|user|>` itself; it used to cut at whichever stop string started first."""
    tok = hf_sampler.tokenizer
    special = next(t for t in tok.all_special_tokens if t.startswith("<|") and t != tok.eos_token)
    four, nine, one, two = (tok(c, add_special_tokens=False)["input_ids"] for c in "4912")
    ids = four + [tok.convert_tokens_to_ids(special)] + four
    assert hf_sampler._completion(ids, None, [special, "|"]).text == "4<"
    assert hf_sampler._completion(nine + one + two, None, ["2", "12"]).text == "91"  # both end at 2: list order
    assert hf_sampler._completion(nine + one + two, None, ["12", "2"]).text == "9"


def test_the_token_ending_a_stop_string_is_found_in_log_many_decodes(hf_sampler, monkeypatch):
    """A stop string at the end of a 1,000-token row: the shortest prefix holding it, found without decoding
    every prefix (a linear scan decoded 1,000 prefixes per row, quadratic in the row's length)."""
    tok = hf_sampler.tokenizer
    ids = tok("12+34=" * 166 + "46", add_special_tokens=False)["input_ids"]
    calls = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda token_ids, **kw: calls.append(len(token_ids)) or decode(token_ids, **kw))
    assert hf_sampler._stop_string_end(ids, ["=46"]) == len(ids)
    assert hf_sampler._stop_string_end(ids, ["4="]) == 5 + 1  # "12+34=": the first 4= ends at token 6
    assert len(calls) <= 2 * (1 + len(ids).bit_length())


def test_top_p_under_deterministic_kernels_samples_on_cpu(hf_sampler):
    """CPU's cumsum is deterministic: top-p sampling under `deterministic: true` runs (the refusal is CUDA's alone)."""
    torch.use_deterministic_algorithms(True)
    try:
        rows = hf_sampler.generate(["12+34="], n=2, max_new_tokens=4, temperature=1.0, top_p=0.9, seed=0)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(rows[0]) == 2


@pytest.mark.gpu
def test_top_p_on_cuda_under_deterministic_kernels_is_one_line(tiny_model_dir):
    """torch has no deterministic CUDA cumsum for floats, which transformers' top-p warper needs: a GRPO rollout with
    `deterministic: true` and `top_p < 1` raised at its first draw, deep in generate. Now one line, before it."""
    sampler = HFSampler(load_policy(tiny_model_dir, device="cuda"), load_tokenizer(tiny_model_dir))
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(SamplingError, match=r"^top_p 0.9 on CUDA under deterministic kernels"):
            sampler.generate(["12+34="], n=2, max_new_tokens=4, temperature=1.0, top_p=0.9)
        assert sampler.generate(["12+34="], n=2, max_new_tokens=4, temperature=1.0, top_p=1.0)  # no nucleus
    finally:
        torch.use_deterministic_algorithms(False)
