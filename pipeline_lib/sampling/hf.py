"""In-process sampling with transformers `generate`: one batched, KV-cached, left-padded call per request, n samples
per prompt drawn from one prompt pass (its cache copied n times into buffers that decode steps write in place),
seeded without disturbing the caller's RNG; CPU or CUDA."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, DynamicLayer

from pipeline_lib.models.logprobs import position_ids_from_mask
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
        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        if not self.eos_ids:
            raise SamplingError("model: no eos_token_id in its generation_config or tokenizer")

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str = "auto", dtype: str = "auto",
                        add_special_tokens: bool = True) -> "HFSampler":
        from pipeline_lib.models import load_policy, load_tokenizer

        return cls(load_policy(path, dtype=dtype, device=device), load_tokenizer(path),
                   add_special_tokens=add_special_tokens)

    def _generation_kwargs(self, temperature: float, top_p: float, stop: Sequence[str]) -> dict:
        """Explicit sampling settings: `generate` otherwise fills unset ones from the model's
        generation_config and its global defaults (top_k=50), which vLLM would not apply."""
        kwargs: dict = {
            "do_sample": temperature > 0,
            "repetition_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "min_new_tokens": 0,
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": sorted(self.eos_ids),
        }
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=0, typical_p=1.0,
                          epsilon_cutoff=0.0, eta_cutoff=0.0)
            if self.model.generation_config.min_p is not None:
                kwargs["min_p"] = 0.0
        else:
            # greedy: neutral values, so generate does not warn that sampling flags are ignored
            kwargs.update(temperature=1.0, top_p=1.0)
        if stop:
            kwargs.update(stop_strings=list(stop), tokenizer=self.tokenizer)
        return kwargs

    def _inputs_with_prompt_cache(self, batch, n: int, max_new_tokens: int) -> dict:
        """generate() inputs for n samples of each prompt. `num_return_sequences=n` would copy every prompt n
        times and run each copy; here the prompts but their last token run once, their KV cache is copied n
        times, and generate starts from it. Rows come out in the same order (p0 x n, p1 x n, ...) and draw
        the same random numbers, so a seed gives the samples num_return_sequences gives.

        The copies go into growing buffers (`_ReservedLayer`), so a decode step writes its keys/values in place
        instead of concatenating every cached one into a new tensor."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if ids.shape[1] < 2:
            return {**batch, "num_return_sequences": n}
        cache = DynamicCache(config=self.model.config)
        head, head_mask = ids[:, :-1], mask[:, :-1]  # (B, P-1)
        self.model(input_ids=head, attention_mask=head_mask, position_ids=position_ids_from_mask(head_mask),
                   cache=cache, use_cache=True, logits_to_keep=1)
        if all(type(layer) is DynamicLayer and layer.is_initialized for layer in cache.layers):
            # generate feeds the last prompt token, then max_new_tokens - 1 sampled ones
            cache = Cache(layers=[_ReservedLayer(layer, n, room=max_new_tokens) for layer in cache.layers])
        else:  # sliding-window or other layer kinds: their own copy
            cache.batch_repeat_interleave(n)
        return {"input_ids": ids.repeat_interleave(n, dim=0), "attention_mask": mask.repeat_interleave(n, dim=0),
                "cache": cache, "num_return_sequences": 1}

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
        check_sampling_args(prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        if not prompts:
            return []
        device = self.model.device
        batch = self.tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left",
                               add_special_tokens=self.add_special_tokens).to(device)
        lengths = batch["attention_mask"].sum(dim=1)  # (B,)
        if int(lengths.min()) == 0:
            empty = int((lengths == 0).nonzero()[0])
            raise SamplingError(f"prompts[{empty}]: empty after tokenization; expected at least one token")
        limit = getattr(self.model.config, "max_position_embeddings", None)
        prompt_len = batch["input_ids"].shape[1]
        if limit is not None and prompt_len + max_new_tokens > limit:
            raise SamplingError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds the "
                                f"model's max_position_embeddings {limit}")
        # fork_rng: a seeded call must not reset the RNG stream of a training loop calling us.
        devices = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                # greedy rejects num_return_sequences > 1: decode once, copy below
                **self._inputs_with_prompt_cache(batch, n if temperature > 0 else 1, max_new_tokens),
                max_new_tokens=max_new_tokens,
                use_cache=True,
                return_dict_in_generate=True,
                output_logits=logprobs,
                **self._generation_kwargs(temperature, top_p, stop),
            )
        generated = out.sequences[:, prompt_len:]  # (B*n, T) rows grouped by prompt: p0 x n, p1 x n, ...
        token_logps = _chosen_logprobs(out.logits, generated) if logprobs else None  # (B*n, T)
        generated = generated.cpu()  # one device sync, not one per row
        rows = [self._completion(generated[r], None if token_logps is None else token_logps[r], stop)
                for r in range(generated.shape[0])]
        if temperature == 0:
            rows = [row for row in rows for _ in range(n)]
        return [rows[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _completion(self, tokens: Tensor, token_logps: Tensor | None, stop: Sequence[str]) -> Completion:
        """Cut one generated row at its end: the first eos (kept) or the token completing a stop string,
        whichever comes first (generate pads finished rows, with eos itself when pad == eos)."""
        ids = tokens.tolist()
        eos_at = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
        end, reason = (len(ids), "length") if eos_at is None else (eos_at + 1, "stop")
        stop_at = self._stop_string_end(ids[:end], stop) if stop else None
        if stop_at is not None and (eos_at is None or stop_at <= eos_at):
            end, reason = stop_at, "stop"
        ids = ids[:end]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if stop_at is not None and end == stop_at:
            text = text[:min(i for i in (text.find(s) for s in stop) if i >= 0)]
        logps = None if token_logps is None else token_logps[:end].tolist()
        return Completion(text=text, token_ids=ids, finish_reason=reason, logprobs=logps)

    def _stop_string_end(self, ids: list[int], stop: Sequence[str]) -> int | None:
        """Length of the shortest prefix whose text contains a stop string (generate stopped the row there)."""
        if not any(s in self.tokenizer.decode(ids, skip_special_tokens=True) for s in stop):
            return None
        for k in range(1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:k], skip_special_tokens=True)
            if any(s in text for s in stop):
                return k
        return None


class _ReservedLayer(DynamicLayer):
    """A prefilled `DynamicLayer` copied n times (rows p0 x n, p1 x n, ...) into buffers that grow by doubling, up
    to its length + `room` positions.

    `update` writes new keys/values into the buffers and returns views of the filled part: `DynamicLayer`
    concatenates the whole cache into new tensors at every decode step, traffic quadratic in the length; here it
    is linear, and memory stays within twice the filled part (no allocation for a room generation never uses).
    Should generate replace `keys` (a batch reorder), `update` falls back to concatenation."""

    def __init__(self, prefilled: DynamicLayer, n: int, *, room: int):
        super().__init__()
        keys, values = prefilled.keys, prefilled.values  # (B, H, L, D)
        rows, heads, length = keys.shape[:3]
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


def _chosen_logprobs(step_logits: tuple[Tensor, ...], generated: Tensor) -> Tensor:
    """log softmax of the raw logits at each step, gathered at the generated token; step by step, so no
    (B*n, T, V) log-prob tensor is built beside the logits generate already holds."""
    columns = [
        torch.log_softmax(logits.float(), dim=-1).gather(1, generated[:, t:t + 1])  # (B*n, 1)
        for t, logits in enumerate(step_logits)
    ]
    return torch.cat(columns, dim=1).cpu()  # (B*n, T)
