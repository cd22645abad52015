"""Reward-model training step: each response as its own row vs a group's responses packed in one row behind the
tokens they share, and the mix the training loop runs (`pipeline_lib.train.rm.packed_groups`: the groups where
packing saves compute). The layouts give the same scores and gradients (tests/models/test_heads.py); this times them.
Then scoring (`RewardModelScorer`, as Best-of-N and the RL stages call it): `--samples` answers to each of `--groups`
prompts, each answer a response of the data set drawn at random, scored with and without packing.

    .venv/bin/python benchmarks/rm_packing.py [--model demo|large] [--data pairs rankings hh] [--groups 32]
                                              [--samples 8] [--max-length 256] [--repeats 6] [--threads 1]

Data, ingested into a scratch DuckDB store as `alignflow ingest` stores them: `pairs` (data/demo/pairs.jsonl,
Bradley-Terry), `rankings` (data/demo/rankings.jsonl, Plackett-Luce), `hh` (the shipped HH-RLHF harmless-base test
transcripts: a multi-turn prompt shared by two replies). Per data set: how many groups `packed_groups` packs, the
tokens a group holds as rows and all packed (over the timed groups), and the mean time of one forward + backward
over `--groups` groups as rows, all packed and the loop's mix, alternating in one process (each one's first run is a
warm-up, not counted).
The model is the tiny offline one built on the data (a character tokenizer, so a token is about a character)."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_args import positive_int  # this directory
from vs_trl import SIZES  # this directory

ROOT = Path(__file__).resolve().parents[1]
FILES = {"pairs": ROOT / "data" / "demo" / "pairs.jsonl", "rankings": ROOT / "data" / "demo" / "rankings.jsonl",
         "hh": ROOT / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"}


def measure(name: str, args: argparse.Namespace, scratch: Path) -> dict:
    import torch

    from pipeline_lib.models import RewardModel, build_tiny_model, load_tokenizer
    from pipeline_lib.rewards.model import RewardModelScorer
    from pipeline_lib.store.db import open_store
    from pipeline_lib.store.ingest import ingest_file
    from pipeline_lib.train.data import group_width
    from pipeline_lib.train.rm import build_groups, group_scores, packed_groups

    with open_store(scratch / f"{name}.duckdb") as store:
        ingest_file(FILES[name], store, source=name)
        table = "rankings" if name == "rankings" else "preference_pairs"
        data = store.read_selected(table, source=name)
    responses = data["responses"].explode().to_list() if name == "rankings" else (
        data["chosen"].to_list() + data["rejected"].to_list())
    corpus = data["prompt"].to_list() + responses
    model_dir = build_tiny_model(scratch / f"{name}-model", corpus, **SIZES[args.model],
                                 max_position_embeddings=4 * args.max_length)
    tokenizer, cpu = load_tokenizer(model_dir), torch.device("cpu")
    model = RewardModel.from_policy(model_dir, device="cpu").eval()  # train_rm's default: dropout off
    groups = build_groups(tokenizer, data, "plackett_luce" if name == "rankings" else "bradley_terry",
                          max_length=args.max_length)
    chosen = packed_groups(model, groups, pad_id=tokenizer.pad_token_id, device=cpu)
    timed = list(range(min(args.groups, len(groups))))
    layouts = {"rows": (), "all packed": timed, "mix": chosen}
    times: dict[str, list[float]] = {layout: [] for layout in layouts}
    for repeat in range(args.repeats + 1):
        for layout, packed in layouts.items():
            started = time.perf_counter()
            scores, mask = group_scores(model, groups, timed, packed=packed, pad_id=tokenizer.pad_token_id,
                                        device=cpu)
            (scores * mask).sum().backward()
            model.zero_grad(set_to_none=True)
            if repeat:
                times[layout].append(time.perf_counter() - started)
    rows = sum(len(groups.encoded.prompt_ids[r]) for r in groups.rows(timed)) / len(timed)
    width = sum(group_width(groups.encoded, groups.rows([g])) for g in timed) / len(timed)
    rng = random.Random(0)
    samples = [prompt + rng.choice(responses) for prompt in data["prompt"].to_list()[:args.groups]
               for _ in range(args.samples)]
    scorers = {pack: RewardModelScorer(model, tokenizer, max_length=args.max_length, pack=pack)
               for pack in (False, True)}
    scoring: dict[bool, list[float]] = {pack: [] for pack in scorers}
    for repeat in range(args.repeats + 1):
        for pack, scorer in scorers.items():
            started = time.perf_counter()
            scorer(samples)
            if repeat:
                scoring[pack].append(time.perf_counter() - started)
    return {"data": name, "groups": len(groups), "chosen": len(chosen), "rows": rows, "packed_tokens": width,
            **{f"{layout} ms": 1e3 * statistics.mean(values) for layout, values in times.items()},
            "samples": len(set(samples)), "packed_samples": scorers[True].packed_texts // (args.repeats + 1),
            "scoring rows ms": 1e3 * statistics.mean(scoring[False]),
            "scoring packed ms": 1e3 * statistics.mean(scoring[True])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SIZES), default="demo")
    parser.add_argument("--data", nargs="+", choices=sorted(FILES), default=["pairs", "rankings", "hh"])
    parser.add_argument("--groups", type=positive_int, default=32, help="groups in the timed batch")
    parser.add_argument("--samples", type=positive_int, default=8, help="answers scored per prompt")
    parser.add_argument("--max-length", type=positive_int, default=256, help="RMConfig.max_length (its default)")
    parser.add_argument("--repeats", type=positive_int, default=6)
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(f"model {args.model}, max_length {args.max_length}, {args.groups} groups a batch, {args.repeats} runs each, "
          f"{args.threads} thread(s)", file=sys.stderr)
    print("| data | groups | packed by the loop | tokens a group, rows | all packed | step ms, rows | all packed | "
          "the loop's mix | mix/rows |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.data:
            r = measure(name, args, Path(scratch))
            results.append(r)
            print(f"| {r['data']} | {r['groups']} | {r['chosen']} | {r['rows']:.1f} | {r['packed_tokens']:.1f} | "
                  f"{r['rows ms']:.1f} | {r['all packed ms']:.1f} | {r['mix ms']:.1f} | "
                  f"{r['mix ms'] / r['rows ms']:.2f} |", flush=True)
    # the scorer scores each distinct text once (copies drawn twice from the pool tie): those are the texts scored
    print("\n| data | distinct texts scored | scored packed | scoring ms, rows | packed | packed/rows |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['data']} | {r['samples']} | {r['packed_samples']} | {r['scoring rows ms']:.1f} | "
              f"{r['scoring packed ms']:.1f} | {r['scoring packed ms'] / r['scoring rows ms']:.2f} |")


if __name__ == "__main__":
    main()
