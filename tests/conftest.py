"""Shared fixtures: offline settings, a fresh workspace per test, torch kept to the machine's cores, model classes
and dirs that stand in for unusual checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from pipeline_lib.workspace import OFFLINE_ENV

for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)
# before any CUDA test's first matmul (cuBLAS reads it once): the `gpu` determinism tests run in this process after them
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402

from pipeline_lib.workspace import Workspace  # noqa: E402


@pytest.fixture
def workspace(tmp_path) -> Workspace:
    """An empty workspace under the test's tmp dir."""
    return Workspace(tmp_path / "ws").create()


@pytest.fixture
def lock_holder():
    """`proc = lock_holder(workspace, holder)`: another process that takes the workspace's run lock as `holder`,
    says so, and holds it until killed (at teardown at the latest)."""
    root = Path(__file__).resolve().parents[1]
    started: list[subprocess.Popen] = []

    def hold(workspace: Workspace, holder: str) -> subprocess.Popen:
        code = textwrap.dedent(f"""
            import time
            from pathlib import Path
            from pipeline_lib.workspace import Workspace, workspace_lock
            with workspace_lock(Workspace(Path({str(workspace.root)!r})), {holder!r}):
                print("locked", flush=True)
                time.sleep(600)
        """)
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(root)})
        started.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield hold
    for proc in started:
        proc.kill()
        proc.wait()
        proc.stdout.close()


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """This process's environment for a child `alignflow`, without the MLFLOW_TRACKING_URI that mlflow
    exported for an earlier test's workspace (the child would take it for the user's server)."""
    return {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}


@pytest.fixture
def answering_server():
    """`answering_server(status)`: the port of a local HTTP server answering every GET with `status` (another
    server holding a port, one answering errors), shut down after the test."""
    import http.server
    import threading

    servers = []

    def start(status: int) -> int:
        class Answer(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):
                pass

        server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly without CUDA."""
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def dropping():
    """`dropping(base, "position_ids")`: a transformers-looking subclass of a transformers model class whose forward
    drops that argument. Without `position_ids` it reads column distances (as ALiBi's biases do), without
    `attention_mask` every text of a row reads the others: either is wrong on packed rows whose later texts sit
    behind the earlier ones, which the packing checks must notice. Named `_DropsPositions` / `_DropsMask`."""

    def make(base: type, argument: str) -> type:
        def forward(self, *args, **kwargs):
            kwargs.pop(argument, None)
            return base.forward(self, *args, **kwargs)

        name = {"position_ids": "_DropsPositions", "attention_mask": "_DropsMask"}[argument]
        return type(name, (base,), {"forward": forward, "__module__": base.__module__})

    return make


REMOTE_CODE = """
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel, PreTrainedTokenizerFast

Path({marker!r}).touch()


class CustomConfig(LlamaConfig):
    model_type = "alignflow_custom_llama"


class CustomModel(LlamaModel):
    config_class = CustomConfig


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig


class CustomTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture(scope="session")
def remote_code_copy():
    """`remote_code_dir, marker = remote_code_copy(model_dir, out)`: a copy of a tiny Llama dir (a policy, or a reward
    or value model on one) whose config and tokenizer load only through the dir's own `custom.py` (`auto_map`; Llama
    subclasses of model_type `alignflow_custom_llama`), which creates the file `marker` when it is imported."""

    def make(model_dir: Path, out: Path) -> tuple[Path, Path]:
        shutil.copytree(model_dir, out)
        marker = out.with_name(f"{out.name}.code-ran")
        (out / "custom.py").write_text(REMOTE_CODE.format(marker=str(marker)))
        config = json.loads((out / "config.json").read_text())
        config["model_type"] = "alignflow_custom_llama"
        config["auto_map"] = {"AutoConfig": "custom.CustomConfig", "AutoModel": "custom.CustomModel",
                              "AutoModelForCausalLM": "custom.CustomForCausalLM"}
        (out / "config.json").write_text(json.dumps(config))
        tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
        tokenizer_config.update(tokenizer_class="CustomTokenizer",
                                auto_map={"AutoTokenizer": [None, "custom.CustomTokenizer"]})
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        return out, marker

    return make
