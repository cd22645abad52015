"""The sampling stage: N samples per problem, scored by the reward spec and the verifier, written to the
`samples` table batch by batch; a rerun of the same run skips prompts already sampled (resumable)."""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import polars as pl
from tqdm.auto import tqdm

from pipeline_lib import code_version
from pipeline_lib.config import MODEL_FIELDS, SampleConfig
from pipeline_lib.fingerprint import content_id, model_fingerprint
from pipeline_lib.model_dirs import resolve_model_dir
from pipeline_lib.rewards.math import is_correct
from pipeline_lib.rewards.registry import build_reward
from pipeline_lib.sampling.base import Sampler, SamplingError
from pipeline_lib.store.db import Store
from pipeline_lib.logfns import LogFn, no_log

RewardFn = Callable[..., list[float]]
SAMPLE_SCHEMA = {
    "run_id": pl.String, "prompt_id": pl.String, "sample_idx": pl.Int32, "prompt": pl.String,
    "completion": pl.String, "n_tokens": pl.Int32, "finish_reason": pl.String, "reward": pl.Float64,
    "is_correct": pl.Boolean, "policy": pl.String, "chat_template": pl.Boolean,
}
# Fields that change where or how fast samples are made, not which samples: left out of the run id.
# settings that do not change what is sampled; max_problems does (the hf backend's random stream follows the
# batches, so the first 4 of 9 problems are batched differently from a run over all 9). The model dirs enter by
# their content's fingerprint, not their path (`MODEL_FIELDS`, as in `config_key`): the same model at another
# path resumes the same run.
_RUN_ID_EXCLUDE = {"run_id", "vllm_url", "vllm_max_model_len", "vllm_gpu_memory_utilization", "device", "policy_name",
                   *MODEL_FIELDS}


