"""DPO and GRPO side by side: alignflow's loops vs TRL's DPOTrainer / GRPOTrainer (use_vllm=False) on the same tiny
model, data, hyper-parameters, torch threads and machine; each run in its own subprocess, ours and TRL alternating.

    .venv/bin/python benchmarks/vs_trl.py [--model demo|large] [--algo dpo grpo] [--repeats 2] [--threads 2]
                                          [--data demo|gsm8k] [--pairs mixed|answers] [--steps N --warmup W]
                                          [--set batch=8 ...] [--profile]

Per run: mean step time over the steps after `--warmup` (a step ends at our log call / TRL's on_step_end, so data,
forward, backward, optimizer and logging are all inside it; a GRPO step also holds generation and scoring), the
wall time of the whole algorithm (model load, tokenization, our reference log-prob precompute and held-out evals,
TRL's dataset map, N steps, the final save), and the child's peak RSS (VmHWM; each library's imports are inside
it). fp32, CPU, no gradient checkpointing on either side. The model is random-init: GRPO completions end at a
random EOS or at max_new_tokens, and both sides pad a rollout to its longest.
On a 2-core machine that other processes use, `--threads 1` gives much steadier numbers than the default 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_args import positive_int  # this directory

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"
# TinyModelConfig defaults (the calibrated demo model) and a ~34M-parameter Llama where compute dominates
SIZES = {
    "demo": {},
    "large": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "head_dim": 64, "intermediate_size": 2048},
}
# Hyper-parameters both sides get; demo values are near flows/configs/demo.yaml's (GRPO takes num_iterations 1, where
# the preset has 2: both sides then skip the θ_old pass, which TRL would add), large ones keep a run affordable.
# DPO trains on the first `pairs` pairs of data/demo/pairs.jsonl for about one epoch (ours holds 10% out for its
# evals): over an epoch our one-time reference pass and TRL's per-step reference forwards see the same pairs.
DEFAULTS = {
    ("demo", "dpo"): {"pairs": 1280, "batch": 32, "lr": 1e-4, "beta": 0.1, "max_length": 128, "steps": 36,
                      "warmup": 5},
    ("demo", "grpo"): {"prompts": 32, "group": 8, "max_new_tokens": 6, "lr": 2e-4, "beta": 0.04, "steps": 15,
                       "warmup": 3},
    ("large", "dpo"): {"pairs": 192, "batch": 16, "lr": 1e-5, "beta": 0.1, "max_length": 128, "steps": 10,
                       "warmup": 2},
    ("large", "grpo"): {"prompts": 8, "group": 8, "max_new_tokens": 8, "lr": 1e-5, "beta": 0.04, "steps": 6,
                        "warmup": 1},
}
IMPLS = {"dpo": ("ours", "trl", "trl_precompute"), "grpo": ("ours", "trl")}
LABELS = {
    ("dpo", "ours"): "alignflow train_dpo",
    ("dpo", "trl"): "TRL DPOTrainer (precompute_ref_log_probs=False, the default)",
    ("dpo", "trl_precompute"): "TRL DPOTrainer (precompute_ref_log_probs=True)",
    ("grpo", "ours"): "alignflow train_grpo (hf sampler)",
    ("grpo", "trl"): "TRL GRPOTrainer (use_vllm=False)",
}
# What each TRL run is given besides the shared hyper-parameters (printed with the table)
TRL_SETTINGS = {
    "dpo": "DPOConfig(per_device_train_batch_size=batch, beta, max_length, loss_type=['sigmoid'] (default), "
           "precompute_ref_log_probs=False|True, precompute_ref_batch_size=128, gradient_checkpointing=False, "
           "bf16=False, use_cpu=True, lr_scheduler_type='constant', max_grad_norm=1.0, weight_decay=0); "
           "ours: DPOConfig(batch_size, beta, max_length, lr_schedule='constant', warmup_steps=0, weight_decay=0)",
    "grpo": "GRPOConfig(per_device_train_batch_size=prompts*group, num_generations=group, "
            "max_completion_length=max_new_tokens, beta, epsilon=0.2, loss_type='grpo', scale_rewards='group', "
            "num_iterations=1, temperature=1, top_p=1, top_k=0, use_vllm=False, gradient_checkpointing=False, "
            "bf16=False, use_cpu=True, lr_scheduler_type='constant', max_grad_norm=1.0, weight_decay=0, "
            "use_bias_correction_kl=False (TRL's default True weights the KL by pi/pi_old; DeepSeekMath's, and ours, "
            "does not), log_completions=False); reward: pipeline_lib's verifier; ours: GRPOConfig(prompts_per_step, "
            "group_size, num_iterations=1, clip 0.2, lr_schedule='constant', warmup_steps=0, weight_decay=0, "
            "backend='hf'). Left different (no TRL setting matches; no effect on time): TRL divides advantages by "
            "the group's sample std + 1e-4, ours by its population std + 1e-6",
}


def dpo_pairs(s: dict) -> list[dict]:
    """DPO's pairs: the first `pairs` of data/demo/pairs.jsonl (`mixed`: 41% of them reject with a ~70-character
    non-answer, the other rows are ~9 tokens, so padding a batch to its longest row costs TRL much more than our
    length buckets), or the first `pairs` whose rejection is an answer too (`answers`: every row ~9 tokens)."""
    import polars as pl

    pairs = pl.read_ndjson(DEMO / "pairs.jsonl")
    if s["pairs_kind"] == "answers":
        pairs = pairs.filter(pl.col("rejected_kind") != "non_answer")
    return pairs.select("prompt", "chosen", "rejected").head(s["pairs"]).to_dicts()


def grpo_problems(name: str):
    """GRPO's rollout prompts and answers: the demo's `ab+cd=` train problems (6-token prompts), or the shipped
    GSM8K train questions (~240-character prompts, MIT-licensed) with the number after `####` as the answer."""
    import polars as pl

    if name == "demo":
        return pl.read_ndjson(DEMO / "problems.jsonl").filter(pl.col("split") == "train").select("prompt", "answer")
    rows = pl.read_ndjson(ROOT / "data" / "gsm8k" / "train-first500.jsonl")
    return rows.select(pl.col("question").alias("prompt"),
                       pl.col("answer").str.split("####").list.last().str.strip_chars().alias("answer"))


def _status_mib(field: str) -> float:
    """A size field of /proc/self/status in MiB: VmRSS (now) or VmHWM (this process's peak; not getrusage's
    ru_maxrss, which Linux carries over exec, so a child would report at least its driver's RSS)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:")) / 1024


class StepClock:
    """Timestamps of step ends; optionally profiles the step after `profile_after` (torch.profiler + cProfile)."""

    def __init__(self, profile_after: int | None = None):
        self.ends: list[float] = []
        self.profile_after = profile_after
        self._profilers: tuple | None = None

    def step_end(self) -> None:
        self.ends.append(time.perf_counter())
        if self.profile_after is not None and len(self.ends) == self.profile_after:
            self._start_profile()
        elif self._profilers is not None:
            self._stop_profile()

    def log(self, metrics, step: int) -> None:
        """Our loops' LogFn: train-step logs carry train/lr, the held-out eval logs do not."""
        if "train/lr" in metrics:
            self.step_end()

    def _start_profile(self) -> None:
        import cProfile

        import torch

        torch_prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        py_prof = cProfile.Profile()
        torch_prof.start()
        py_prof.enable()
        self._profilers = (torch_prof, py_prof)

    def _stop_profile(self) -> None:
        import io
        import pstats

        torch_prof, py_prof = self._profilers
        py_prof.disable()
        torch_prof.stop()
        self._profilers = None
        print(f"--- profile of one step ({self.ends[-1] - self.ends[-2]:.3f} s)", flush=True)
        print(torch_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
        text = io.StringIO()
        pstats.Stats(py_prof, stream=text).sort_stats("cumulative").print_stats(28)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000], flush=True)


