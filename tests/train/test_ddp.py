"""Multi-process DPO: `torchrun --standalone --nproc_per_node 2 -m pipeline_lib.train.dpo --config X.json` on
gloo runs, the ranks stay in sync (the loop checks it; the result matches one process on the same global
batch), only rank 0 prints and writes (rank 1's file-system calls are recorded with an audit hook), a
write that fails on rank 0 ends every rank with one error line, and a SIGKILL of torchrun ends its ranks too
(even a worker still importing), so the rerun resumes to the uninterrupted weights."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import polars as pl
import pytest
from safetensors.torch import load_file

from pipeline_lib.config import DPOConfig, GRPOConfig, RMConfig
from pipeline_lib.models import build_tiny_model
from pipeline_lib.train.data import write_run_file

ROOT = Path(__file__).resolve().parents[2]

# Loaded by every Python process started with this dir on PYTHONPATH; under torchrun it records each
# file-system write (open for writing, mkdir, rename, remove) under $AUDIT_DIR into $AUDIT_LOG.<rank>.
SITECUSTOMIZE = '''
import os, sys
if os.environ.get("RANK") is not None and os.environ.get("AUDIT_DIR"):
    _watched, _record = os.environ["AUDIT_DIR"], os.environ["AUDIT_LOG"] + "." + os.environ["RANK"]
    _writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def _hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _writes)
        elif event in ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "shutil.move"):
            path, writing = args[0], True
        else:
            return
        if writing and isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(path).startswith(_watched):
            with open(_record, "a") as handle:
                handle.write(f"{event} {os.fsdecode(path)}\\n")

    sys.addaudithook(_hook)
if os.environ.get("RANK") == "0" and os.environ.get("FAIL_RANK_0_SAVE"):  # a full disk, on rank 0 only
    import errno, io, torch
    _real_save = torch.save

    def _full_disk(obj, f, *args, **kwargs):
        if isinstance(f, io.BytesIO):  # pickling a tensor in memory (all_gather_object's RNG states) needs no disk
            return _real_save(obj, f, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    torch.save = _full_disk
'''


def toy_pairs(n: int, digits: int = 2) -> pl.DataFrame:
    """n sums of two numbers below 50; with `digits` > 2 the first has 1 to `digits` digits (rows of other lengths)."""
    rng = random.Random(0)
    rows = [(rng.randrange(50) if digits == 2 else rng.randrange(10 ** rng.randrange(1, digits + 1)), rng.randrange(50))
            for _ in range(n)]
    return pl.DataFrame({"prompt": [f"{a:02d}+{b:02d}=" for a, b in rows], "chosen": [str(a + b) for a, b in rows],
                         "rejected": [str(a + b + 1) if i % 2 else "no idea!" for i, (a, b) in enumerate(rows)]})


def tiny_dpo_model(tmp_path: Path) -> Path:
    return build_tiny_model(tmp_path / "base", ["0123456789+=", "no idea!"], hidden_size=64, num_heads=2,
                            intermediate_size=128)


def torchrun_dpo(tmp_path: Path, run_file: Path, timeout: float, module: str = "pipeline_lib.train.dpo",
                 **env_vars: str) -> tuple[subprocess.Popen, str]:
    """`torchrun --nproc_per_node 2 -m <module>` (DPO unless told) on `run_file`, with SITECUSTOMIZE loaded in every
    process; per-rank logs under tmp_path/logs. (process, output) once it ended; killed and raised on a timeout."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", **env_vars}
    # own session: on a timeout the whole torchrun group (agent + workers) is killed, no orphans left
    ddp = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--log-dir", str(tmp_path / "logs"), "--redirects", "3",
         "-m", module, "--config", str(run_file)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = ddp.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(ddp.pid, signal.SIGKILL)
        raise AssertionError(f"torchrun did not end within {timeout} s: a rank was left waiting") from None
    return ddp, output