@dataclass(frozen=True)
class SampleReport:
    """What one call of the stage did (`*_now`) and what the whole run holds (the rest)."""

    run_id: str
    policy: str
    n_problems: int
    prompts_skipped: int
    prompts_sampled_now: int
    rows_written_now: int
    tokens_now: int
    generate_seconds: float
    n_rows: int
    mean_reward: float
    accuracy: float
    mean_tokens: float
    truncated_fraction: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_now / self.generate_seconds if self.generate_seconds > 0 else 0.0

    def tags(self) -> dict[str, str]:
        """The tracking run's tags naming the sampling run (the sample stage's, and an eval stage's that scores it)."""
        return {"samples.run_id": self.run_id, "samples.policy": self.policy}

    def metrics(self) -> dict[str, float]:
        return {
            "sample/prompts": self.n_problems,
            "sample/prompts_skipped": self.prompts_skipped,
            "sample/rows": self.n_rows,
            "sample/rows_written": self.rows_written_now,
            "sample/mean_reward": self.mean_reward,
            "sample/accuracy": self.accuracy,
            "sample/mean_tokens": self.mean_tokens,
            "sample/truncated_fraction": self.truncated_fraction,
            "sample/tokens_per_s": self.tokens_per_s,
        }

    def summary(self, *, cached: bool = False) -> str:
        """One line; `cached`: of a run whose rows were all in the store already (a cache hit sampled nothing)."""
        scores = f"mean reward {self.mean_reward:.3f} | accuracy {self.accuracy:.3f}"
        if cached:
            return (f"sample {self.run_id}: cached, nothing sampled: its {self.n_rows} rows ({self.n_problems} "
                    f"prompts) were already in the store | {scores}")
        return (f"sample {self.run_id}: {self.n_problems} prompts ({self.prompts_skipped} already done), "
                f"{self.rows_written_now} rows written, {self.n_rows} in the run | {scores} | "
                f"{self.tokens_per_s:,.0f} tok/s")

    def markdown(self) -> str:
        lines = ["| metric | value |", "|---|---|", f"| run_id | `{self.run_id}` |", f"| policy | `{self.policy}` |"]
        lines += [f"| {key} | {value:.4g} |" for key, value in self.metrics().items()]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def sample_problems(
    sampler: Sampler | None,
    problems: pl.DataFrame,
    store: Store,
    *,
    run_id: str,
    n: int,
    reward_fn: RewardFn | None,
    policy_name: str,
    batch_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: Sequence[str] = (),
    render: Callable[[str], str] | None = None,
    progress: bool = True,
    log: LogFn = no_log,
) -> SampleReport:
    """Sample `n` completions for each row of `problems` (problem_id, prompt, answer) into `samples`.

    Batches are cut from the problems in problem_id order and batch b is sampled with `seed + b`; a batch
    is written in one INSERT, so a crash loses at most that batch, and a rerun skips the prompts already in
    `run_id`: the resumed run holds the same rows as an uninterrupted one. `render` maps a problem's
    prompt to the text sent to the model (chat template); rewards score that text + the completion (a reward
    model trained on chat-rendered pairs reads the same form) and the table keeps the problem's own prompt, with
    `chat_template` true (West-of-N then stores its pairs as that conversation). `sampler` and `reward_fn` may be
    None where the run holds every prompt already (`run_sample_stage` then starts no server and loads no model)."""
    missing = {"problem_id", "prompt", "answer"} - set(problems.columns)
    if missing:
        raise SamplingError(f"problems: missing column(s) {sorted(missing)}")
    if batch_size < 1:
        raise SamplingError(f"batch_size={batch_size}: expected at least 1")
    problems = problems.sort("problem_id")
    ids, prompts, answers = (problems[c].to_list() for c in ("problem_id", "prompt", "answer"))
    held = store.samples_per_prompt(run_id) - {n}
    if held:  # an explicit run_id reused with another n: resuming would keep rows of the other size silently
        raise SamplingError(f"run_id {run_id!r} holds {min(held)} samples per prompt, this config asks n={n}; "
                            "sample into another run_id (or leave run_id unset: each config then has its own)")
    store.record_chat_template(run_id, render is not None)  # rows of this run sampled before the store recorded it
    done = store.sampled_prompt_ids(run_id)
    skipped = sum(pid in done for pid in ids)
    written = sampled = tokens = 0
    generate_seconds = 0.0
    bar = tqdm(total=len(ids), initial=skipped, unit="prompt", desc=f"sample {run_id}", disable=not progress)
    for b, start in enumerate(range(0, len(ids), batch_size)):
        todo = [i for i in range(start, min(start + batch_size, len(ids))) if ids[i] not in done]
        if not todo:
            continue
        texts = [render(prompts[i]) if render else prompts[i] for i in todo]
        with store.released():  # while the batch samples and scores, other processes may read the store
            began = time.perf_counter()
            outputs = sampler.generate(texts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                                       top_p=top_p, seed=seed + b, stop=stop)
            batch_seconds = time.perf_counter() - began
            if len(outputs) != len(todo) or any(len(group) != n for group in outputs):
                raise SamplingError(f"sampler returned {[len(g) for g in outputs]} samples for {len(todo)} prompts "
                                    f"x n={n}")
            rows = [(i, j, c) for i, group in zip(todo, outputs) for j, c in enumerate(group)]
            row_answers = [answers[i] for i, _, _ in rows]
            completions = [c.text for _, _, c in rows]
            lengths = [c.n_tokens for _, _, c in rows]
            sent = dict(zip(todo, texts))  # rewards score what the model read + its completion, as GRPO and PPO do
            rewards = reward_fn([sent[i] for i, _, _ in rows], completions, answers=row_answers, lengths=lengths)
        generate_seconds += batch_seconds
        row_prompts = [prompts[i] for i, _, _ in rows]
        correct = [is_correct(text, answer) for text, answer in zip(completions, row_answers)]
        frame = pl.DataFrame({
            "run_id": [run_id] * len(rows),
            "prompt_id": [ids[i] for i, _, _ in rows],
            "sample_idx": [j for _, j, _ in rows],
            "prompt": row_prompts,
            "completion": completions,
            "n_tokens": lengths,
            "finish_reason": [c.finish_reason for _, _, c in rows],
            "reward": rewards,
            "is_correct": correct,
            "policy": [policy_name] * len(rows),
            "chat_template": [render is not None] * len(rows),
        }, schema=SAMPLE_SCHEMA)
        written += store.insert_new("samples", frame)
        sampled += len(todo)
        tokens += sum(lengths)
        log({"sample/batch_mean_reward": sum(rewards) / len(rows), "sample/batch_accuracy": sum(correct) / len(rows),
             "sample/batch_tokens_per_s": sum(lengths) / max(batch_seconds, 1e-9)}, b)
        bar.update(len(todo))
    bar.close()
    return _report(store, run_id, policy_name, len(ids), skipped, sampled, written, tokens, generate_seconds)