# ---- workers: one algorithm, one implementation, in this process


def _ours_dpo(model_dir: str, s: dict, out_dir: Path, clock: StepClock) -> None:
    import polars as pl

    from pipeline_lib.config import DPOConfig
    from pipeline_lib.train.dpo import train_dpo

    pairs = pl.DataFrame(dpo_pairs(s))
    cfg = DPOConfig(policy_path=model_dir, max_steps=s["steps"], batch_size=s["batch"], lr=s["lr"], beta=s["beta"],
                    max_length=s["max_length"], lr_schedule="constant", warmup_steps=0, weight_decay=0.0,
                    max_grad_norm=1.0, log_every=1, save_every=s["steps"], device="cpu")
    train_dpo(cfg, pairs, out_dir, log=clock.log)


def _ours_grpo(model_dir: str, s: dict, out_dir: Path, clock: StepClock) -> None:
    from pipeline_lib.config import GRPOConfig
    from pipeline_lib.train.grpo import train_grpo

    problems = grpo_problems(s["data"])
    cfg = GRPOConfig(policy_path=model_dir, max_steps=s["steps"], prompts_per_step=s["prompts"],
                     group_size=s["group"], num_iterations=1, lr=s["lr"], beta=s["beta"], clip_eps_low=0.2,
                     clip_eps_high=0.2, max_new_tokens=s["max_new_tokens"], temperature=1.0, top_p=1.0,
                     lr_schedule="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, backend="hf",
                     log_every=1, save_every=s["steps"], device="cpu")
    train_grpo(cfg, problems, out_dir, log=clock.log)


