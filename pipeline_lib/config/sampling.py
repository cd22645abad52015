"""The configs of the sampling and evaluation stages and of the tiny offline model."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pipeline_lib.config.base import (
    DEVICE_PATTERN,
    Config,
    RewardSpecs,
    SamplingTemperature,
    Seed,
    _check_reward_specs,
    _check_vllm_settings,
)


# ---- sampling stage (pipeline_lib/sampling/stage.py)


class SampleConfig(Config):
    """N samples per problem from a policy, scored and written to the `samples` table (`alignflow sample`)."""

    model_path: str = Field(min_length=1)
    """Policy to sample from: a local HF model dir (a cached hub id also works with the hf backend)."""
    problems_source: str | None = None
    """Only problems whose `source` equals this (e.g. `problems` for data/demo/problems.jsonl); None keeps all."""
    split: str = "test"
    """Problems split to sample: `train` for Best-of-N / West-of-N data, `test` for evaluation."""
    max_problems: int | None = Field(None, ge=1)
    """Sample only the first K problems in problem_id order; None samples them all."""
    n: int = Field(16, ge=1)
    """Samples per prompt: N of Best-of-N, G of GRPO, the K budget of Pass@K (typically 4-64)."""
    max_new_tokens: int = Field(64, ge=1)
    """Generation budget per sample; longer samples end with finish_reason `length` (demo: 6, GSM8K: 256+)."""
    temperature: SamplingTemperature = 1.0
    """Softmax temperature; 0 is greedy (then all n samples are equal). RL rollouts use 1.0."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (Holtzman et al. 2020); 1.0 disables it."""
    seed: Seed = 0
    """Batch b of the run is sampled with seed + b, so a resumed run reproduces an uninterrupted one."""
    stop: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    """Strings that end a sample early (cut from the text, finish_reason `stop`); eos always stops."""
    chat_template: bool = False
    """Render each prompt as one user turn with the tokenizer's chat template (instruct models);
    False sends the problem text raw (the demo's `12+34=`)."""
    backend: Literal["hf", "vllm"] = "hf"
    """`hf`: in-process transformers generate; `vllm`: vLLM's server in its own venv (`make vllm-env`)."""
    vllm_url: str | None = None
    """Base URL of an already running vLLM server to use instead of starting one (backend vllm only)."""
    vllm_max_model_len: int | None = Field(None, ge=16)
    """Context length the started vLLM server reserves KV cache for; None: the model's maximum."""
    vllm_gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Share of its GPU's memory the started vLLM server takes (vLLM's `--gpu-memory-utilization`); None: 90% of what
    is free when it starts where this process has used the GPU (an earlier in-process stage), else vLLM's 0.92. GPU
    only: vLLM's CPU build sizes its KV cache by $VLLM_CPU_KVCACHE_SPACE (GiB; default 1)."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """Device of the hf backend: `auto` (CUDA when available), `cpu`, `cuda`, `cuda:N`."""
    batch_size: int = Field(32, ge=1)
    """Prompts per generate call and per store write (a crash loses at most one batch); part of the run id,
    since the hf backend's random stream depends on the batch."""
    rewards: RewardSpecs = ({"name": "verifier", "weight": 1.0},)
    """Reward specs `{name, weight, **options}` summed into `samples.reward` (pipeline_lib.rewards.registry):
    `verifier` (1 if correct, else its option `incorrect`, default 0), `overlong` (DAPO shaping,
    max_len/cache_len), `reward_model`."""
    reward_model_path: str | None = None
    """Reward model dir scoring prompt + completion, needed when `rewards` names `reward_model`."""
    run_id: str | None = None
    """samples.run_id; None derives it from this config and the fingerprints of the model dirs, so a rerun of the
    same config resumes (skips prompts already sampled) and a retrained model starts a new run. A crash-resumed
    run holds exactly the rows of an uninterrupted one; problems ingested after a run started are sampled in
    batches of their own (with the hf backend, other random draws than a fresh run's, from the same policy);
    `device` is not part of the id, and CPU and CUDA draw different random streams. With max_problems, the
    selected problems' ids are part of it too (another first K is another run). An explicit run_id reused with
    another `n` or another policy (model_path, or policy_name where set) is an error; its rows are not checked
    against the rest of the config."""
    policy_name: str | None = None
    """samples.policy label; None uses model_path."""
    trust_remote_code: bool = False
    """Allow model code shipped with the policy's or reward model's checkpoint (in process and in the started vLLM
    server; off by default: it would run the checkpoint's Python)."""

    @model_validator(mode="after")
    def _check_backend_and_rewards(self):
        _check_vllm_settings(self.backend, vllm_url=self.vllm_url, vllm_max_model_len=self.vllm_max_model_len,
                             vllm_gpu_memory_utilization=self.vllm_gpu_memory_utilization)
        _check_reward_specs(self.rewards, self.reward_model_path)
        return self


# ---- model preparation (the tiny offline model of the demo and the tests)