def _report(store: Store, run_id: str, policy: str, n_problems: int, skipped: int, sampled: int, written: int,
            tokens: int, generate_seconds: float) -> SampleReport:
    """Run-level numbers come from the table, so a resumed run reports on all of its rows."""
    rows = store.read("samples", run_id=run_id)
    stats = rows.select(
        pl.col("reward").mean().alias("mean_reward"),
        pl.col("is_correct").cast(pl.Float64).mean().alias("accuracy"),
        pl.col("n_tokens").cast(pl.Float64).mean().alias("mean_tokens"),
        (pl.col("finish_reason") == "length").cast(pl.Float64).mean().alias("truncated_fraction"),
    ).row(0, named=True) if rows.height else {}
    return SampleReport(
        run_id=run_id, policy=policy, n_problems=n_problems, prompts_skipped=skipped,
        prompts_sampled_now=sampled, rows_written_now=written, tokens_now=tokens,
        generate_seconds=generate_seconds, n_rows=rows.height,
        mean_reward=float(stats.get("mean_reward") or 0.0), accuracy=float(stats.get("accuracy") or 0.0),
        mean_tokens=float(stats.get("mean_tokens") or 0.0),
        truncated_fraction=float(stats.get("truncated_fraction") or 0.0),
    )


# ---- the stage from its config (what the Prefect task calls)


def sample_run_id(cfg: SampleConfig, problem_ids: Sequence[str]) -> str:
    """cfg.run_id, else `sample-<hash>` of the sampling-relevant config fields, the fingerprints of the
    policy and (when set) the reward model that scores the samples, and alignflow's version and code.

    With max_problems, also the ids of the problems it selected (`problem_ids`): problems ingested since can
    make the first K others, and the run of the earlier K must not resume on them and keep the ones that left
    (its rows would no longer be the first K). Without it a new problem extends the same run."""
    if cfg.run_id:
        return cfg.run_id
    fields = cfg.model_dump(mode="json", exclude=_RUN_ID_EXCLUDE)
    key = {"config": fields, "model": model_fingerprint(cfg.model_path), "alignflow": code_version()}
    if cfg.reward_model_path:
        key["reward_model"] = model_fingerprint(cfg.reward_model_path)
    if cfg.max_problems is not None:
        key["problems"] = content_id(*problem_ids)
    text = json.dumps(key, sort_keys=True)
    return "sample-" + hashlib.sha256(text.encode()).hexdigest()[:12]


# What decides a run's samples beyond its n and policy (checked from its rows): an explicit run_id reused with
# another value resumed the run, its new rows drawn otherwise than its old ones (a helper: another temperature)
RUN_SETTINGS = ("max_new_tokens", "temperature", "top_p", "seed", "stop", "chat_template", "backend", "batch_size",
                "rewards")


def check_run_settings(store: Store, run_id: str, cfg: SampleConfig) -> None:
    """Record the settings of an explicit run that holds no samples yet; refuse, in one line naming each difference,
    to resume one sampled with others."""
    settings = cfg.model_dump(mode="json", include=set(RUN_SETTINGS))
    held = store.run_settings(run_id)
    if held is None or not store.count("samples", run_id=run_id):  # new, or sampled before settings were recorded
        store.record_run_settings(run_id, settings)
        return
    changed = [f"{name} {held.get(name)!r} -> {settings[name]!r}" for name in RUN_SETTINGS
               if held.get(name) != settings[name]]
    if changed:
        raise SamplingError(f"run_id {run_id!r} was sampled with other settings than this config's ("
                            f"{', '.join(changed)}); sample into another run_id (or leave run_id unset: each config "
                            "then has its own)")


def select_problems(store: Store, cfg: SampleConfig) -> pl.DataFrame:
    """The config's problems (split, source), in problem_id order, the first `max_problems` of them."""
    problems = store.read_selected("problems", split=cfg.split, source=cfg.problems_source).sort("problem_id")
    return problems.head(cfg.max_problems) if cfg.max_problems else problems


def build_reward_fn(cfg: SampleConfig) -> RewardFn:
    """The total of cfg.rewards' weighted sum (the per-component values are not stored per sample)."""
    combined = build_reward(cfg.rewards, reward_model_path=cfg.reward_model_path, device=cfg.device,
                            chat_prompts=cfg.chat_template, trust_remote_code=cfg.trust_remote_code)

    def reward_fn(prompts: list[str], completions: list[str], *, answers: list[str | None],
                  lengths: list[int]) -> list[float]:
        return combined(prompts, completions, answers=answers, lengths=lengths)[0]

    return reward_fn