def _trl_common(s: dict, out_dir: Path) -> dict:
    """TrainingArguments both TRL trainers get: what our loops do (fp32, CPU, constant lr, AdamW, clip 1.0)."""
    return dict(output_dir=str(out_dir), learning_rate=s["lr"], max_steps=s["steps"], lr_scheduler_type="constant",
                warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, gradient_checkpointing=False, bf16=False,
                use_cpu=True, report_to="none", save_strategy="no", logging_steps=s["steps"], disable_tqdm=True,
                dataloader_num_workers=0, seed=0)


def _trl_callback(clock: StepClock):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.step_end()

    return Clock()


def _trl_dpo(model_dir: str, s: dict, out_dir: Path, clock: StepClock, precompute: bool) -> None:
    import polars as pl
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    rows = dpo_pairs(s)
    args = DPOConfig(per_device_train_batch_size=s["batch"], beta=s["beta"], max_length=s["max_length"],
                     precompute_ref_log_probs=precompute, precompute_ref_batch_size=128, **_trl_common(s, out_dir))
    trainer = DPOTrainer(model=model_dir, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[_trl_callback(clock)])
    trainer.train()
    trainer.save_model(str(out_dir / "final"))


def _trl_grpo(model_dir: str, s: dict, out_dir: Path, clock: StepClock) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from pipeline_lib.rewards.registry import REWARDS

    def verifier(prompts, completions, answer, completion_ids, **_):
        return REWARDS["verifier"](prompts, completions, answers=answer, lengths=[len(c) for c in completion_ids])

    problems = grpo_problems(s["data"])
    args = GRPOConfig(per_device_train_batch_size=s["prompts"] * s["group"], num_generations=s["group"],
                      max_completion_length=s["max_new_tokens"], beta=s["beta"], epsilon=0.2, loss_type="grpo",
                      scale_rewards="group", num_iterations=1, temperature=1.0, top_p=1.0, top_k=0, use_vllm=False,
                      use_bias_correction_kl=False, log_completions=False, **_trl_common(s, out_dir))
    trainer = GRPOTrainer(model=model_dir, reward_funcs=verifier, args=args,
                          train_dataset=Dataset.from_dict(problems.select("prompt", "answer").to_dict(as_series=False)),
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[_trl_callback(clock)])
    trainer.train()
    trainer.save_model(str(out_dir / "final"))


