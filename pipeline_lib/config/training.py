"""The training stages' configs: SFT, RM and DPO (pipeline_lib/train/sft.py, rm.py, dpo.py), GRPO, DAPO and PPO
(train/grpo.py, ppo.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from pipeline_lib.config.base import (
    DEVICE_PATTERN,
    Config,
    Processes,
    RewardSpecs,
    Seed,
    _check_reward_specs,
    _check_vllm_settings,
)
from pipeline_lib.sampling.base import MIN_TEMPERATURE


# ---- checks the stages' configs share


def _changed(config: Config, *names: str) -> list[str]:
    """Those of `names` whose value is not the field's default: set by the user (a field the stage would then
    ignore is refused: it is part of the stage's keys, so it would train again, on the same result)."""
    return [name for name in names if getattr(config, name) != type(config).model_fields[name].default]


def _check_weight_decay(weight_decay: float, *, lr: float, lr_name: str = "lr") -> None:
    """AdamW multiplies every weight by 1 - lr·weight_decay at each update: at 1 or more it zeroes or flips them."""
    if lr * weight_decay >= 1:
        raise ValueError(f"weight_decay {weight_decay} x {lr_name} {lr} >= 1: AdamW multiplies the weights by "
                         f"1 - {lr_name}·weight_decay each update, which zeroes them; "
                         f"expected weight_decay < {1 / lr:g}")


# ---- training stages (SFT, RM, DPO); the loops live in pipeline_lib/train/


class TrainLoopConfig(Config):
    """Optimizer, schedule, batching and checkpoint settings shared by the SFT, RM and DPO loops."""

    max_steps: int = Field(500, ge=1)
    """Optimizer updates to run; the data order repeats in seeded epochs as needed."""
    batch_size: int = Field(64, ge=1)
    """Rows (SFT), pairs/rankings (RM) or pairs (DPO) per optimizer update, summed over all ranks."""
    grad_accum_steps: int = Field(1, ge=1)
    """Micro-batches per update (memory only: the update is the same); must divide batch_size / world size."""
    lr: float = Field(1e-4, gt=0)
    """Peak AdamW learning rate (SFT 1e-5..1e-3, RM 1e-5..1e-4, DPO 5e-7..1e-5 on real models)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay (Loshchilov & Hutter 2019), typically 0..0.1."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps before the schedule."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    """After warm-up: constant, linear decay to 0, or cosine decay to 10% of the peak."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; None disables clipping."""
    max_length: int = Field(256, ge=2)
    """Max tokens of prompt + response; longer rows lose prompt tokens from the left (a DPO pair one cut for both
    answers); in SFT and DPO a response alone too long is cut from the right, with a warning. A reward model's texts
    lose tokens from the left only, and it records the length: its scorer cuts the texts it scores the same way."""
    save_every: int = Field(100, ge=1)
    """Write a resumable checkpoint (model, optimizer, scheduler, RNG, step) every N steps."""
    eval_every: int = Field(0, ge=0)
    """Held-out evaluation every N steps (0: only before and after training)."""
    log_every: int = Field(10, ge=1)
    """Log training metrics every N steps."""
    seed: Seed = 0
    """Seeds the data order, the held-out split and torch's RNG."""
    deterministic: bool = False
    """torch's deterministic kernels (`torch.use_deterministic_algorithms`, deterministic cuDNN, no benchmarking),
    so two CUDA runs of one config on the same GPU and software give the same weights; slower on CUDA, and an op
    without such a kernel is an error. CPU training is deterministic already; the sample stage's vLLM server is not
    covered."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """`auto` (CUDA with bf16 autocast when available, else CPU fp32), `cpu`, `cuda` or `cuda:N`."""
    trust_remote_code: bool = False
    """Allow model code shipped with a hub checkpoint (off by default: it would run the checkpoint's Python)."""
    processes: Processes = "auto"
    """torchrun processes the stage trains in (DDP: each takes batch_size / processes rows of every update).
    `auto`: one per visible CUDA GPU when `device` is `auto` or `cuda` and more than one is visible, else 1 (in
    this process); an int >= 1 is used as given (2 on CPU trains on gloo, as the tests do). Not part of the
    stage's keys: the result is the same up to float rounding (`KEEPING_FIELDS`)."""

    @model_validator(mode="after")
    def _accumulation_divides_batch(self):
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of grad_accum_steps {self.grad_accum_steps}")
        _check_weight_decay(self.weight_decay, lr=self.lr)
        return self

    @model_validator(mode="after")
    def _one_gpu_per_process(self):
        if self.processes != "auto" and self.processes > 1 and self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device} is one GPU, and processes {self.processes} take one GPU each: "
                             "expected device auto or cuda (CUDA_VISIBLE_DEVICES picks which GPUs)")
        return self


