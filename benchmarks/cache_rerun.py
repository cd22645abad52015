"""Rerun of an unchanged stage (a Prefect cache hit) vs its first run: flows/sft.py's sft_flow on the demo problems
and the demo-size tiny model, in a temporary workspace under prefect_test_harness; then the same stage run twice through
the CLI on a second workspace (`alignflow run sft`, each a fresh process: start-up, imports and a temporary Prefect
server every time). Prints a markdown table.

    .venv/bin/python benchmarks/cache_rerun.py [--steps 30] [--batch-size 128]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_args import positive_int  # this directory

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=30, help="SFT optimizer steps")
    parser.add_argument("--batch-size", type=positive_int, default=128)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="alignflow-cache-bench-") as tmp:
        from pipeline_lib.workspace import Workspace, apply_environment

        # before prefect is imported: PREFECT_HOME (task results, the cache) lives in the workspace
        workspace = apply_environment(Workspace(Path(tmp) / "ws")).create()
        from prefect.testing.utilities import prefect_test_harness

        from flows.sft import sft_flow
        from pipeline_lib import tracking
        from pipeline_lib.config import SFTConfig
        from pipeline_lib.models import build_tiny_model
        from pipeline_lib.store.db import open_store
        from pipeline_lib.store.ingest import ingest_file

        with open_store(workspace.store_path) as store:
            ingest_file(ROOT / "data" / "demo" / "problems.jsonl", store, source="demo")
            corpus = store.corpus_texts(["demo"])
        model_dir = build_tiny_model(Path(tmp) / "tiny", corpus)
        cfg = SFTConfig(model_path=str(model_dir), source="demo", max_steps=args.steps, batch_size=args.batch_size,
                        lr=1e-3, lr_schedule="constant", device="cpu")

        rows = []
        start = time.perf_counter()
        with prefect_test_harness(server_startup_timeout=60):
            rows.append(("Prefect test harness start-up", time.perf_counter() - start))
            for label in (f"sft_flow, first run ({args.steps} steps)", "sft_flow, rerun (cache hit)"):
                start = time.perf_counter()
                final = Path(sft_flow(cfg))
                rows.append((label, time.perf_counter() - start))
                if len(rows) == 2:
                    stamp = (final / "model.safetensors").stat().st_mtime_ns
        if (final / "model.safetensors").stat().st_mtime_ns != stamp:
            raise SystemExit("the rerun rewrote the model: not a cache hit")
        n_runs = len(tracking.find_runs(workspace, "tags.`alignflow.stage` = 'sft'"))
        if n_runs != 1:
            raise SystemExit(f"{n_runs} MLflow sft runs after the rerun, expected 1 (the rerun retrained)")

        # the user's path: `alignflow run sft` twice on a second workspace, each a fresh process with its own
        # temporary Prefect server; the second finds the first's persisted result (a cross-process cache hit)
        config_file = Path(tmp) / "sft.json"
        config_file.write_text(cfg.model_dump_json())
        cli_workspace = Workspace(Path(tmp) / "ws-cli").create()
        with open_store(cli_workspace.store_path) as store:
            ingest_file(ROOT / "data" / "demo" / "problems.jsonl", store, source="demo")
        # without this process's workspace settings (mlflow exported MLFLOW_TRACKING_URI for the first workspace)
        env = {k: v for k, v in os.environ.items()
               if k not in ("PREFECT_HOME", "ALIGNFLOW_HOME", "PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
        for label in ("first run", "rerun (cache hit)"):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "flows.cli", "-w", str(cli_workspace.root), "run", "sft", "--config",
                            str(config_file)], check=True, cwd=ROOT, env=env, capture_output=True)
            rows.append((f"`alignflow run sft` in a fresh process, {label}", time.perf_counter() - start))
        n_runs = len(tracking.find_runs(cli_workspace, "tags.`alignflow.stage` = 'sft'"))
        if n_runs != 1:
            raise SystemExit(f"{n_runs} MLflow sft runs after the CLI rerun, expected 1 (the rerun retrained)")

    firsts = {"sft_flow": rows[1][1], "`alignflow": rows[3][1]}
    load = os.getloadavg()
    print(f"SFT {args.steps} steps x batch {args.batch_size}, demo tiny model, CPU; load {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}; model file untouched and one MLflow run per workspace after the reruns (checked)\n")
    print("| run | seconds | vs first run |")
    print("|---|---|---|")
    for label, seconds in rows:
        first = next((t for prefix, t in firsts.items() if label.startswith(prefix)), None)
        ratio = f"{seconds / first:.2f}x" if first else "-"
        print(f"| {label} | {seconds:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
