"""DPO on a large pair set for a few steps: the wall time of a whole `train_dpo` run (tokenizing every pair, choosing
the pairs that run packed, the reference log-probs of the pairs the run trains on and of the held-out ones, the steps,
the held-out evaluation before and after) and how many pairs the reference pass covered, for each `--steps`.

    .venv/bin/python benchmarks/dpo_setup.py [--pairs 50000] [--steps 20 2000] [--batch 8] [--threads 1]

The pairs are arithmetic prompts with the sum as chosen and the sum + 1 as rejected, on the tiny offline model
(`build_tiny_model`, a character tokenizer); 1% are held out. Each run starts from an empty output dir (no cached
reference log-probs)."""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from bench_args import positive_int  # this directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=positive_int, default=50_000)
    parser.add_argument("--steps", type=positive_int, nargs="+", default=[20, 2000])
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()

    import polars as pl
    import torch
    from safetensors.torch import load_file

    from pipeline_lib.config import DPOConfig
    from pipeline_lib.models import build_tiny_model
    from pipeline_lib.train.dpo import train_dpo

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    terms = [(rng.randrange(1000), rng.randrange(1000)) for _ in range(args.pairs)]
    pairs = pl.DataFrame({"prompt": [f"{a}+{b}=" for a, b in terms], "chosen": [str(a + b) for a, b in terms],
                          "rejected": [str(a + b + 1) for a, b in terms]})
    print(f"{args.pairs} pairs, batch {args.batch}, {args.threads} thread(s)")
    print("| max_steps | pairs trained on (at most) | reference pairs computed | run s |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        model = build_tiny_model(Path(scratch) / "base", ["0123456789+="])
        for steps in args.steps:
            out = Path(scratch) / f"dpo-{steps}"
            cfg = DPOConfig(policy_path=str(model), max_steps=steps, batch_size=args.batch, eval_fraction=0.01,
                            save_every=10 ** 9, device="cpu")
            started = time.perf_counter()
            train_dpo(cfg, pairs, out)
            seconds = time.perf_counter() - started
            [ref] = (out / "cache" / "ref_logps").glob("*.safetensors")
            computed = int((load_file(str(ref))["logps"].view(-1, 2) != 0).any(dim=1).sum())
            print(f"| {steps} | {min(steps * args.batch, args.pairs)} | {computed} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