class SFTConfig(TrainLoopConfig):
    """Supervised fine-tuning: next-token loss on the response tokens only."""

    model_path: str = Field(min_length=1)
    """Starting causal LM: a local HF model dir (the tiny base model in the demo) or a cached hub id."""
    data: Literal["problems", "pairs", "best_of_n"] = "problems"
    """`problems`: gold answers of the problems table; `pairs`: the chosen responses of preference_pairs;
    `best_of_n`: the top-reward sample per prompt of a sampling run (rejection-sampling SFT, RS-SFT)."""
    split: str = "train"
    """Problems split to train on (data=problems); the `test` split, when present, gives eval/loss."""
    source: str | None = None
    """Only rows whose `source` column equals this (problems / preference_pairs); None keeps all."""
    samples_run_id: str | None = None
    """samples.run_id of the sampling run whose Best-of-N selection is the data (data=best_of_n)."""
    min_reward: float | None = None
    """data=best_of_n: drop prompts whose best sample scored below this (1.0 with the verifier keeps only
    verified answers); None keeps the best of every prompt."""
    chat_template: bool = False
    """Render plain prompts (problems, plain pairs, Best-of-N selections) as one user turn with the tokenizer's
    chat template, as SampleConfig does for instruct models; False trains on the raw text (`12+34=`). Pairs with
    stored messages always use it. With data=best_of_n it must be the sampling run's own setting (an error
    otherwise). A chat row's completion ends with the template's end of turn where the model stops on it, else eos
    (`train.data.turn_end_ids`)."""
    lr: float = Field(1e-3, gt=0)
    """Peak AdamW learning rate (1e-3 for the tiny demo model; 1e-5..2e-5 for real LMs)."""
    batch_size: int = Field(128, ge=1)
    """Rows per optimizer update, summed over all ranks."""

    @model_validator(mode="after")
    def _best_of_n_needs_run(self):
        if self.data == "best_of_n" and not self.samples_run_id:
            raise ValueError("data=best_of_n needs samples_run_id (the sampling run to select from)")
        if self.data != "best_of_n" and (self.samples_run_id is not None or self.min_reward is not None):
            raise ValueError(f"samples_run_id and min_reward select a Best-of-N sampling run: they go with "
                             f"data=best_of_n, not data={self.data}")
        # each would be ignored, and still change the stage's keys (a retraining for nothing)
        if self.data != "problems" and self.split != "train":
            raise ValueError(f"split selects the problems of data=problems; data={self.data} has none: leave it out")
        if self.data == "best_of_n" and self.source is not None:
            raise ValueError("source selects stored problems or pairs; data=best_of_n reads the sampling run "
                             "samples_run_id: leave it out")
        return self