@contextmanager
def open_sampler(cfg: SampleConfig) -> Iterator[Sampler]:
    """The config's backend: in-process HF, a vLLM server started for the run (stopped after), or the
    vLLM server at cfg.vllm_url. A chat-rendered prompt already holds its special tokens."""
    add_special_tokens = not cfg.chat_template
    if cfg.backend == "hf":
        from pipeline_lib.sampling.hf import HFSampler

        yield HFSampler.from_pretrained(cfg.model_path, device=cfg.device, add_special_tokens=add_special_tokens,
                                        trust_remote_code=cfg.trust_remote_code)
        return
    from pipeline_lib.models import load_tokenizer
    from pipeline_lib.sampling.vllm import VLLMSampler, VLLMServer, memory_share

    tokenizer = load_tokenizer(cfg.model_path, trust_remote_code=cfg.trust_remote_code)
    if cfg.vllm_url:
        sampler = VLLMSampler(cfg.vllm_url, tokenizer=tokenizer, add_special_tokens=add_special_tokens)
        if sampler.model_root is not None and Path(sampler.model_root).resolve() != resolve_model_dir(cfg.model_path):
            warnings.warn(f"vLLM server {cfg.vllm_url} serves {sampler.model_root}, not model_path {cfg.model_path}: "
                          "its samples are recorded as model_path's (run id, policy); point vllm_url at a server of "
                          "model_path or set model_path to the model it serves", UserWarning, stacklevel=2)
        try:
            yield sampler
        finally:
            sampler.close()
        return
    with VLLMServer(cfg.model_path, max_model_len=cfg.vllm_max_model_len, trust_remote_code=cfg.trust_remote_code,
                    gpu_memory_utilization=cfg.vllm_gpu_memory_utilization or memory_share(beside_trainer=False)) \
            as server:
        sampler = server.sampler(tokenizer=tokenizer, add_special_tokens=add_special_tokens)
        try:
            yield sampler
        finally:
            sampler.close()


def chat_renderer(model_path: str, *, trust_remote_code: bool = False) -> Callable[[str], str]:
    """Prompt -> the tokenizer's chat template applied to one user turn, opening the assistant turn."""
    from pipeline_lib.models import load_tokenizer

    tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
    if not tokenizer.chat_template:
        raise SamplingError(f"chat_template=True but the tokenizer in {model_path} has no chat template")

    def render(prompt: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)

    return render


def run_sample_stage(cfg: SampleConfig, store: Store, *, log: LogFn = no_log, progress: bool = True) -> SampleReport:
    """The whole stage from its config: problems, reward, backend, then `sample_problems`. A run that holds every
    prompt already (an eval whose results left the store, `--force eval`) starts no vLLM server and loads no model."""
    problems = select_problems(store, cfg)
    ids = problems["problem_id"].to_list()
    run_id = sample_run_id(cfg, ids)
    policy = cfg.policy_name or cfg.model_path
    if cfg.run_id and store.count("samples", run_id=run_id) > store.count("samples", run_id=run_id, policy=policy):
        # (a derived run id holds its model's content: the same model under another name shares its samples)
        raise SamplingError(f"run_id {run_id!r} holds samples of another policy than {policy!r}; sample into "
                            "another run_id (or leave run_id unset: each model and config then has its own)")
    if cfg.run_id:  # a derived run id hashes the settings: another value is another run
        check_run_settings(store, run_id, cfg)
    left = not set(ids) <= store.sampled_prompt_ids(run_id)
    with ExitStack() as stack:
        with store.released():  # other processes may read the store while the models load (a vLLM server starts)
            render = (chat_renderer(cfg.model_path, trust_remote_code=cfg.trust_remote_code)
                      if cfg.chat_template else None)
            reward_fn = build_reward_fn(cfg) if left else None
            sampler = stack.enter_context(open_sampler(cfg)) if left else None
        return sample_problems(
            sampler, problems, store, run_id=run_id, n=cfg.n, reward_fn=reward_fn,
            policy_name=policy, batch_size=cfg.batch_size,
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
            stop=cfg.stop, render=render, progress=progress, log=log,
        )
