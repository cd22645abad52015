"""Reward model (backbone + scalar head, three poolings) and PPO value model (backbone + per-token head),
padding-independent, saved as an HF backbone dir + a safetensors head + a small JSON config."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModel, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from pipeline_lib.errors import one_line
from pipeline_lib.model_dirs import head_files
from pipeline_lib.models.loading import (
    ModelLoadError, atomic_output_dir, load_policy, load_pretrained, resolve_model_dir,
)
from pipeline_lib.models.logprobs import packed_mask, position_ids_from_mask

Pooling = Literal["last_token", "mean", "last_two_layers"]
POOLINGS: tuple[str, ...] = ("last_token", "mean", "last_two_layers")


# ---- helpers shared by RewardModel and ValueModel


def _load_backbone(
    path: str | Path, *, dtype: str | torch.dtype, device: str | torch.device, trust_remote_code: bool
) -> PreTrainedModel:
    """The base transformer (no LM head) of a policy or head checkpoint, safetensors only. A causal LM loads
    whole and gives its LM head up: read as AutoModel, its lm_head.weight would be reported as unexpected."""
    try:
        config = json.loads((resolve_model_dir(path) / "config.json").read_text())
        causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config["model_type"]) in config["architectures"]
    except (OSError, ValueError, TypeError, KeyError):  # load_pretrained words the error
        causal = False
    if causal:
        return load_policy(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code).base_model
    return load_pretrained(AutoModel, path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)


def _new_head(hidden_size: int, *, zero: bool, seed: int) -> nn.Linear:
    """A float32 linear head: zeros, or N(0, 1/sqrt(hidden+1)) with bias 0, from a private generator so the
    init is reproducible without touching the global RNG."""
    head = nn.Linear(hidden_size, 1)
    with torch.no_grad():
        head.bias.zero_()
        if zero:
            head.weight.zero_()
        else:
            generator = torch.Generator().manual_seed(seed)
            head.weight.normal_(0.0, 1.0 / math.sqrt(hidden_size + 1), generator=generator)
    return head


def final_norm_name(backbone: PreTrainedModel) -> str:
    """Where the norm sits that turns the last layer's output into `hidden_states[-1]` (Llama, Qwen, Mistral:
    `norm`; GPT-2: `ln_f`; GPT-NeoX: `final_layer_norm`; OPT: `decoder.final_layer_norm`): the last module named
    like a norm outside the numbered layers, kept only if a 2-token forward shows its output is that entry (a
    projection after it, or a norm that is not the final one, is refused; so is OPT-350m, which has none)."""
    names = [name for name, module in backbone.named_modules()
             if type(module).__name__.lower().endswith("norm") and not any(part.isdigit() for part in name.split("."))]
    if names:
        seen = []
        hook = backbone.get_submodule(names[-1]).register_forward_hook(lambda _m, _args, out: seen.append(out))
        try:
            with torch.no_grad():
                ids = torch.zeros(1, 2, dtype=torch.long, device=backbone.device)
                outputs = backbone(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True,
                                   use_cache=False)
            last = outputs.hidden_states[-1]
        finally:
            hook.remove()
        if len(seen) == 1 and torch.equal(seen[0], last):  # False for another shape too (a projection)
            return names[-1]
    raise ModelLoadError(f"pooling last_two_layers: {type(backbone).__name__} has no final norm that gives its last "
                         "hidden state, to put the layer before the last on the last layer's scale; use pooling "
                         "last_token or mean")


def _hidden_states(
    backbone: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, *, norm_name: str | None = None,
    packed: PackedGroups | None = None,
) -> tuple[Tensor, ...]:
    """Backbone hidden states in float32: the last layer's (final-normed), and with `norm_name` (the final norm's,
    `final_norm_name`) before it the previous layer's through that norm (raw, a pre-norm model's residual stream
    is on another scale: far larger on trained LLMs). Positions come from the mask so padding side does not matter;
    `packed` rows take its positions and `packed_mask`."""
    if attention_mask.shape != input_ids.shape or input_ids.dim() != 2:
        raise ValueError(
            f"attention_mask: expected shape {tuple(input_ids.shape)} (B, T) like input_ids, "
            f"got {tuple(attention_mask.shape)}"
        )
    if not bool(attention_mask.bool().any(dim=-1).all()):
        raise ValueError("attention_mask: every row needs at least one valid (1) token")
    if packed is None:
        mask, positions = attention_mask, position_ids_from_mask(attention_mask)
    else:
        mask = packed_mask(attention_mask, packed.segments, backbone.config._attn_implementation,
                           backbone.get_input_embeddings().weight.dtype)
        positions = packed.position_ids
    outputs = backbone(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        output_hidden_states=norm_name is not None,
        use_cache=False,
    )
    if norm_name is not None:
        norm = backbone.get_submodule(norm_name)
        return norm(outputs.hidden_states[-2]).float(), outputs.hidden_states[-1].float()
    return (outputs.last_hidden_state.float(),)


def _save(
    out_dir: str | Path, backbone: PreTrainedModel, head: nn.Linear, kind: str, extra: dict,
    tokenizer: PreTrainedTokenizerBase | None,
) -> Path:
    """Backbone via save_pretrained + `<kind>_head.safetensors` + `<kind>_config.json`, written atomically."""
    with atomic_output_dir(out_dir) as tmp:
        backbone.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        state = {name: tensor.detach().float().cpu().contiguous() for name, tensor in head.state_dict().items()}
        save_file(state, str(tmp / f"{kind}_head.safetensors"))
        config = {"kind": kind, "hidden_size": head.in_features, **extra}
        (tmp / f"{kind}_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(out_dir).resolve()


def _load(
    path: str | Path, kind: str, *, dtype: str | torch.dtype, device: str | torch.device, trust_remote_code: bool
) -> tuple[PreTrainedModel, nn.Linear, dict]:
    """Inverse of `_save`: (backbone, head, config)."""
    model_dir = Path(path).expanduser()
    config_file, head_file = head_files(model_dir, kind)
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{config_file}: not valid JSON ({exc})") from None
    backbone = _load_backbone(model_dir, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    if int(config.get("hidden_size", -1)) != backbone.config.hidden_size:
        raise ModelLoadError(
            f"{config_file}: hidden_size={config.get('hidden_size')} but the backbone has {backbone.config.hidden_size}"
        )
    head = nn.Linear(int(config["hidden_size"]), 1)
    try:
        head.load_state_dict(load_file(str(head_file)))
    except (SafetensorError, RuntimeError, OSError) as exc:  # a truncated file, wrong shapes
        raise ModelLoadError(f"{head_file}: cannot load the {kind} head ({one_line(exc)})") from exc
    return backbone, head.to(backbone.device), config


# ---- models


@dataclass(frozen=True)
class PackedGroups:
    """Rows that each hold a group of K texts (a pair, a ranking) sharing their first tokens: the shared prefix once,
    then each text's own tokens at the positions they have in that text (`train.data.collate_groups`)."""

    position_ids: Tensor  # (B, L)
    segments: Tensor  # (B, L) 0 the shared prefix or padding, k + 1 text k's own tokens
    ends: Tensor  # (B, K) the column of each text's last token
    lengths: Tensor  # (B, K) each text's tokens, prefix included; 0 where a group holds fewer than K texts

    def to(self, device: torch.device) -> PackedGroups:
        return PackedGroups(self.position_ids.to(device), self.segments.to(device), self.ends.to(device),
                            self.lengths.to(device))