@pytest.mark.slow
def test_torchrun_two_ranks_match_one_process_and_only_rank_0_writes(tmp_path):
    model = tiny_dpo_model(tmp_path)
    cfg = DPOConfig(policy_path=str(model), max_steps=6, batch_size=8, grad_accum_steps=2, lr=1e-3, save_every=2,
                    log_every=1, device="cpu")
    frames = {"pairs": toy_pairs(40)}
    ddp_file = write_run_file(tmp_path / "ddp.json", cfg, frames, tmp_path / "ddp")
    single_file = write_run_file(tmp_path / "single.json", cfg, frames, tmp_path / "single")
    ddp, output = torchrun_dpo(tmp_path, ddp_file, 300, AUDIT_DIR=str(tmp_path / "ddp"),
                               AUDIT_LOG=str(tmp_path / "writes"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    logs = {int(p.parent.name): p.read_text() for p in (tmp_path / "logs").rglob("stdout.log")}
    assert ddp.returncode == 0, output + "".join(logs.values())
    single = subprocess.run([sys.executable, "-m", "pipeline_lib.train.dpo", "--config", str(single_file)],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stdout + single.stderr

    # only rank 0 reports and writes; rank 1 touched nothing under the output dir
    assert "step 6 | " in logs[0] and "final model:" in logs[0]
    assert "step " not in logs[1]
    rank0_writes = (tmp_path / "writes.0").read_text()
    assert "os.mkdir" in rank0_writes and "final" in rank0_writes  # the hook sees rank 0's saves...
    assert not (tmp_path / "writes.1").exists()  # ...and none from rank 1
    assert (tmp_path / "ddp" / "final" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == ["cache", "final"]
    metrics = json.loads((tmp_path / "ddp" / "final" / "alignflow_final.json").read_text())["metrics"]
    assert metrics["eval/pref_accuracy_start"] == json.loads(
        (tmp_path / "single" / "final" / "alignflow_final.json").read_text())["metrics"]["eval/pref_accuracy_start"]

    # two ranks x 2 micro-batches of 2 pairs = one process x 2 micro-batches of 4 pairs: the same update
    a = load_file(str(tmp_path / "ddp" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "single" / "final" / "model.safetensors"))
    start = load_file(str(model / "model.safetensors"))
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-3  # it trained
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


@pytest.mark.slow
def test_torchrun_reward_model_on_packed_rankings_matches_one_process(tmp_path):
    """Rankings packed a ranking per row (the shared prompt once) go through DDP's forward: two ranks train the
    weights one process does."""
    model = tiny_dpo_model(tmp_path)
    cfg = RMConfig(model_path=str(model), loss="plackett_luce", pooling="mean", max_steps=4, batch_size=8,
                   grad_accum_steps=2, lr=1e-3, device="cpu")
    rankings = pl.DataFrame({"prompt": [f"{i:02d}+01=" for i in range(40)],
                             "responses": [[str(i + 1), str(i + 2), "no idea!"][: 2 + i % 2] for i in range(40)]})
    ddp_file = write_run_file(tmp_path / "ddp.json", cfg, {"data": rankings}, tmp_path / "ddp")
    single_file = write_run_file(tmp_path / "single.json", cfg, {"data": rankings}, tmp_path / "single")
    ddp, output = torchrun_dpo(tmp_path, ddp_file, 300, module="pipeline_lib.train.rm")
    logs = "".join(p.read_text() for p in (tmp_path / "logs").rglob("*.log"))
    assert ddp.returncode == 0, output + logs
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    single = subprocess.run([sys.executable, "-m", "pipeline_lib.train.rm", "--config", str(single_file)],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stdout + single.stderr
    a = load_file(str(tmp_path / "ddp" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "single" / "final" / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    for run in ("ddp", "single"):  # every ranking ran packed
        assert json.loads((tmp_path / run / "final" / "alignflow_final.json").read_text())["metrics"][
            "train/packed_groups"] == 40


@pytest.mark.slow
def test_a_checkpoint_write_failing_on_rank_0_ends_every_rank_with_one_error_line(tmp_path):
    """Rank 0 alone writes checkpoints: when its write fails (a full disk) it stops with the one-line
    CheckpointWriteError while rank 1 goes on to its next collective. torchrun then ends rank 1 too; nothing waits
    for good, and no `final` is written."""
    cfg = DPOConfig(policy_path=str(tiny_dpo_model(tmp_path)), max_steps=6, batch_size=8, lr=1e-3, save_every=2,
                    log_every=1, device="cpu")
    run_file = write_run_file(tmp_path / "ddp.json", cfg, {"pairs": toy_pairs(40)}, tmp_path / "ddp")
    ddp, _ = torchrun_dpo(tmp_path, run_file, 180, FAIL_RANK_0_SAVE="1")
    assert ddp.returncode != 0
    errors = {int(p.parent.name): [line for line in p.read_text().splitlines() if line.startswith("error: ")]
              for p in (tmp_path / "logs").rglob("stderr.log")}
    assert len(errors[0]) == 1 and "cannot write the step 2 checkpoint (" in errors[0][0], errors
    assert not (tmp_path / "ddp" / "final").exists()
    # every process of the run's session is gone
    group = subprocess.run(["pgrep", "-g", str(ddp.pid)], capture_output=True, text=True)
    assert group.stdout.strip() == "", group.stdout


@pytest.mark.slow  # one torchrun start: ~10 s
def test_a_cpu_stage_on_a_gpu_machine_trains_on_gloo_without_device_ids(tmp_path):
    """`device: cpu, processes: 2` on a machine with GPUs: the process group was NCCL, and DDP got device_ids [local
    rank], whenever CUDA was available, whatever the stage's device (NCCL reduces no CPU tensor; DDP refuses a CPU
    module with device ids). torch.cuda.is_available is patched to answer as a GPU machine's does."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        torch.cuda.is_available = lambda: True  # a GPU machine
        from pipeline_lib.train.common import init_distributed, wrap_model
        ctx = init_distributed("cpu")
        model = wrap_model(torch.nn.Linear(4, 4), ctx)
        model(torch.ones(2, 4)).sum().backward()  # DDP's gradient all-reduce
        print(f"rank {ctx.rank} of {ctx.world_size}: {dist.get_backend()}\\n", end="", flush=True)  # one write a line
        # both ranks done, each leaves without the interpreter's teardown: there, with CUDA patched in, a rank aborted
        # now and then after printing ("terminate called without an active exception"; 2 of 8 runs, and in CI)
        dist.barrier()
        os._exit(0)
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(re.findall(r"rank \d of 2: \w+", done.stdout)) == ["rank 0 of 2: gloo", "rank 1 of 2: gloo"]


@pytest.mark.slow  # three torchrun runs per case: ~30 s on 2 cores
@pytest.mark.parametrize("ranks", ["1", "2"])
def test_sigkilled_torchrun_takes_its_ranks_along_and_the_rerun_resumes_to_the_uninterrupted_weights(ranks, tmp_path):
    """torchrun starts its workers in sessions of their own: a SIGKILL of torchrun's process group left them
    training on as orphans, and the rerun raced them in the same out_dir (its checkpoint write failed on a temp
    dir they had replaced). Now the workers die with torchrun, and the rerun resumes from the last checkpoint to
    the weights of an uninterrupted run. With dropout on: each rank draws its own masks (rows of other lengths), and
    the checkpoint held rank 0's RNG states alone, which every rank restored (1e-3 off the uninterrupted weights)."""
    model = tiny_dpo_model(tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.1}))
    cfg = DPOConfig(policy_path=str(model), max_steps=150, batch_size=8, lr=1e-3, save_every=2, log_every=1,
                    device="cpu", disable_dropout=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def torchrun(name: str) -> tuple[Path, subprocess.Popen]:
        # prompts of 1 to 7 digits: the ranks' rows differ in length, so they draw different numbers of dropout masks
        pairs = toy_pairs(40, digits=7) if ranks == "2" else toy_pairs(40)
        run_file = write_run_file(tmp_path / f"{name}.json", cfg, {"pairs": pairs}, tmp_path / name)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", ranks,
                   "-m", "pipeline_lib.train.dpo", "--config", str(run_file)]
        return run_file, subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True)

    run_file, victim = torchrun("killed")
    state = tmp_path / "killed" / "checkpoint" / "trainer_state.json"
    deadline = time.monotonic() + 300
    while not state.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    deadline = time.monotonic() + 1
    while (workers := subprocess.run(["pgrep", "-f", str(run_file)], capture_output=True, text=True).stdout.split()) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in workers:  # orphans left by a failing run: not left training after the test
        os.kill(int(pid), signal.SIGKILL)
    assert not workers, "workers outlived the torchrun that was killed"
    assert not (tmp_path / "killed" / "final").exists()

    runs = {name: torchrun(name)[1] for name in ("killed", "full")}  # the rerun, and an uninterrupted run
    outputs = {name: run.communicate(timeout=300)[0] for name, run in runs.items()}
    assert all(run.returncode == 0 for run in runs.values()), outputs
    steps = [int(line.split()[1]) for line in outputs["killed"].splitlines() if line.startswith("step ")]
    assert steps[0] > cfg.save_every and steps[-1] == cfg.max_steps, "the rerun did not start from a checkpoint"
    a = load_file(str(tmp_path / "full" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "final" / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


@pytest.mark.slow  # one torchrun start, killed while its worker imports: ~10 s
def test_a_worker_whose_torchrun_died_while_it_imported_kills_itself_before_training(tmp_path):
    """The death signal asked for in run_main cannot fire for a parent that is already gone: a GRPO worker (one
    process, no rendezvous with the agent that would fail) still importing torch when torchrun was killed trained
    on as an orphan. It now sees its parent changed since `pipeline_lib.train` was imported, and dies at once."""
    problems = pl.read_ndjson(ROOT / "data" / "demo" / "problems.jsonl").head(64)
    cfg = GRPOConfig(policy_path=str(tiny_dpo_model(tmp_path)), max_steps=30, prompts_per_step=4, group_size=4,
                     max_new_tokens=6, save_every=1, device="cpu")
    run_file = write_run_file(tmp_path / "run.json", cfg, {"problems": problems}, tmp_path / "out")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               "-m", "pipeline_lib.train.grpo", "--config", str(run_file)]
    agent = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)

    def worker_importing() -> int | None:
        """The worker's pid once it has mapped libtorch: past `pipeline_lib.train`, not yet in run_main."""
        children = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
        for pid in children:
            try:
                if "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text():
                    return int(pid)
            except OSError:
                pass
        return None

    deadline = time.monotonic() + 120
    while (worker := worker_importing()) is None and agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert worker is not None, "no worker importing torch appeared"
    os.killpg(agent.pid, signal.SIGKILL)  # the agent's group; the worker runs in a session of its own
    agent.wait()
    assert not (tmp_path / "out").exists(), "killed too late: the worker had started training"
    deadline = time.monotonic() + 60
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    orphaned = Path(f"/proc/{worker}").exists()
    if orphaned:
        os.kill(worker, signal.SIGKILL)  # not left training after the test
    assert not orphaned, "the worker outlived the torchrun that was killed"
    assert not (tmp_path / "out").exists(), "the orphaned worker trained"