class RMConfig(TrainLoopConfig):
    """Reward model: causal-LM backbone + scalar head trained on preferences."""

    model_path: str = Field(min_length=1)
    """Backbone init: the SFT checkpoint (usual) or the base model."""
    loss: Literal["bradley_terry", "plackett_luce"] = "bradley_terry"
    """`bradley_terry` on preference_pairs (InstructGPT eq. 1) or `plackett_luce` on rankings (K responses)."""
    pooling: Literal["last_token", "mean", "last_two_layers"] = "last_token"
    """Hidden state fed to the head: last token, masked mean, or mean of the last two layers at the last token
    (both through the backbone's final norm)."""
    margin: float = 0.0
    """Bradley-Terry margin m in -log σ(r_w - r_l - m) (Llama 2 eq. 2); 0 is the plain loss (plackett_luce has
    none)."""
    disable_dropout: bool = True
    """Train with dropout off (TRL's RewardConfig default). False trains with the backbone's dropout on; a group's
    responses then run as rows of their own, each drawing its own dropout (packed behind their shared prompt they
    would share one draw over it)."""
    source: str | None = None
    """Only pairs/rankings whose `source` equals this; None keeps all."""
    eval_fraction: float = Field(0.1, gt=0, lt=1)
    """Seeded share of pairs/rankings held out for eval/rm_accuracy."""
    lr: float = Field(3e-4, gt=0)
    """Peak AdamW learning rate (3e-4 for the tiny demo model; 1e-5..1e-4 for real LMs)."""

    @model_validator(mode="after")
    def _margin_is_bradley_terrys(self):
        if self.loss == "plackett_luce" and self.margin != 0:  # ignored, yet part of the stage's keys
            raise ValueError(f"margin {self.margin} is Bradley-Terry's; loss plackett_luce has none: leave it out")
        return self


class DPOConfig(TrainLoopConfig):
    """Direct Preference Optimization on preference_pairs, reference = the starting policy."""

    policy_path: str = Field(min_length=1)
    """Starting policy (usually the SFT checkpoint); also the frozen reference."""
    beta: float = Field(0.1, gt=0)
    """KL strength β, typically 0.1-0.5 (Rafailov et al. 2023)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Conservative-DPO label noise ε (Mitchell 2023); 0 is plain DPO. Below 0.5: at 0.5 the loss is symmetric in
    chosen and rejected, its minimum at the start (no preference left to learn)."""
    rpo_alpha: float = Field(0.0, ge=0)
    """Weight α of RPO's per-token NLL on the chosen response (Pang et al. 2024; they use 1.0 on GSM8K); 0 is
    plain DPO. Keeps DPO from lowering the chosen answers' likelihood on near-miss pairs."""
    source: str | None = None
    """Only pairs whose `source` equals this; None keeps all."""
    samples_run_id: str | None = None
    """Train on the West-of-N pairs of this sampling run alone (`from:sample` in a pipeline), instead of
    preference_pairs: the pairs the West-of-N filter makes from its samples, none of an earlier run."""
    eval_fraction: float = Field(0.1, gt=0, lt=1)
    """Seeded share of pairs held out for eval/pref_accuracy and eval/logp_margin."""
    ref_batch_size: int = Field(256, ge=1)
    """Rows per forward pass of the one-time reference log-prob computation (and the held-out evals); a pair counts
    as two rows, packed or not."""
    disable_dropout: bool = True
    """Train with dropout off (TRL's default): the policy is then the same function as the cached reference
    at step 0 (loss log 2). False trains with the model's dropout and lora_dropout on, and a pair's answers as two
    rows (packed behind their prompt they would share one dropout draw over it)."""
    lora_r: int = Field(0, ge=0)
    """LoRA rank through peft (Hu et al. 2021), e.g. 8-64; 0 trains all weights. With LoRA the reference is
    the policy with adapters disabled (no second copy) and the final model has the adapters merged."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator: the update is (alpha / r) · B A."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input, 0..0.1; needs disable_dropout false."""
    lora_target_modules: Annotated[tuple[Annotated[str, Field(min_length=1)], ...],
                                   AfterValidator(lambda names: tuple(sorted(set(names))))] = \
        ("k_proj", "o_proj", "q_proj", "v_proj")
    """Module names that get adapters (Llama attention projections by default). Kept sorted without repeats: a
    reordered list is the same adapters, so the same stage key."""
    lr: float = Field(5e-7, gt=0)
    """Peak AdamW learning rate (5e-7..5e-6 on real LMs; the tiny demo model needs ~1e-4)."""

    @model_validator(mode="after")
    def _fields_agree(self):
        if self.source and self.samples_run_id:
            raise ValueError("set one of source (stored pairs) and samples_run_id (a sampling run's West-of-N pairs)")
        lora = _changed(self, "lora_alpha", "lora_dropout", "lora_target_modules")
        if self.lora_r == 0 and lora:  # ignored, yet part of the stage's keys
            raise ValueError(f"{', '.join(lora)} set but lora_r is 0 (no LoRA: every weight trains): set lora_r to "
                             "train adapters, or leave them out")
        if self.lora_r > 0 and not self.lora_target_modules:
            raise ValueError(f"lora_r {self.lora_r} but lora_target_modules is empty: name the modules to adapt")
        if self.lora_dropout > 0 and self.disable_dropout:
            raise ValueError(f"lora_dropout {self.lora_dropout} has no effect while disable_dropout is true: set "
                             "disable_dropout false to train with dropout")
        return self


