"""Time and peak memory of per-token log-probs on CPU: chunked `sequence_logprobs` vs the naive full log-softmax.

Prints a markdown table. With `--group G` the rows come in groups of G that share their prompt (GRPO's G
samples), and a third method, `shared`, runs each distinct prompt once (`shared_prompt_logprobs`, what GRPO's
passes use); all methods compute the same log-probs (the Σ column). Each (method, mode) runs in its own subprocess;
memory is the peak RSS (getrusage ru_maxrss) minus the RSS just before the first measured call, so model and input
setup are not counted.
    .venv/bin/python benchmarks/logprobs.py [--batch 8 --seq-len 512 --vocab 32768 --hidden 256 --group 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from bench_args import positive_int  # this directory

METHODS = ("chunked", "naive", "shared")
MODES = ("no_grad", "grad")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(args: argparse.Namespace) -> None:
    """Build a random Llama, run one method `repeats` times, print one JSON line of measurements."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline_lib.models.logprobs import position_ids_from_mask, sequence_logprobs, shared_prompt_logprobs

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
        head_dim=64, max_position_embeddings=args.seq_len, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    batch, seq_len, group = args.batch, args.seq_len, args.group
    prompt_len = int(seq_len * (1 - args.completion_frac))
    ids = torch.randint(0, args.vocab, (batch, seq_len))
    ids[:, :prompt_len] = ids[::group, :prompt_len].repeat_interleave(group, dim=0)  # a group shares its prompt
    attention = torch.ones_like(ids)
    for row in range(batch):  # left padding: the rows of group g have g * 8 pad tokens (mod the prompt length)
        attention[row, : row // group * 8 % prompt_len] = 0
    completion = attention.clone()
    completion[:, :prompt_len] = 0

    def naive() -> torch.Tensor:
        logits = model(ids, attention_mask=attention, position_ids=position_ids_from_mask(attention)).logits
        logp_all = logits.float().log_softmax(-1)  # (B, T, V): the tensor the chunked version avoids
        taken = logp_all[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, T-1)
        return torch.nn.functional.pad(taken, (1, 0)) * completion

    def chunked() -> torch.Tensor:
        return sequence_logprobs(model, ids, attention, completion, chunk_size=args.chunk_size)

    def shared() -> torch.Tensor:
        prompt_index = torch.arange(batch // group).repeat_interleave(group)
        logps = shared_prompt_logprobs(model, ids[::group, :prompt_len], attention[::group, :prompt_len], prompt_index,
                                       ids[:, prompt_len:], completion[:, prompt_len:], chunk_size=args.chunk_size)
        return torch.nn.functional.pad(logps, (prompt_len, 0))  # (B, T) like the others

    run = {"naive": naive, "chunked": chunked, "shared": shared}[args.method]
    grad = args.mode == "grad"
    times, checksum = [], 0.0
    rss_before = _rss_bytes()
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with torch.set_grad_enabled(grad):
            logps = run()
            if grad:
                logps.sum().backward()
        times.append(time.perf_counter() - start)
        checksum = float(logps.detach().sum())
        del logps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({"seconds": statistics.median(times), "peak_mib": (peak - rss_before) / 2**20,
                      "checksum": checksum}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--seq-len", type=positive_int, default=512)
    parser.add_argument("--vocab", type=positive_int, default=32768)
    parser.add_argument("--hidden", type=positive_int, default=256)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--chunk-size", type=positive_int, default=64)
    parser.add_argument("--completion-frac", type=float, default=0.5, help="share of each row that is completion")
    parser.add_argument("--group", type=positive_int, default=1,
                        help="rows per shared prompt (the shared method needs > 1)")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads; 1 is steadier on a shared 2-core box")
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch % args.group or not 1 <= int(args.seq_len * (1 - args.completion_frac)) < args.seq_len:
        parser.error("--group must divide --batch, and --completion-frac leave every row a prompt and a completion")
    if args.hidden % 64:
        parser.error(f"--hidden {args.hidden}: expected a multiple of 64 (the model's heads are 64 wide)")
    if args.method:
        _worker(args)
        return

    print(f"B={args.batch} T={args.seq_len} V={args.vocab} hidden={args.hidden} layers={args.layers} "
          f"chunk={args.chunk_size} completion_frac={args.completion_frac} group={args.group} repeats={args.repeats} "
          f"threads={args.threads} (CPU, fp32)\n")
    print("| method | mode | median time (s) | peak extra RSS (MiB) | Σ log-probs |")
    print("|---|---|---|---|---|")
    methods = METHODS if args.group > 1 else tuple(m for m in METHODS if m != "shared")
    for mode in MODES:
        for method in methods:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--method", method, "--mode", mode]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            print(f"| {method} | {mode} | {result['seconds']:.3f} | {result['peak_mib']:.0f} | "
                  f"{result['checksum']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