def worker(args: argparse.Namespace) -> None:
    """Run one (algo, impl) and print one `RESULT {json}` line."""
    import torch

    torch.set_num_threads(args.threads)
    settings, algo = json.loads(args.settings), args.algo[0]
    clock = StepClock(profile_after=settings["warmup"] + 1 if args.profile else None)
    # each side's algorithm modules are imported before the clock starts (seconds of transformers modeling code)
    if args.impl == "ours":
        import pipeline_lib.train.dpo  # noqa: F401
        import pipeline_lib.train.grpo  # noqa: F401

        run = {"dpo": _ours_dpo, "grpo": _ours_grpo}[algo]
    else:
        from trl import DPOTrainer, GRPOTrainer  # noqa: F401  (trl imports its trainers lazily)

        run = {"dpo": lambda *a: _trl_dpo(*a, precompute=args.impl == "trl_precompute"), "grpo": _trl_grpo}[algo]
    rss_start = _status_mib("VmRSS")
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        start = time.perf_counter()
        run(args.model_dir, settings, Path(tmp) / "out", clock)
        wall = time.perf_counter() - start
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])]  # steps 2..N
    if len(clock.ends) != settings["steps"]:
        raise SystemExit(f"{args.impl} {algo}: {len(clock.ends)} step ends seen, expected {settings['steps']}")
    steady = steps[settings["warmup"]:]
    print("RESULT " + json.dumps({
        "step_s": statistics.mean(steady), "steps_s": steady, "first_step_end_s": clock.ends[0] - start,
        "wall_s": wall, "peak_rss_mib": _status_mib("VmHWM"),
        "rss_start_mib": rss_start,
    }), flush=True)


# ---- driver


def build_model(out_dir: Path, size: str, data: str) -> tuple[str, int]:
    """The tiny Llama of `size` with a character-level tokenizer over every demo text (and the GSM8K problems
    with `data` gsm8k, whose prompts need 1,024 positions)."""
    import polars as pl
    from safetensors import safe_open

    from pipeline_lib.models import build_tiny_model

    pairs = pl.read_ndjson(DEMO / "pairs.jsonl")
    problems = pl.read_ndjson(DEMO / "problems.jsonl")
    rankings = pl.read_ndjson(DEMO / "rankings.jsonl")
    corpus = (pairs["prompt"].to_list() + pairs["chosen"].to_list() + pairs["rejected"].to_list()
              + problems["prompt"].to_list() + problems["answer"].cast(pl.Utf8).to_list()
              + rankings["prompt"].to_list() + rankings["responses"].explode().to_list())
    positions = {}
    if data == "gsm8k":
        gsm8k = grpo_problems("gsm8k")
        corpus += gsm8k["prompt"].to_list() + gsm8k["answer"].to_list()
        positions = {"max_position_embeddings": 1024}
    path = build_tiny_model(out_dir, corpus, **SIZES[size], **positions)
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        n_params = sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())
    return str(path), n_params


def run_child(args: argparse.Namespace, algo: str, impl: str, model_dir: str, settings: dict) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--algo", algo, "--impl", impl, "--model-dir", model_dir,
           "--settings", json.dumps(settings), "--threads", str(args.threads)] + (["--profile"] if args.profile else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{impl} {algo} failed:\n{proc.stderr[-3000:]}")
    if args.profile:
        print(f"\n## profile: {LABELS[(algo, impl)]}\n")
        print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("RESULT ")))
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def summarize(algo: str, results: dict[str, list[dict]]) -> list[str]:
    ours_step = statistics.mean(r["step_s"] for r in results["ours"])
    ours_rss = max(r["peak_rss_mib"] for r in results["ours"])
    rows = []
    for impl, runs in results.items():
        means = [r["step_s"] for r in runs]
        step = statistics.mean(means)
        rss = max(r["peak_rss_mib"] for r in runs)
        ratio = "1.00" if impl == "ours" else f"ours {ours_step / step:.2f}x"
        rss_ratio = "-" if impl == "ours" else f"ours {ours_rss / rss:.2f}x"
        rows.append(f"| {algo.upper()} | {LABELS[(algo, impl)]} | {step * 1000:.1f} ({min(means) * 1000:.1f}-"
                    f"{max(means) * 1000:.1f}) | {ratio} | {statistics.mean(r['first_step_end_s'] for r in runs):.2f}"
                    f" | {statistics.mean(r['wall_s'] for r in runs):.2f} | {rss:.0f} | {rss_ratio} | "
                    f"{statistics.mean(r['rss_start_mib'] for r in runs):.0f} |")
    return rows


