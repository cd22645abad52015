"""In-process sampling with transformers `generate`: one batched, KV-cached, left-padded call per request, n samples
per prompt drawn from one prompt pass (the first token from its logits, its cache copied n times into buffers that
decode steps write in place, or shared by the n rows), seeded without disturbing the caller's RNG; CPU or CUDA."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from pathlib import Path

import torch
from torch import Tensor
from transformers import (
    AttentionInterface,
    DynamicCache,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.cache_utils import Cache, DynamicLayer
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from pipeline_lib.errors import text_start
from pipeline_lib.models.logprobs import model_positions, position_ids_from_mask, stop_token_ids
from pipeline_lib.models.tokens import prompt_token_ids
from pipeline_lib.sampling.base import Completion, SamplingError, check_sampling_args


class HFSampler:
    """`Sampler` over a loaded causal LM and its tokenizer (see `from_pretrained` to load both)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                 add_special_tokens: bool = True):
        if tokenizer.pad_token_id is None:
            raise SamplingError("tokenizer: has no pad token; load it with pipeline_lib.models.load_tokenizer")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        self.eos_ids = stop_token_ids(model, tokenizer)
        if not self.eos_ids:
            raise SamplingError("model: no eos_token_id in its generation_config or tokenizer")

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str = "auto", dtype: str = "auto",
                        add_special_tokens: bool = True, trust_remote_code: bool = False) -> "HFSampler":
        from pipeline_lib.models import load_policy, load_tokenizer

        return cls(load_policy(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code),
                   load_tokenizer(path, trust_remote_code=trust_remote_code), add_special_tokens=add_special_tokens)

    def _generation_kwargs(self, temperature: float, top_p: float) -> dict:
        """The sampler's settings, for a model holding a blank generation_config (`_blank_generation_config`):
        generate fills the rest from its global defaults, neutral but for top_k=50, which vLLM would not apply."""
        kwargs: dict = {"do_sample": temperature > 0, "pad_token_id": self.tokenizer.pad_token_id,
                        "eos_token_id": sorted(self.eos_ids)}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        else:
            # greedy: neutral values, so generate does not warn that sampling flags are ignored
            kwargs.update(temperature=1.0, top_p=1.0)
        return kwargs

    def _prompt_pass(self, batch, n: int, max_new_tokens: int, *, share: bool) -> tuple[Cache, Tensor]:
        """Each prompt run once: the cache for its n rows (p0 x n, p1 x n, ...) and its last logits (B, V).

        `num_return_sequences=n` would copy every prompt n times and run each copy, and generate would then run
        the last prompt token once more per row; here the whole prompt runs once and the first token is drawn
        from its logits (`_first_tokens`). Decode steps write their keys/values into growing buffers instead of
        concatenating the whole cache into a new tensor at every step. With `share` (inside
        `shared_prefix_attention`), when the prompt pass shows that every layer attends to exactly the
        keys/values it caches, the n rows of a prompt read its one cached prefix (`_SharedPrefixLayer`);
        otherwise each row gets its own copy (`_ReservedLayer`)."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        cache = DynamicCache(config=self.model.config)
        calls: list[tuple[Tensor, Tensor, bool]] = []
        token = _attention_calls.set(calls)
        try:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                             cache=cache, use_cache=True, logits_to_keep=1)
        finally:
            _attention_calls.reset(token)
        if all(type(layer) is DynamicLayer and layer.is_initialized for layer in cache.layers):
            # generate feeds the first token, then max_new_tokens - 2 sampled ones
            shared = share and _attends_to_its_cache(calls, cache)
            layer_kind = _SharedPrefixLayer if shared else _ReservedLayer
            cache = Cache(layers=[layer_kind(layer.keys, layer.values, n, room=max_new_tokens - 1)
                                  for layer in cache.layers])
        else:  # sliding-window or other layer kinds: their own copy
            cache.batch_repeat_interleave(n)
        return cache, out.logits[:, -1].float()

    def _can_share_prefix(self) -> bool:
        """Shared-prefix attention is exact where it replaces sdpa on a float32 CPU model of transformers'
        attention interface (bfloat16 would round the prefix scores differently from sdpa)."""
        model = self.model
        return (model.device.type == "cpu" and model.dtype == torch.float32
                and model.config._attn_implementation == "sdpa" and model._can_set_attn_implementation())

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[str],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        logprobs: bool = False,
    ) -> list[list[Completion]]:
        check_sampling_args(prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            stop=stop)
        if not prompts:
            return []
        device = self.model.device
        if top_p < 1 and temperature > 0 and device.type == "cuda" and torch.are_deterministic_algorithms_enabled():
            # torch raises at the first draw otherwise, deep inside transformers' top-p warper
            raise SamplingError(f"top_p {top_p} on CUDA under deterministic kernels: the nucleus needs torch.cumsum, "
                                "which has no deterministic CUDA kernel for floats; set top_p 1.0 or deterministic "
                                "false")
        # padded apart (`pad`): a padded call leaves the fast tokenizer's padding on, and a stage saving this
        # tokenizer with its model then wrote it into tokenizer.json (so the same model got another dir)
        ids = prompt_token_ids(self.tokenizer, prompts, add_special_tokens=self.add_special_tokens)
        batch = self.tokenizer.pad({"input_ids": ids}, padding=True, padding_side="left",
                                   return_attention_mask=True, return_tensors="pt").to(device)
        lengths = batch["attention_mask"].sum(dim=1)  # (B,)
        if int(lengths.min()) == 0:
            empty = int((lengths == 0).nonzero()[0])
            raise SamplingError(f"prompts[{empty}]: empty after tokenization; expected at least one token")
        limit = model_positions(self.model)
        prompt_len = batch["input_ids"].shape[1]
        if limit is not None and prompt_len + max_new_tokens > limit:
            longest = int(lengths.argmax())
            raise SamplingError(f"prompts[{longest}] ({text_start(prompts[longest])}) has {prompt_len} tokens + "
                                f"max_new_tokens {max_new_tokens}, over the model's max_position_embeddings {limit}; "
                                "sample problems whose prompts fit (a --problems source) or fewer new tokens")
        # fork_rng: a seeded call must not reset the RNG stream of a training loop calling us.
        devices = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            rows_per_prompt = n if temperature > 0 else 1  # greedy rejects num_return_sequences > 1: copy below
            share = rows_per_prompt > 1 and self._can_share_prefix()
            with shared_prefix_attention(self.model) if share else nullcontext():
                cache, last_logits = self._prompt_pass(batch, rows_per_prompt, max_new_tokens, share=share)
                if not torch.isfinite(last_logits).all():
                    bad = int((~torch.isfinite(last_logits)).any(dim=-1).nonzero()[0])
                    raise SamplingError(f"prompts[{bad}]: the model's next-token logits are not finite (inf or NaN); "
                                        "its weights have diverged or are damaged")
                first = _first_tokens(last_logits, rows_per_prompt, temperature, top_p)  # (B*n,)
                generated = first[:, None]
                step_logits = [last_logits.repeat_interleave(rows_per_prompt, dim=0)] if logprobs else []
                if max_new_tokens > 1 and not all(t in self.eos_ids for t in first.tolist()):
                    # a row whose first token ends it runs on unseen by generate; _completion cuts it there
                    stops = StoppingCriteriaList([_CompletionStops(self.tokenizer, stop, prompt_len)] if stop else [])
                    prompt_ids = batch["input_ids"].repeat_interleave(rows_per_prompt, dim=0)
                    prompt_mask = batch["attention_mask"].repeat_interleave(rows_per_prompt, dim=0)
                    try:
                        with _blank_generation_config(self.model):
                            out = self.model.generate(
                                input_ids=torch.cat([prompt_ids, generated], dim=1),
                                attention_mask=torch.cat([prompt_mask, torch.ones_like(generated)], dim=1),
                                cache=cache, max_new_tokens=max_new_tokens - 1, use_cache=True,
                                return_dict_in_generate=True, output_logits=logprobs, stopping_criteria=stops,
                                **self._generation_kwargs(temperature, top_p))
                    except RuntimeError as exc:  # torch.multinomial's refusal of inf/NaN probabilities
                        if "probability tensor contains" not in str(exc):
                            raise
                        raise SamplingError("the model's next-token logits became inf or NaN while decoding; its "
                                            "weights have diverged or are damaged") from None
                    generated = out.sequences[:, prompt_len:]  # (B*n, T) rows grouped by prompt: p0 x n, ...
                    step_logits += out.logits if logprobs else ()
        token_logps = _chosen_logprobs(step_logits, generated).tolist() if logprobs else None  # (B*n, T)
        rows = [self._completion(ids, None if token_logps is None else token_logps[r], stop)
                for r, ids in enumerate(generated.tolist())]  # one device sync, not one per row
        if temperature == 0:
            rows = [row for row in rows for _ in range(n)]
        return [rows[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _completion(self, ids: list[int], token_logps: list[float] | None, stop: Sequence[str]) -> Completion:
        """Cut one generated row at its end: the first eos (kept) or the token completing a stop string,
        whichever comes first (generate pads finished rows, with eos itself when pad == eos).

        The text is every token but the ending eos, special tokens included (vLLM's with skip_special_tokens
        off): a verifier reads what the model wrote, so `4<|user|>6` is not the answer 46."""
        eos_at = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
        end, reason = (len(ids), "length") if eos_at is None else (eos_at + 1, "stop")
        body = ids[:eos_at] if eos_at is not None else ids
        stop_at = self._stop_string_end(body, stop) if stop else None
        if stop_at is not None:
            end, reason, body = stop_at, "stop", ids[:stop_at]
        ids = ids[:end]
        text = self.tokenizer.decode(body)
        if stop_at is not None:
            # the stop string the last token completed first (ties: stop-list order), as vLLM cuts
            _, _, first = min((text.find(s) + len(s), order, s) for order, s in enumerate(stop) if s in text)
            text = text[:text.find(first)]
        else:
            # the bytes of a character the row ended inside decode to U+FFFD; vLLM's incremental detokenizer
            # holds them back until the character completes, so its text ends before them
            text = text.rstrip("\ufffd")
        logps = None if token_logps is None else token_logps[:end]
        return Completion(text=text, token_ids=ids, finish_reason=reason, logprobs=logps)

    def _stop_string_end(self, ids: list[int], stop: Sequence[str]) -> int | None:
        """Length of the shortest prefix whose text contains a stop string (generate stopped the row there): a
        binary search, since a prefix holding one passes it on to every longer prefix (log2 T decodes, not T)."""
        def holds(k: int) -> bool:
            text = self.tokenizer.decode(ids[:k])
            return any(s in text for s in stop)

        if not holds(len(ids)):
            return None
        short, long = 0, len(ids)  # the empty prefix holds no (non-empty) stop string; `long` holds one
        while long - short > 1:
            middle = (short + long) // 2
            short, long = (short, middle) if holds(middle) else (middle, long)
        return long


@contextmanager
def _blank_generation_config(model: PreTrainedModel) -> Iterator[None]:
    """`generate` takes every setting it is not passed from the model's generation_config: a model dir's
    generation_config.json with `suppress_tokens`, `max_time` or `num_beams` changed what was sampled, cut rows
    early or broke the call, where vLLM reads no such file (`--generation-config vllm`). While it runs, the model
    holds a blank one: the sampler's own settings alone apply (its eos ids are read from the file at init)."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