# ---- online RL stages (pipeline_lib/train/grpo.py, ppo.py)


def _check_mini_batches(mini_batch_size: int | None, rows_per_step: int, rows_from: str) -> None:
    """A mini-batch smaller than the step must divide its rows: a short last mini-batch would get a full optimizer
    update of its own on a noisier gradient (TRL refuses such batch sizes too). One at least as large as the step
    updates once on the whole step."""
    if mini_batch_size is not None and mini_batch_size < rows_per_step and rows_per_step % mini_batch_size:
        raise ValueError(f"mini_batch_size {mini_batch_size} does not split the {rows_per_step} completions of a "
                         f"step ({rows_from}) into equal updates: expected a divisor of {rows_per_step}")


class OnlineRLConfig(Config):
    """Where and how the online RL stages (GRPO, DAPO, PPO) sample their rollouts and run; their algorithm fields are
    their own."""

    backend: Literal["hf", "vllm"] = "hf"
    """`hf`: in-process transformers generate on the live policy; `vllm`: a vLLM server in its own venv that takes
    the policy's weights before every rollout (by NCCL onto a second GPU, else saved and reloaded)."""
    vllm_max_model_len: int | None = Field(None, ge=16)
    """Context length the vLLM server reserves KV cache for; None: the model's maximum."""
    vllm_gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Share of its GPU's memory the vLLM server takes (vLLM's `--gpu-memory-utilization`); None: on the GPU the
    policy trains on, 90% of what is free when it starts, at most 0.3 (TRL's colocate default); on a GPU of its own,
    vLLM's 0.92. GPU only: vLLM's CPU build sizes its KV cache by $VLLM_CPU_KVCACHE_SPACE (GiB; default 1)."""
    log_every: int = Field(1, ge=1)
    """Log metrics every N steps."""
    seed: Seed = 0
    """Seeds the prompt order, each rollout's sampling and the mini-batch order."""
    deterministic: bool = False
    """torch's deterministic kernels (`torch.use_deterministic_algorithms`, deterministic cuDNN, no benchmarking)
    for the HF rollouts and the updates, so two CUDA runs of one config on the same GPU and software give the same
    weights; slower on CUDA, and an op without such a kernel is an error. CPU training is deterministic already;
    vLLM sampling (`backend: vllm`) is not covered."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """`auto` (CUDA with bf16 autocast when available, else CPU fp32), `cpu`, `cuda` or `cuda:N`."""
    trust_remote_code: bool = False
    """Allow model code shipped with a hub checkpoint (off by default: it would run the checkpoint's Python)."""


class GRPOConfig(OnlineRLConfig):
    """GRPO (DeepSeekMath, arXiv:2402.03300): G samples per prompt from θ_old, group-normalized advantages,
    clipped surrogate + β·k3 KL to the reference, μ updates per rollout. Defaults are the paper's."""

    policy_path: str = Field(min_length=1)
    """Starting policy (the SFT checkpoint); also the frozen reference when beta > 0."""
    problems_source: str | None = None
    """Only problems whose `source` equals this; None keeps all."""
    split: str = "train"
    """Problems split whose prompts are the rollout prompts."""
    chat_template: bool = False
    """Render each problem as one user turn with the tokenizer's chat template (as the SFT stage did);
    False sends the problem text raw (the demo's `12+34=`)."""
    rewards: RewardSpecs = ({"name": "verifier", "weight": 1.0},)
    """Reward specs `{name, weight, **options}` summed per sample (pipeline_lib.rewards.registry):
    `verifier` (1 if correct, else its option `incorrect`, default 0), `overlong` (DAPO shaping,
    max_len/cache_len), `reward_model`."""
    reward_model_path: str | None = None
    """Reward model dir, needed when `rewards` names `reward_model`."""
    loss: Literal["grpo", "dr_grpo", "dapo"] = "grpo"
    """Policy loss from losses.LOSSES: `grpo` (per-sequence token mean, symmetric clip, k3 KL), `dr_grpo` (the
    same terms summed over tokens / (completions · max_new_tokens), with scale_rewards false: Dr.GRPO) or `dapo`
    (token-level mean, clip-higher, no KL term unless `beta` is given)."""
    max_steps: int = Field(200, ge=1)
    """Rollout steps: each generates one batch, then runs num_iterations passes of mini-batch updates."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts per rollout; completions per step = prompts_per_step * group_size (paper: 1024 completions)."""
    group_size: int = Field(64, ge=2)
    """G samples per prompt (DeepSeekMath: 64; DAPO: 16)."""
    num_iterations: int = Field(1, ge=1)
    """μ: passes over each rollout batch with θ_old fixed (DeepSeekMath: 1, a single update per rollout)."""
    mini_batch_size: int | None = Field(None, ge=1)
    """Completions per optimizer update, a divisor of prompts_per_step * group_size; None (or a value at least that
    large) updates once on the whole rollout batch per iteration. Each update's loss is reduced over its own
    mini-batch (DAPO's token mean: over the mini-batch's tokens, as verl does)."""
    lr: float = Field(1e-6, gt=0)
    """Peak AdamW learning rate (DeepSeekMath and DAPO: 1e-6; the tiny demo model: 2e-4; >= 3e-4 collapses it)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay (DAPO: 0.1)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up, in training steps (rollouts): every update of a step uses the same rate, and a step whose
    groups dynamic sampling all dropped still advances the schedule."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up, over max_steps: constant, linear decay to 0, or cosine decay to 10% of the peak."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; None disables clipping."""
    max_new_tokens: int = Field(1024, ge=1)
    """Generation budget per completion (DeepSeekMath: 1024; the demo: 6)."""
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE)
    """Sampling temperature of the rollouts. θ, θ_old and the reference log-probs divide the logits by it too
    (as TRL and verl do), so the ratio and the KL are taken on the distribution the rollouts were drawn from."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 disables it (anything else biases the ratio π/π_old)."""
    beta: float = Field(0.04, ge=0)
    """β of the k3 KL term to the reference (DeepSeekMath: 0.04); 0 loads no reference model."""
    clip_eps_low: float = Field(0.2, gt=0, lt=1)
    """ε (ε_low for DAPO): the ratio is clipped below at 1 - ε."""
    clip_eps_high: float = Field(0.2, gt=0)
    """ε_high: the ratio is clipped above at 1 + ε_high; DAPO's clip-higher uses 0.28, GRPO keeps it = ε_low."""
    scale_rewards: bool = True
    """Divide the group-centred rewards by the group std (GRPO); False centres only, as Dr.GRPO (arXiv:2503.20783)
    does; its other change, no 1/|o_i| length normalization, is `loss: dr_grpo`."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: keep only groups with 0 < #correct < G (raw verifier outcome) and refill."""
    max_refill_rounds: int = Field(4, ge=0)
    """Extra rollout rounds to refill a batch emptied by dynamic sampling; after them it trains on what it has."""
    save_every: int = Field(50, ge=1)
    """Write a resumable checkpoint (policy, optimizer, scheduler, RNG, data position) every N steps."""

    @model_validator(mode="before")
    @classmethod
    def _dapo_without_kl_by_default(cls, data: object) -> object:
        """`loss: dapo` has no KL term unless `beta` is given (DAPO §2.3), whatever this preset's default β."""
        if isinstance(data, dict) and data.get("loss") == "dapo" and "beta" not in data:
            return {**data, "beta": 0.0}
        return data

    @model_validator(mode="after")
    def _check_loss_options(self):
        _check_vllm_settings(self.backend, vllm_max_model_len=self.vllm_max_model_len,
                             vllm_gpu_memory_utilization=self.vllm_gpu_memory_utilization)
        _check_reward_specs(self.rewards, self.reward_model_path)
        if self.loss in ("grpo", "dr_grpo") and self.clip_eps_high != self.clip_eps_low:
            raise ValueError(f"loss '{self.loss}' clips symmetrically: clip_eps_high must equal clip_eps_low "
                             "(use loss 'dapo')")
        if self.loss == "dr_grpo" and self.scale_rewards:
            raise ValueError("loss 'dr_grpo' centres the rewards without dividing by their std: scale_rewards must be "
                             "false (Dr.GRPO)")
        if self.clip_eps_high < self.clip_eps_low:
            raise ValueError(f"clip_eps_high {self.clip_eps_high} < clip_eps_low {self.clip_eps_low}: clip-higher "
                             "(DAPO §3.1) widens the upper bound, expected clip_eps_high >= clip_eps_low")
        _check_weight_decay(self.weight_decay, lr=self.lr)
        if not self.dynamic_sampling and _changed(self, "max_refill_rounds"):
            raise ValueError(f"max_refill_rounds {self.max_refill_rounds} refills what dynamic sampling filters, and "
                             "dynamic_sampling is false: set it true, or leave max_refill_rounds out")
        if self.dynamic_sampling and not any(spec["name"] == "verifier" and spec.get("weight", 1.0) != 0
                                             for spec in self.rewards):
            raise ValueError("dynamic_sampling keeps the groups with 0 < #correct < G, which only a reward with the "
                             "verifier (weight != 0) varies: add {name: verifier} to rewards or set dynamic_sampling "
                             "false")
        for spec in self.rewards:
            if spec["name"] == "overlong" and int(spec.get("max_len", 0)) > self.max_new_tokens:
                raise ValueError(f"rewards overlong max_len {spec['max_len']} exceeds max_new_tokens {self.max_new_tokens}")
        return self

    @model_validator(mode="after")
    def _mini_batches_split_the_step(self):
        _check_mini_batches(self.mini_batch_size, self.rows_per_step,
                            f"prompts_per_step {self.prompts_per_step} * group_size {self.group_size}")
        return self

    @property
    def rows_per_step(self) -> int:
        """Completions one rollout step trains on when no group is filtered out: prompts_per_step * group_size."""
        return self.prompts_per_step * self.group_size


class DAPOConfig(GRPOConfig):
    """DAPO (arXiv:2503.14476) as a GRPO preset: clip-higher, token-level loss, overlong reward shaping,
    dynamic sampling, no KL (by default). Only the defaults differ; the loop is train_grpo."""

    rewards: RewardSpecs = (
        {"name": "verifier", "weight": 1.0, "incorrect": -1.0},
        {"name": "overlong", "weight": 1.0, "max_len": 20480, "cache_len": 4096},
    )
    """R = ±1 from the verifier (DAPO §2.4) plus the soft overlong punishment: L_max = 20480, L_cache = 4096
    (DAPO §3.4)."""
    loss: Literal["grpo", "dapo"] = "dapo"
    """Token-level policy-gradient loss (DAPO §3.3)."""
    prompts_per_step: int = Field(512, ge=1)
    """Prompt batch of 512 (DAPO §4.1)."""
    group_size: int = Field(16, ge=2)
    """16 responses per prompt (DAPO §4.1)."""
    mini_batch_size: int | None = Field(512, ge=1)
    """512 completions per update: 16 updates per rollout (DAPO §4.1)."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW weight decay 0.1 (DAPO §4.1)."""
    warmup_steps: int = Field(10, ge=0)
    """10 linear warm-up steps (rollouts)."""
    max_new_tokens: int = Field(20480, ge=1)
    """L_max: 16384 expected + 4096 soft-punishment cache (DAPO §4.1)."""
    beta: float = Field(0.0, ge=0)
    """No KL term by default (DAPO §2.3: the policy is meant to move away from the initial model); β > 0 adds
    GRPO's k3 term, reduced token-level with the rest."""
    clip_eps_high: float = Field(0.28, gt=0)
    """Clip-higher ε_high = 0.28 (DAPO §3.1)."""
    dynamic_sampling: bool = True
    """Keep only groups with 0 < #correct < G and refill (DAPO §3.2)."""


class PPOConfig(OnlineRLConfig):
    """PPO for RLHF (InstructGPT; Ziegler et al. 2019): actor, frozen reference, reward model and critic;
    sequence reward + per-token KL penalty, GAE, clipped policy and value losses over several epochs."""

    policy_path: str = Field(min_length=1)
    """Starting policy (the SFT checkpoint); also the frozen reference."""
    rewards: RewardSpecs = ({"name": "reward_model", "weight": 1.0},)
    """Reward specs `{name, weight, **options}` summed into each completion's score (pipeline_lib.rewards.registry):
    the reward model (InstructGPT), the verifier on problems with answers (PPO on verifiable rewards, as in
    VAPO arXiv:2504.05118), or a weighted mix."""
    reward_model_path: str | None = None
    """Reward model dir from the RM stage (backbone + scalar head); needed when `rewards` names `reward_model`
    or the critic starts from it."""
    critic_init: Literal["reward_model", "policy"] = "reward_model"
    """Backbone the critic starts from (InstructGPT: the RM); its value head starts at zero."""
    prompts_table: Literal["problems", "preference_pairs"] = "problems"
    """Where the rollout prompts come from: problem prompts, or the prompts of preference pairs."""
    problems_source: str | None = None
    """Only rows whose `source` equals this; None keeps all."""
    split: str = "train"
    """Problems split whose prompts are used (prompts_table problems)."""
    chat_template: bool = False
    """Render plain prompts as one user turn with the tokenizer's chat template (as the SFT stage did);
    pair prompts stored as conversations always use it."""
    max_steps: int = Field(200, ge=1)
    """Rollout steps: each generates a batch, then runs ppo_epochs passes of mini-batch updates."""
    prompts_per_step: int = Field(64, ge=1)
    """Prompts per rollout (one completion each)."""
    ppo_epochs: int = Field(4, ge=1)
    """Passes over each rollout batch (PPO: 4; InstructGPT: 1..4)."""
    mini_batch_size: int | None = Field(16, ge=1)
    """Completions per optimizer update, a divisor of prompts_per_step; None (or a value at least that large)
    updates on the whole batch."""
    lr: float = Field(1e-5, gt=0)
    """Actor AdamW learning rate (InstructGPT 1.3B: ~1e-5)."""
    critic_lr: float = Field(5e-6, gt=0)
    """Critic AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up, in optimizer updates."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: constant, linear decay to 0, or cosine decay to 10% of the peak."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm (actor and critic together); None disables clipping."""
    max_new_tokens: int = Field(256, ge=1)
    """Generation budget per completion."""
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE)
    """Rollout sampling temperature; the actor, θ_old and reference log-probs divide the logits by it too."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 disables it."""
    kl_coef: float = Field(0.02, ge=0)
    """β_kl of the per-token penalty -β_kl·(log π - log π_ref) (InstructGPT: 0.02); the adaptive start value."""
    adaptive_kl: bool = False
    """Adapt β_kl toward kl_target (Ziegler et al. 2019, §2.2); False keeps it fixed."""
    kl_target: float = Field(6.0, gt=0)
    """Target sequence KL in nats for the adaptive controller (Ziegler et al.: 6)."""
    kl_horizon: int = Field(10000, ge=1)
    """Horizon of the adaptive controller, in samples (Ziegler et al.: 10000)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE discount γ (1.0 for RLHF: the reward comes at the end)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE λ (0.95)."""
    clip_eps: float = Field(0.2, gt=0, lt=1)
    """PPO ratio clip ε."""
    value_clip_eps: float = Field(0.2, gt=0)
    """Clip of the value update around the rollout values."""
    vf_coef: float = Field(0.1, ge=0)
    """Weight of the value loss in actor + critic loss."""
    whiten_advantages: bool = True
    """Normalize advantages over the batch's valid tokens (mean 0, std 1)."""
    save_every: int = Field(50, ge=1)
    """Write a resumable checkpoint (actor, critic, optimizer, scheduler, RNG, KL coefficient) every N steps."""

    @model_validator(mode="after")
    def _check_rewards_and_critic(self):
        _check_vllm_settings(self.backend, vllm_max_model_len=self.vllm_max_model_len,
                             vllm_gpu_memory_utilization=self.vllm_gpu_memory_utilization)
        _check_reward_specs(self.rewards, self.reward_model_path)
        if self.critic_init == "reward_model" and not self.reward_model_path:
            raise ValueError("critic_init 'reward_model' needs reward_model_path; set it or use critic_init 'policy'")
        if self.prompts_table == "preference_pairs" and any(spec["name"] == "verifier" for spec in self.rewards):
            raise ValueError("rewards name 'verifier' but prompts_table 'preference_pairs' has no answers; "
                             "use prompts_table 'problems'")
        _check_weight_decay(self.weight_decay, lr=self.lr)
        _check_weight_decay(self.weight_decay, lr=self.critic_lr, lr_name="critic_lr")
        return self

    @model_validator(mode="after")
    def _fields_the_stage_reads(self):
        """The KL controller's and the value loss's settings where they act; set elsewhere they would be ignored."""
        if not self.adaptive_kl and (ignored := _changed(self, "kl_target", "kl_horizon")):
            raise ValueError(f"{', '.join(ignored)} set but adaptive_kl is false (β_kl stays kl_coef): set "
                             "adaptive_kl true, or leave them out")
        if self.adaptive_kl and self.kl_coef == 0:
            raise ValueError("adaptive_kl multiplies kl_coef by a factor each step, and kl_coef is 0: it would stay "
                             "0; expected kl_coef > 0 (its start value)")
        if self.adaptive_kl and self.kl_horizon * 5 <= self.prompts_per_step:
            raise ValueError(f"kl_horizon {self.kl_horizon} <= prompts_per_step {self.prompts_per_step} / 5: the "
                             "controller's factor 1 + clip(KL / kl_target - 1, ±0.2) · prompts_per_step / kl_horizon "
                             "reaches 0 or below (a negative β_kl); "
                             f"expected kl_horizon > {self.prompts_per_step / 5:g}")
        if self.vf_coef == 0 and (ignored := _changed(self, "critic_lr", "value_clip_eps")):
            raise ValueError(f"{', '.join(ignored)} set but vf_coef is 0 (the critic gets no gradient): set vf_coef "
                             "> 0, or leave them out")
        return self

    @model_validator(mode="after")
    def _mini_batches_split_the_step(self):
        _check_mini_batches(self.mini_batch_size, self.prompts_per_step,
                            f"prompts_per_step {self.prompts_per_step}, one completion each")
        return self