def algo_settings(args: argparse.Namespace, algo: str, overrides: dict[str, str]) -> dict:
    """DEFAULTS of the model and algorithm, with --steps, --warmup and the --set values that apply to it (a key of
    the other algorithm applies there); a value of the wrong type, or no step left to time, exits in one line."""
    settings = dict(DEFAULTS[(args.model, algo)]) | ({"data": args.data} if algo == "grpo" else
                                                     {"pairs_kind": args.pairs})
    settings.update({k: v for k, v in (("steps", args.steps), ("warmup", args.warmup)) if v is not None})
    for key, value in overrides.items():
        if key in settings:
            try:
                settings[key] = type(settings[key])(value)
            except ValueError:
                kind = {int: "an integer", float: "a number"}[type(settings[key])]
                raise SystemExit(f"--set {key}={value}: expected {kind}") from None
    if not 0 <= settings["warmup"] < settings["steps"] - 1:
        raise SystemExit(f"{algo}: warmup {settings['warmup']} with {settings['steps']} steps: expected 0 <= warmup "
                         "< steps - 1 (step 1 starts no interval; the steps after it and the warm-up are timed)")
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SIZES), default="demo")
    parser.add_argument("--algo", nargs="+", choices=sorted(IMPLS), default=["dpo", "grpo"])
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs of each implementation, alternating")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads in every run")
    parser.add_argument("--data", choices=["demo", "gsm8k"], default="demo",
                        help="GRPO's prompts: demo `ab+cd=` problems (6 tokens) or GSM8K questions (~240)")
    parser.add_argument("--pairs", choices=["mixed", "answers"], default="mixed",
                        help="DPO's pairs: the demo's first ones (41%% long non-answer rejections) or only those "
                             "rejecting with an answer (every row ~9 tokens)")
    parser.add_argument("--steps", type=positive_int, help="optimizer steps per run (default: per model and algorithm)")
    parser.add_argument("--warmup", type=int, help="steps left out of the step-time mean")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override a hyper-parameter of DEFAULTS for both sides, e.g. --set batch=8 pairs=64")
    parser.add_argument("--no-trl-precompute", action="store_true", help="skip the TRL precompute_ref_log_probs row")
    parser.add_argument("--profile", action="store_true", help="one run each, printing the profile of one step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import torch
    import trl

    repeats = 1 if args.profile else args.repeats
    overrides = dict(item.partition("=")[::2] for item in args.set)
    known = {key for (size, _), values in DEFAULTS.items() if size == args.model for key in values}
    if set(overrides) - known:
        raise SystemExit(f"--set: unknown key(s) {sorted(set(overrides) - known)}; expected some of {sorted(known)}")
    every_settings = {algo: algo_settings(args, algo, overrides) for algo in args.algo}  # bad values fail first
    print(f"uptime at start: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} "
          f"(1/5/15 min load), nproc {os.cpu_count()}, torch {torch.__version__}, trl {trl.__version__}, "
          f"threads {args.threads}, {time.strftime('%Y-%m-%d %H:%M')}")
    with tempfile.TemporaryDirectory(prefix="vs-trl-model-") as tmp:
        model_dir, n_params = build_model(Path(tmp) / "model", args.model, args.data)
        print(f"model {args.model}: {n_params:,} parameters, {SIZES[args.model] or 'TinyModelConfig defaults'}")
        lines = []
        for algo, settings in every_settings.items():
            print(f"{algo}: {settings}, {repeats} run(s) each\n  TRL: {TRL_SETTINGS[algo]}", flush=True)
            impls = [i for i in IMPLS[algo] if not (args.no_trl_precompute and i == "trl_precompute")]
            results: dict[str, list[dict]] = {impl: [] for impl in impls}
            for _ in range(repeats):
                for impl in impls:  # ours, trl, ours, trl, ...: load drifts hit both sides alike
                    results[impl].append(run_child(args, algo, impl, model_dir, settings))
                    print(f"  {impl}: {results[impl][-1]['step_s'] * 1000:.1f} ms/step", flush=True)
            lines += summarize(algo, results)
    print(f"uptime at end: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}\n")
    if args.profile:
        print("--profile: the step times below include the profiled step and the profiler's overhead; they are not "
              "a measurement (run without --profile for that)\n")
    print("| algo | implementation | step ms, mean (range of runs) | step time ours/TRL | setup + step 1 s "
          "| wall s, all steps | peak RSS MiB | peak RSS ours/TRL | RSS after imports MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