class _CompletionStops(StoppingCriteria):
    """Stops a row once the text of its completion holds a stop string: the prompt excluded, special tokens
    included, the text vLLM matches `stop` against and `_completion` cuts (a row already ended by eos may match
    on its padding; it is done either way). transformers' own `stop_strings` also matched across the prompt's end,
    so it stopped rows whose completion held no stop string, and they came back padded, counted as 'length'."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str], start: int):
        self.tokenizer, self.stop, self.start = tokenizer, tuple(stop), start
        # a stop string of L characters is at most 4L UTF-8 bytes: the tokens decoding to it are among the last 4L
        self.window = 4 * max(len(s) for s in stop)
        self.done: set[int] = set()

    def __call__(self, input_ids: Tensor, scores: Tensor | None, **kwargs) -> Tensor:
        tails = self.tokenizer.batch_decode(input_ids[:, max(self.start, input_ids.shape[1] - self.window):].tolist())
        for row, tail in enumerate(tails):
            if row in self.done or not any(s in tail for s in self.stop):
                continue
            # a window can start inside a character; the whole completion's text decides
            text = self.tokenizer.decode(input_ids[row, self.start:])
            if any(s in text for s in self.stop):
                self.done.add(row)
        return torch.tensor([row in self.done for row in range(len(tails))], device=input_ids.device)


class _ReservedLayer(DynamicLayer):
    """A layer's prefilled keys/values copied n times (rows p0 x n, p1 x n, ...) into buffers that grow by
    doubling, up to their length + `room` positions.

    `update` writes new keys/values into the buffers and returns views of the filled part: `DynamicLayer`
    concatenates the whole cache into new tensors at every decode step, traffic quadratic in the length; here it
    is linear, and memory stays within twice the filled part (no allocation for a room generation never uses).
    Should generate replace `keys` (a batch reorder), `update` falls back to concatenation."""

    def __init__(self, keys: Tensor, values: Tensor, n: int, *, room: int):
        super().__init__()
        rows, heads, length = keys.shape[:3]  # (B, H, L, D)
        self._limit = length + room
        capacity = min(self._limit, 2 * length)
        self._key_buffer = keys.new_empty((rows * n, heads, capacity, keys.shape[-1]))
        self._value_buffer = values.new_empty((rows * n, heads, capacity, values.shape[-1]))
        for buffer, prefix in ((self._key_buffer, keys), (self._value_buffer, values)):
            buffer.view(rows, n, *buffer.shape[1:])[:, :, :, :length] = prefix.unsqueeze(1)  # n copies per row
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if self.keys.data_ptr() != self._key_buffer.data_ptr() or self.keys.shape[0] != self._key_buffer.shape[0]:
            return super().update(key_states, value_states, *args, **kwargs)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            self._grow(start, capacity=max(end, min(self._limit, 2 * self._key_buffer.shape[-2])))
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values

    def _grow(self, filled: int, *, capacity: int) -> None:
        """New buffers of `capacity` positions holding the first `filled` ones of the old."""
        for name in ("_key_buffer", "_value_buffer"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], capacity, old.shape[-1]))
            new[:, :, :filled] = old[:, :, :filled]
            setattr(self, name, new)


class _SharedPrefixLayer(_ReservedLayer):
    """A layer's prefilled keys/values kept once for n rows each: rows p0 x n, p1 x n, ... share their prompt's
    cached prefix, and only the keys/values after it are per row (in growing buffers, empty at first).

    `update` returns the per-row part, so the model must attend through `shared_prefix_attention`, which reads
    the prefix this layer publishes right before its attention call."""

    def __init__(self, keys: Tensor, values: Tensor, n: int, *, room: int):
        super().__init__(keys[:, :, :0], values[:, :, :0], n, room=room)
        self.prefix_keys, self.prefix_values = keys, values  # (B, H, L, D)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        _current_prefix.set((self.prefix_keys, self.prefix_values))
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.prefix_keys.shape[-2] + self.keys.shape[-2]

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError("shared-prefix cache: rows cannot be reordered, repeated or cropped")

    batch_select_indices = batch_repeat_interleave = crop = reorder_cache = _refuse


SHARED_PREFIX_ATTENTION = "alignflow_shared_prefix"
_current_prefix: ContextVar[tuple[Tensor, Tensor] | None] = ContextVar("alignflow_current_prefix", default=None)
_attention_calls: ContextVar[list[tuple[Tensor, Tensor, bool]] | None] = ContextVar("alignflow_attention_calls",
                                                                                     default=None)
_OPTIONS_NOT_SHARED = ("softcap", "s_aux", "sliding_window")


def _attends_to_its_cache(calls: list[tuple[Tensor, Tensor, bool]], cache: DynamicCache) -> bool:
    """Whether the prompt pass's attention calls, one per cache layer in order, each took the very keys/values
    its layer caches, with no option the shared-prefix attention lacks. A model that caches something else (a
    compressed latent it expands after the cache update, as DeepSeek's MLA does) fails this."""
    return len(calls) == len(cache.layers) and all(
        plain and keys is layer.keys and values is layer.values
        for (keys, values, plain), layer in zip(calls, cache.layers))


def _shared_prefix_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                     attention_mask: Tensor | None, dropout: float = 0.0,
                                     scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """Attention of rows r = u * n + j (sample j of prompt u) over [prompt u's cached prefix, row r's own keys].

    query (N, H, q, D); key/value (N, Hkv, t, D), the row's own part; the prefix (U, Hkv, L, D) comes from the
    cache layer updated just before. Scores against the prefix are one matmul per prompt for its n x H/Hkv
    queries, so the prefix is read once per prompt instead of once per row; the softmax runs over both parts
    together (float32); attention_mask (N, 1, q, L + t) is transformers' sdpa mask (True = attend) or None.
    Outside a shared-prefix decode step it is sdpa, and records the call when a prompt pass is being checked
    (`_attends_to_its_cache`)."""
    prefix = _current_prefix.get()
    if prefix is None:
        if (calls := _attention_calls.get()) is not None:
            calls.append((key, value, dropout == 0 and all(kwargs.get(name) is None for name in _OPTIONS_NOT_SHARED)))
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    prefix_keys, prefix_values = prefix
    rows, heads, q_len, dim = query.shape
    prompts, kv_heads, prefix_len = prefix_keys.shape[:3]
    n, groups, own_len = rows // prompts, heads // kv_heads, key.shape[2]
    scaling = dim ** -0.5 if scaling is None else scaling
    # (U, n, Hkv, G, q, D) -> (U, Hkv, n G q, D): a prompt's queries against its prefix in one matmul
    by_prompt = query.reshape(prompts, n, kv_heads, groups, q_len, dim).transpose(1, 2)
    by_prompt = by_prompt.reshape(prompts, kv_heads, n * groups * q_len, dim)
    prefix_scores = (by_prompt @ prefix_keys.transpose(-1, -2)).view(prompts, kv_heads, n, groups, q_len, prefix_len)
    prefix_scores = prefix_scores.transpose(1, 2).reshape(rows, heads, q_len, prefix_len)
    own_scores = query.reshape(rows, kv_heads, groups * q_len, dim) @ key.transpose(-1, -2)
    scores = torch.cat([prefix_scores, own_scores.view(rows, heads, q_len, own_len)], dim=-1).float() * scaling
    if attention_mask is None:  # no padding: causal among the row's own positions (the prefix precedes them)
        attention_mask = torch.ones(q_len, prefix_len + own_len, dtype=torch.bool, device=query.device)
        attention_mask[:, prefix_len:] = torch.ones(q_len, own_len, dtype=torch.bool,
                                                    device=query.device).tril(own_len - q_len)
    scores = scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
        else scores + attention_mask  # an additive mask
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    prefix_probs = probs[..., :prefix_len].reshape(prompts, n, kv_heads, groups * q_len, prefix_len).transpose(1, 2)
    prefix_out = prefix_probs.reshape(prompts, kv_heads, n * groups * q_len, prefix_len) @ prefix_values
    prefix_out = prefix_out.view(prompts, kv_heads, n, groups * q_len, dim).transpose(1, 2)
    own_out = probs[..., prefix_len:].reshape(rows, kv_heads, groups * q_len, own_len) @ value
    out = (prefix_out.reshape(rows, kv_heads, groups * q_len, dim) + own_out).reshape(rows, heads, q_len, dim)
    return out.transpose(1, 2).contiguous(), None  # (N, q, H, D), as transformers' attention functions return


AttentionInterface.register(SHARED_PREFIX_ATTENTION, _shared_prefix_attention_forward)
AttentionMaskInterface.register(SHARED_PREFIX_ATTENTION, sdpa_mask)


@contextmanager
def shared_prefix_attention(model: PreTrainedModel) -> Iterator[None]:
    """`model` attends through `_shared_prefix_attention_forward` inside the block, then as before."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(SHARED_PREFIX_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        _current_prefix.set(None)


def _first_tokens(logits: Tensor, n: int, temperature: float, top_p: float) -> Tensor:
    """The first token of each of the n rows per prompt (B*n,), drawn from the prompt pass's last logits (B, V)
    as generate draws every later token: transformers' temperature then top-p warpers and one multinomial over
    all B*n rows, so a seed gives the tokens generate's own first step would (greedy: the argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1).repeat_interleave(n)
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    probs = torch.softmax(warpers(None, logits), dim=-1).repeat_interleave(n, dim=0)
    return torch.multinomial(probs, num_samples=1).squeeze(1)


def _chosen_logprobs(step_logits: Sequence[Tensor], generated: Tensor) -> Tensor:
    """log softmax of the raw logits at each step, gathered at the generated token; step by step, so no
    (B*n, T, V) log-prob tensor is built beside the logits generate already holds."""
    columns = [
        torch.log_softmax(logits.float(), dim=-1).gather(1, generated[:, t:t + 1])  # (B*n, 1)
        for t, logits in enumerate(step_logits)
    ]
    return torch.cat(columns, dim=1).cpu()  # (B*n, T)
