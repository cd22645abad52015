"""Load and save Hugging Face models and tokenizers safely: local dir or cached hub id, safetensors only,
no remote code unless asked, offline failures in well under a second, atomic checkpoint writes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from pipeline_lib.errors import one_line
from pipeline_lib.model_dirs import ModelLoadError, check_weights, refuse_hub_kernels, resolve_model_dir


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" → cuda when available, else cpu; anything else is passed to torch.device, and a CUDA device this
    machine lacks is a one-line ModelLoadError (torch would fail later, deep inside loading)."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"device={device!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N' ({exc})") from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= count:
            raise ModelLoadError(f"device={device!r}: this machine has {count} CUDA device(s); use 'auto' or 'cpu'")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" → bfloat16 on CUDA, float32 elsewhere (CPU bf16 matmuls are slow and lossy)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ModelLoadError(f"dtype={dtype!r}: expected 'auto' or one of {sorted(names)}")
    return names[dtype]


def load_pretrained(
    auto_cls: type,
    path_or_id: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> PreTrainedModel:
    """`auto_cls.from_pretrained` behind the safety checks above; the model lands on `device` in `dtype`."""
    model_dir = resolve_model_dir(path_or_id, allow_pickle=allow_pickle)
    safetensors = check_weights(model_dir, allow_pickle=allow_pickle)
    if not trust_remote_code:
        refuse_hub_kernels(model_dir)
    target = resolve_device(device)
    try:
        model, info = auto_cls.from_pretrained(
            model_dir,
            dtype=resolve_dtype(dtype, target),
            use_safetensors=safetensors,
            trust_remote_code=trust_remote_code,
            local_files_only=True,
            output_loading_info=True,
        )
    except Exception as exc:  # noqa: BLE001 - surface one line; the chained cause keeps the detail
        raise ModelLoadError(f"model dir {model_dir}: {auto_cls.__name__} could not load it ({one_line(exc)})") from exc
    if info["missing_keys"]:  # transformers would start them at random and only log it
        missing = sorted(info["missing_keys"])
        heads = [f"a {kind} model dir ({kind}_config.json): " for kind in ("reward", "value")
                 if (model_dir / f"{kind}_config.json").is_file()]
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"model dir {model_dir}: {heads[0] if heads else ''}its weights lack "
                             f"{', '.join(missing[:3])}{more}, which {auto_cls.__name__} needs")
    return model.to(target)


def load_policy(
    path_or_id: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> PreTrainedModel:
    """A causal LM from a local dir or cached hub id (bf16 on CUDA, fp32 on CPU by default)."""
    return load_pretrained(
        AutoModelForCausalLM, path_or_id, dtype=dtype, device=device,
        trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
    )


def load_tokenizer(path_or_id: str | Path, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The model's tokenizer, padded on the left; a tokenizer without a pad token pads with eos.

    Left padding because generation needs it, and every consumer in this project (log-probs, reward and
    value heads) derives positions from the attention mask, so left padding is correct everywhere."""
    model_dir = resolve_model_dir(path_or_id)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model_dir, trust_remote_code=trust_remote_code, local_files_only=True, padding_side="left"
        )
    except Exception as exc:  # noqa: BLE001 - surface one line; the chained cause keeps the detail
        raise ModelLoadError(f"tokenizer in {model_dir}: could not load it ({one_line(exc)})") from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(f"tokenizer in {model_dir}: has neither a pad token nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    vocab = config_vocab_size(model_dir)
    beyond = {token: i for token, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids)
              if vocab is not None and i >= vocab}
    if beyond:  # the embedding has no row for them: an IndexError at the first batch they pad or end
        raise ModelLoadError(f"tokenizer in {model_dir}: special tokens {beyond} have ids past the model's "
                             f"vocab_size {vocab} (added to the tokenizer without resizing the model's embeddings); "
                             "resize them (model.resize_token_embeddings(len(tokenizer))) and save the model again")
    return tokenizer


def config_vocab_size(model_dir: Path) -> int | None:
    """The rows of the model's input embeddings as its config.json (its text config) says; None where it names none."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None  # a tokenizer-only dir; the model's own load reports a bad config
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab = text.get("vocab_size", config.get("vocab_size"))
    return vocab if isinstance(vocab, int) else None


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield a temp dir beside `out_dir`; on success it replaces `out_dir` by rename, on error it is removed.

    A reader never sees a half-written checkpoint: the new dir appears by one rename (an older dir at
    `out_dir` is first renamed aside, then deleted)."""
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    apply_umask(tmp)
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def apply_umask(path: Path) -> None:
    """Give `path` (a file, or each file under a dir) the mode `open()` creates files with under this process's
    umask: safetensors writes 0600 whatever the umask, so a model dir was unreadable to the others sharing a
    workspace (its MLflow copy too) where every other file was readable."""
    mode = 0o666 & ~_umask()
    for file in [path] if path.is_file() else path.rglob("*"):
        if file.is_file() and file.stat().st_mode & 0o777 != mode:
            file.chmod(mode)


def _umask() -> int:
    """This process's umask: read from /proc (setting it to read it back would race with other threads' files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path) -> Path:
    """Save model (+ tokenizer) as safetensors into `out_dir` atomically; return the dir.

    transformers 5 always writes safetensors (its `safe_serialization` flag is gone), so we check the
    result instead of passing the flag."""
    out_dir = Path(out_dir).resolve()
    with atomic_output_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if not any(tmp.glob("*.safetensors")):
            raise ModelLoadError(f"save to {out_dir}: save_pretrained wrote no *.safetensors file")
    return out_dir