class TinyModelConfig(Config):
    """A tiny Llama + character-level tokenizer built offline from the store's texts (pipeline_lib/models/tiny.py)."""

    corpus_sources: tuple[str, ...] | None = Field(None, min_length=1)
    """Store sources whose texts train the tokenizer (every character the model will see); None = all (in a
    pipeline: all but its `west_of_n_source`, the pairs its own runs add); an empty list is refused."""
    vocab_size: int | None = Field(None, ge=8)
    """BPE vocabulary size (more than the 7 special tokens); None = alphabet + specials only, every digit its own token (the demo's arithmetic needs them)."""
    hidden_size: int = Field(128, ge=8)
    """Model width (128 in the calibrated demo)."""
    num_layers: int = Field(2, ge=1)
    """Transformer blocks."""
    num_heads: int = Field(4, ge=1)
    """Attention heads."""
    head_dim: int = Field(32, ge=32)
    """Per-head width; >= 32 so vLLM's CPU attention can serve the model."""
    intermediate_size: int = Field(512, ge=8)
    """MLP width."""
    max_position_embeddings: int = Field(256, ge=16)
    """Longest sequence (prompt + response) the model accepts."""
    seed: Seed = 0
    """Init seed: same corpus + seed give byte-identical weights."""

    @model_validator(mode="after")
    def _heads_divide_the_width(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        return self


# ---- evaluation stage (pipeline_lib/evaluation.py: run_eval_stage)


class EvalConfig(Config):
    """Pass@K / Maj@K of one model on held-out problems: n samples per problem, then exact estimators."""

    model_path: str = Field(min_length=1)
    """Model to evaluate (a local HF model dir)."""
    model_name: str | None = None
    """Label of the model in eval_results, plots and metrics (e.g. `sft`, `grpo`); None uses model_path."""
    problems_source: str | None = None
    """Only problems whose `source` equals this; None keeps all."""
    split: str = "test"
    """Problems split evaluated (held out from training)."""
    max_problems: int | None = Field(None, ge=1)
    """Evaluate only the first K problems in problem_id order; None evaluates all."""
    n: int = Field(16, ge=1, le=1024)
    """Samples per problem (n >= the largest K; the unbiased estimators use all n; at most 1024, where Maj@K's
    subset counts still fit a float64: evaluation.MAX_SAMPLES)."""
    ks: tuple[int, ...] | None = None
    """K values of the Pass@K and Maj@K curves (each <= n); None: the powers of 2 up to n, and n (n = 16: 1, 2, 4,
    8, 16; n = 12: 1, 2, 4, 8, 12)."""
    max_new_tokens: int = Field(64, ge=1)
    """Generation budget per sample."""
    temperature: SamplingTemperature = 1.0
    """Sampling temperature (1.0: the policy's own distribution, the sampled Pass@1 the README quotes)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 disables it."""
    seed: Seed = 0
    """Sampling seed (per batch, so reruns reproduce)."""
    chat_template: bool = False
    """Render prompts with the tokenizer's chat template (instruct models)."""
    backend: Literal["hf", "vllm"] = "hf"
    """Sampling backend: in-process transformers or a vLLM server."""
    vllm_url: str | None = None
    """An already running vLLM server to use (backend vllm)."""
    vllm_max_model_len: int | None = Field(None, ge=16)
    """Context length a started vLLM server reserves KV cache for; None: the model's maximum."""
    vllm_gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Share of its GPU's memory a started vLLM server takes (GPU only; None: as SampleConfig's)."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """Device of the hf backend."""
    batch_size: int = Field(32, ge=1)
    """Prompts per generate call."""
    trust_remote_code: bool = False
    """Allow model code shipped with the model's checkpoint (off by default: it would run the checkpoint's Python)."""

    @model_validator(mode="after")
    def _check_backend_and_ks(self):
        _check_vllm_settings(self.backend, vllm_url=self.vllm_url,  # now, not when the flow builds its sampling run
                             vllm_max_model_len=self.vllm_max_model_len,
                             vllm_gpu_memory_utilization=self.vllm_gpu_memory_utilization)
        if self.ks is None:
            return self
        if not self.ks or max(self.ks) > self.n or min(self.ks) < 1:
            raise ValueError(f"ks {list(self.ks)}: expected values in 1..n={self.n}")
        if len(set(self.ks)) < len(self.ks):  # each K is one row of eval_results
            raise ValueError(f"ks {list(self.ks)}: each K may appear once")
        return self

    @property
    def k_values(self) -> tuple[int, ...]:
        """`ks`, or its default for n."""
        if self.ks is not None:
            return self.ks
        return tuple(k for k in sorted({2**i for i in range(self.n.bit_length())} | {self.n}) if k <= self.n)

    @property
    def label(self) -> str:
        return self.model_name or self.model_path

    @property
    def sample_config(self) -> SampleConfig:
        """The sampling run this evaluation reads (verifier reward; resumable like any sampling run)."""
        return SampleConfig(
            model_path=self.model_path, problems_source=self.problems_source, split=self.split,
            max_problems=self.max_problems, n=self.n, max_new_tokens=self.max_new_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, chat_template=self.chat_template,
            backend=self.backend, vllm_url=self.vllm_url, vllm_max_model_len=self.vllm_max_model_len,
            vllm_gpu_memory_utilization=self.vllm_gpu_memory_utilization, device=self.device,
            batch_size=self.batch_size,
            policy_name=self.label, trust_remote_code=self.trust_remote_code,
        )


class PipelineEvalConfig(EvalConfig):
    """A pipeline's `eval` section: the settings every model of its eval_models is evaluated with; each model is a
    stage's output, named after the stage (`PipelineConfig.eval_config`)."""

    model_path: str | None = None
    """Not set in a pipeline: the stages of eval_models give the models."""

    @model_validator(mode="after")
    def _models_come_from_the_stages(self):
        for field in ("model_path", "model_name"):
            if getattr(self, field) is not None:
                raise ValueError(f"{field}: a pipeline evaluates the output of each stage in eval_models, named after "
                                 f"the stage; leave {field} out (`alignflow eval --model DIR` evaluates a given model)")
        return self