class RewardModel(nn.Module):
    """r(x, y): causal-LM backbone + scalar linear head on a pooled hidden state; scores (B,) in float32.

    Poolings (the seeds' three choices): `last_token` = last layer at the last valid token;
    `mean` = masked mean of the last layer over valid tokens; `last_two_layers` = mean of the last two
    layers at the last valid token, both through the backbone's final norm (`hidden_states[-1]` is; the layer
    before it is given the same norm, `final_norm_name`). The head is float32 whatever the backbone dtype."""

    def __init__(self, backbone: PreTrainedModel, head: nn.Linear, pooling: Pooling = "last_token",
                 chat_prompts: bool | None = None, max_length: int | None = None) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r}: expected one of {POOLINGS}")
        # a backbone without a final norm is refused here, before any training
        self.norm_name = final_norm_name(backbone) if pooling == "last_two_layers" else None
        self.backbone, self.head, self.pooling = backbone, head.float(), pooling
        self.chat_prompts = chat_prompts  # trained on chat-rendered prompts (None: not recorded); saved with it
        # the tokens of its texts it was trained on, their last (None: not recorded); saved with it, so its scorer
        # cuts the texts it scores as training did
        self.max_length = max_length

    @classmethod
    def from_policy(
        cls, path: str | Path, *, pooling: Pooling = "last_token", dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto", trust_remote_code: bool = False, seed: int = 0,
    ) -> "RewardModel":
        """A fresh head on a policy checkpoint's backbone; head ~ N(0, 1/sqrt(hidden+1)), bias 0, so the
        initial scores are small but differ between responses (a zero head would give BT loss log 2 and
        no signal to the backbone on the first step)."""
        backbone = _load_backbone(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        head = _new_head(backbone.config.hidden_size, zero=False, seed=seed)
        return cls(backbone, head.to(backbone.device), pooling)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
        trust_remote_code: bool = False,
    ) -> "RewardModel":
        backbone, head, config = _load(path, "reward", dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        if config["pooling"] == "last_two_layers" and not config.get("penultimate_normed"):
            raise ModelLoadError(f"{path}: a last_two_layers reward model of alignflow < 0.4.1, whose pooling left "
                                 "the layer before the last un-normed: its head does not fit this pooling; train it "
                                 "again (`--force rm`)")
        # chat_prompts: None before 0.2.0; max_length: None where an earlier alignflow wrote the model
        return cls(backbone, head, config["pooling"], config.get("chat_prompts"), config.get("max_length"))

    def save_pretrained(self, out_dir: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
        return _save(out_dir, self.backbone, self.head, "reward",
                     {"pooling": self.pooling, "chat_prompts": self.chat_prompts, "max_length": self.max_length,
                      "penultimate_normed": True},
                     tokenizer)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, packed: PackedGroups | None = None) -> Tensor:
        """Scores (B,) of the rows; with `packed`, (B, K) of the texts each row packs (0 past a group's size), the
        same as each text's own row would get (one forward, so DDP sees it)."""
        hidden = _hidden_states(self.backbone, input_ids, attention_mask, norm_name=self.norm_name, packed=packed)
        mask = attention_mask.bool()  # (B, T)
        if packed is not None:
            scores = self.head(self._pooled_groups(hidden, mask, packed)).squeeze(-1)  # (B, K)
            return torch.where(packed.lengths > 0, scores, torch.zeros_like(scores))
        if self.pooling == "mean":
            # where, not multiply: a pad position's state must not leak in even if it is inf/nan.
            valid = torch.where(mask.unsqueeze(-1), hidden[-1], torch.zeros_like(hidden[-1]))  # (B, T, H)
            pooled = valid.sum(dim=1) / mask.sum(dim=1, keepdim=True)  # (B, H)
        else:
            # Index of the LAST 1 in each mask row: right for left, right and no padding alike.
            positions = torch.arange(mask.shape[1], device=mask.device)  # (T,)
            last = (mask * positions).argmax(dim=-1)  # (B,)
            rows = torch.arange(mask.shape[0], device=mask.device)  # (B,)
            layers = hidden[-2:] if self.pooling == "last_two_layers" else hidden[-1:]
            pooled = torch.stack([h[rows, last] for h in layers]).mean(dim=0)  # (B, H)
        return self.head(pooled).squeeze(-1)  # (B,)

    def _pooled_groups(self, hidden: tuple[Tensor, ...], mask: Tensor, packed: PackedGroups) -> Tensor:
        """(B, K, H): each packed text's pooled state, as its own row pools it."""
        if self.pooling == "mean":
            texts = torch.arange(1, packed.ends.shape[1] + 1, device=mask.device)  # (K,) their segments
            prefix = (packed.segments == 0) & mask  # (B, L)
            members = prefix[:, None, :] | (packed.segments[:, None, :] == texts[None, :, None])  # (B, K, L)
            valid = torch.where(mask.unsqueeze(-1), hidden[-1], torch.zeros_like(hidden[-1]))  # (B, L, H)
            return members.to(valid.dtype) @ valid / packed.lengths.clamp(min=1).unsqueeze(-1)  # (B, K, H)
        ends = packed.ends.unsqueeze(-1).expand(-1, -1, hidden[-1].shape[-1])  # (B, K, H)
        layers = hidden[-2:] if self.pooling == "last_two_layers" else hidden[-1:]
        return torch.stack([h.gather(1, ends) for h in layers]).mean(dim=0)  # (B, K, H)


class ValueModel(nn.Module):
    """V(s_t) for the PPO critic: causal-LM backbone + linear head on every token's last hidden state.

    Returns (B, T) float32 values, 0 at padding. from_policy starts the head at zero, so the first
    advantages are the plain discounted returns instead of noise from a random head."""

    def __init__(self, backbone: PreTrainedModel, head: nn.Linear) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head.float()

    @classmethod
    def from_policy(
        cls, path: str | Path, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
        trust_remote_code: bool = False,
    ) -> "ValueModel":
        backbone = _load_backbone(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        head = _new_head(backbone.config.hidden_size, zero=True, seed=0)
        return cls(backbone, head.to(backbone.device))

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
        trust_remote_code: bool = False,
    ) -> "ValueModel":
        backbone, head, _ = _load(path, "value", dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        return cls(backbone, head)

    def save_pretrained(self, out_dir: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
        return _save(out_dir, self.backbone, self.head, "value", {}, tokenizer)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        (hidden,) = _hidden_states(self.backbone, input_ids, attention_mask)  # (B, T, H)
        values = self.head(hidden).squeeze(-1)  # (B, T)
        return torch.where(attention_mask.bool(), values, torch.zeros_like(values))
