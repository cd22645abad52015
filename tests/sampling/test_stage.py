"""The sampling stage: rows in the samples table, rewards and verifier, crash + resume = one uninterrupted
run with no duplicate rows, the run id, chat templates, one-line errors."""

from __future__ import annotations

import shutil
import subprocess
import sys

import polars as pl
import pytest

from pipeline_lib.config import SampleConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.model_dirs import ModelLoadError
from pipeline_lib.models import RewardModel, load_tokenizer
from pipeline_lib.sampling.base import Completion, SamplingError
from pipeline_lib.sampling import stage as stage_module
from pipeline_lib.sampling.stage import (
    build_reward_fn,
    chat_renderer,
    run_sample_stage,
    sample_problems,
    sample_run_id,
    select_problems,
)
from pipeline_lib.store.db import StoreError, open_store

KEY = ["prompt_id", "sample_idx"]


class GoldEveryOtherSampler:
    """Sample j of a prompt is the gold answer when j is even, else "0" (the demo sums are never 0)."""

    def __init__(self, answers: dict[str, str]):
        self.answers = answers

    def generate(self, prompts, *, n, max_new_tokens, temperature=1.0, top_p=1.0, seed=None, stop=(),
                 logprobs=False):
        return [[Completion(text=self.answers[p] if j % 2 == 0 else "0", token_ids=[3] * (j + 1),
                            finish_reason="stop") for j in range(n)] for p in prompts]


class CrashAfter:
    """Delegates to a real sampler and raises on call number `calls + 1` (a crash mid-run)."""

    def __init__(self, sampler, calls: int):
        self.sampler, self.left = sampler, calls

    def generate(self, prompts, **kwargs):
        if self.left == 0:
            raise RuntimeError("simulated crash")
        self.left -= 1
        return self.sampler.generate(prompts, **kwargs)


def _sample(sampler, problems, store, run_id="run", **overrides):
    kwargs = dict(run_id=run_id, n=4, reward_fn=build_reward_fn(SampleConfig(model_path="m")), policy_name="tiny",
                  batch_size=2, max_new_tokens=6, seed=0, progress=False)
    return sample_problems(sampler, problems, store, **(kwargs | overrides))


def test_rows_rewards_and_accuracy_with_known_completions(store, problems):
    answers = dict(zip(problems["prompt"], problems["answer"]))
    report = _sample(GoldEveryOtherSampler(answers), problems, store)
    rows = store.read("samples", run_id="run").sort(KEY)
    assert rows.height == 6 * 4 == report.rows_written_now == report.n_rows
    assert rows["sample_idx"].to_list() == [0, 1, 2, 3] * 6
    assert rows["is_correct"].to_list() == [True, False, True, False] * 6
    assert rows["reward"].to_list() == [1.0, 0.0, 1.0, 0.0] * 6  # verifier weight 1
    assert rows["n_tokens"].to_list() == [1, 2, 3, 4] * 6
    assert set(rows["policy"]) == {"tiny"} and set(rows["finish_reason"]) == {"stop"}
    assert rows.filter(pl.col("prompt_id") == "demo-03")["prompt"].to_list() == ["04+21="] * 4
    assert report.accuracy == 0.5 and report.mean_reward == 0.5 and report.mean_tokens == 2.5
    assert report.truncated_fraction == 0.0 and report.tokens_now == 6 * (1 + 2 + 3 + 4)


def test_weighted_reward_spec_adds_overlong_shaping(store, problems):
    answers = dict(zip(problems["prompt"], problems["answer"]))
    cfg = SampleConfig(model_path="m", rewards=[{"name": "verifier", "weight": 2.0},
                                                {"name": "overlong", "weight": 1.0, "max_len": 4, "cache_len": 2}])
    _sample(GoldEveryOtherSampler(answers), problems, store, reward_fn=build_reward_fn(cfg))
    rows = store.read("samples", run_id="run").sort(KEY)
    # lengths 1..4 with max_len 4, cache 2: penalty 0 up to 2 tokens, -(3-2)/2 = -0.5 at 3, -(4-2)/2 = -1 at 4
    assert rows["reward"].to_list() == [2.0, 0.0, 2.0 - 0.5, 0.0 - 1.0] * 6


class ReadsTheStoreMeanwhile:
    """Delegates to a sampler; during each batch another process opens the store (no waiting) and counts its
    problems, as `alignflow data stats` would while a stage samples."""

    def __init__(self, sampler, store_path, subprocess_env):
        self.sampler, self.store_path, self.env, self.counts = sampler, store_path, subprocess_env, []

    def generate(self, prompts, **kwargs):
        script = ("import sys; from pipeline_lib.store.db import open_store\n"
                  "with open_store(sys.argv[1], read_only=True, wait=0) as store: print(store.count('problems'))")
        reader = subprocess.run([sys.executable, "-c", script, str(self.store_path)], capture_output=True, text=True,
                                env=self.env, timeout=120)
        assert reader.returncode == 0, reader.stderr.strip().splitlines()[-1]
        self.counts.append(int(reader.stdout))
        return self.sampler.generate(prompts, **kwargs)


def test_other_processes_read_the_store_while_a_batch_samples(workspace, store, problems, subprocess_env):
    """The stage holds the store file (DuckDB lets one process have it) only between batches: a reader that would
    have failed with 'in use by another alignflow process' reads it during every batch; the rows are all written."""
    answers = dict(zip(problems["prompt"], problems["answer"]))
    sampler = ReadsTheStoreMeanwhile(GoldEveryOtherSampler(answers), workspace.store_path, subprocess_env)
    report = _sample(sampler, problems, store, batch_size=3)
    assert sampler.counts == [problems.height] * 2 and report.n_rows == 6 * 4


def test_crash_then_resume_equals_one_uninterrupted_run(workspace, tmp_path, problems, hf_sampler):
    with open_store(workspace.store_path) as store:
        store.insert_new("problems", problems)
        with pytest.raises(RuntimeError, match="simulated crash"):
            _sample(CrashAfter(hf_sampler, calls=2), problems, store)  # 3 batches of 2: the third crashes
        assert store.sampled_prompt_ids("run") == {"demo-00", "demo-01", "demo-02", "demo-03"}
        resumed = _sample(hf_sampler, problems, store)
        assert (resumed.prompts_skipped, resumed.prompts_sampled_now, resumed.rows_written_now) == (4, 2, 8)
        again = _sample(hf_sampler, problems, store)
        assert (again.prompts_skipped, again.rows_written_now, again.n_rows) == (6, 0, 24)
        crashed = store.read("samples", run_id="run")
    with open_store(tmp_path / "other.duckdb") as other:
        _sample(hf_sampler, problems, other)
        straight = other.read("samples", run_id="run")
    columns = ["prompt_id", "sample_idx", "completion", "n_tokens", "finish_reason", "reward", "is_correct"]
    assert crashed.height == crashed.select(KEY).unique().height == 24
    assert crashed.select(columns).sort(KEY).equals(straight.select(columns).sort(KEY))


def test_run_sample_stage_from_config(store, tiny_model_dir, monkeypatch):
    cfg = SampleConfig(model_path=str(tiny_model_dir), problems_source="demo", max_problems=4, n=2,
                       max_new_tokens=6, batch_size=3, device="cpu")
    report = run_sample_stage(cfg, store, progress=False)
    rows = store.read("samples", run_id=report.run_id)
    assert report.run_id == sample_run_id(cfg, [f"demo-0{i}" for i in range(4)]) and report.run_id.startswith("sample-")
    assert sorted(set(rows["prompt_id"])) == ["demo-00", "demo-01", "demo-02", "demo-03"]
    assert rows.height == 8 and report.n_rows == 8 and rows["n_tokens"].max() <= 6
    assert set(rows["policy"]) == {str(tiny_model_dir)}
    assert report.tokens_now == rows["n_tokens"].sum() and report.tokens_per_s > 0
    # a rerun of the same config resumes the same run: nothing new, and with nothing left it opens no sampler (a
    # vLLM server for every model of an `--force eval`) and loads no reward model
    def refused(*args, **kwargs):
        raise AssertionError("a run holding every prompt opened a sampler or built its rewards")

    monkeypatch.setattr(stage_module, "open_sampler", refused)
    monkeypatch.setattr(stage_module, "build_reward_fn", refused)
    again = run_sample_stage(cfg, store, progress=False)
    assert again.rows_written_now == 0 and (again.run_id, again.n_rows, again.mean_reward, again.accuracy) == \
        (report.run_id, report.n_rows, report.mean_reward, report.accuracy)


IDS = ["p0", "p1", "p2"]


def test_run_id_follows_sampling_config_and_model_weights(tiny_model_dir, tmp_path):
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")
    cfg = SampleConfig(model_path=str(model_dir), n=4)
    assert sample_run_id(cfg, IDS) == sample_run_id(SampleConfig(model_path=str(model_dir), n=4, device="cpu"), IDS)
    assert sample_run_id(cfg, IDS) != sample_run_id(cfg.model_copy(update={"seed": 1}), IDS)
    assert sample_run_id(cfg, IDS) != sample_run_id(cfg.model_copy(update={"n": 8}), IDS)
    assert sample_run_id(cfg, IDS) != sample_run_id(cfg.model_copy(update={"max_problems": 2}), IDS)  # other batches
    assert sample_run_id(cfg.model_copy(update={"backend": "vllm", "vllm_gpu_memory_utilization": 0.5}), IDS) == \
        sample_run_id(cfg.model_copy(update={"backend": "vllm"}), IDS)  # where the KV cache fits, not the samples
    assert sample_run_id(cfg.model_copy(update={"run_id": "mine"}), IDS) == "mine"
    elsewhere = shutil.copytree(model_dir, tmp_path / "elsewhere")  # the same model at another path: the same run
    assert sample_run_id(cfg.model_copy(update={"model_path": str(elsewhere)}), IDS) == sample_run_id(cfg, IDS)
    # the problems: without max_problems a new one extends the run; with it, another selection is another run
    assert sample_run_id(cfg, [*IDS, "p3"]) == sample_run_id(cfg, IDS)
    capped = cfg.model_copy(update={"max_problems": 2})
    assert sample_run_id(capped, ["p0", "p1"]) != sample_run_id(capped, ["p0", "p3"])
    before = sample_run_id(cfg, IDS)
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # "retrained" in place: one weight byte differs
    weights.write_bytes(bytes(data))
    assert sample_run_id(cfg, IDS) != before
    # the reward model scoring the samples is part of the run too: replaced in place, a new run
    scored = cfg.model_copy(update={"rewards": ({"name": "reward_model"},), "reward_model_path": str(tiny_model_dir)})
    rm_before = sample_run_id(scored, IDS)
    assert rm_before != sample_run_id(cfg, IDS)
    assert sample_run_id(scored.model_copy(update={"reward_model_path": str(model_dir)}), IDS) != rm_before


def test_chat_template_renders_prompts_and_keeps_the_raw_prompt(store, tiny_model_dir):
    render = chat_renderer(str(tiny_model_dir))
    assert render("12+34=") == "<|user|>12+34=</s><|assistant|>"
    cfg = SampleConfig(model_path=str(tiny_model_dir), max_problems=2, n=2, max_new_tokens=4, chat_template=True,
                       device="cpu")
    report = run_sample_stage(cfg, store, progress=False)
    rows = store.read("samples", run_id=report.run_id)
    assert set(rows["prompt"]) == {"97+70=", "36+31="}
    assert rows["chat_template"].to_list() == [True] * 4  # what West-of-N reads to store conversations
    store._run("UPDATE samples SET chat_template = NULL")  # as sampled before the store recorded it (schema v1)
    assert run_sample_stage(cfg, store, progress=False).prompts_skipped == 2  # a rerun samples nothing...
    assert store.read("samples", run_id=report.run_id)["chat_template"].to_list() == [True] * 4  # ...but records it
    plain = run_sample_stage(cfg.model_copy(update={"chat_template": False}), store, progress=False)
    assert store.read("samples", run_id=plain.run_id)["chat_template"].to_list() == [False] * 4


def test_rewards_score_the_text_the_model_read(store, problems):
    """With a renderer (chat template) the reward sees the rendered prompt + completion, as GRPO and PPO do;
    the table keeps the problem's own prompt."""
    seen: list[str] = []

    def recording_reward(prompts, completions, *, answers, lengths):
        seen.extend(p + c for p, c in zip(prompts, completions))
        return [0.0] * len(completions)

    answers = {f"<u>{p}<a>": a for p, a in zip(problems["prompt"], problems["answer"])}
    _sample(GoldEveryOtherSampler(answers), problems.head(2), store, n=2, reward_fn=recording_reward,
            render=lambda prompt: f"<u>{prompt}<a>")
    first = problems.head(2).sort("problem_id")["prompt"][0]
    assert seen[:2] == [f"<u>{first}<a>{answers[f'<u>{first}<a>']}", f"<u>{first}<a>0"]
    assert set(store.read("samples", run_id="run")["prompt"]) == set(problems.head(2)["prompt"])


def test_an_explicit_run_id_reused_with_another_n_is_a_one_line_error(store, problems):
    """Resuming would skip every prompt and keep 4 samples each where the config asks for 6."""
    answers = dict(zip(problems["prompt"], problems["answer"]))
    _sample(GoldEveryOtherSampler(answers), problems, store, run_id="fixed", n=4)
    with pytest.raises(SamplingError, match=r"^run_id 'fixed' holds 4 samples per prompt, this config asks n=6; "):
        _sample(GoldEveryOtherSampler(answers), problems, store, run_id="fixed", n=6)
    assert _sample(GoldEveryOtherSampler(answers), problems, store, run_id="fixed", n=4).rows_written_now == 0


def test_an_explicit_run_id_reused_with_another_policy_is_a_one_line_error(store, tiny_model_dir):
    """An explicit run_id sampled again from another model resumed the first one's run: "cached, nothing sampled",
    its rows still the first policy's. A derived run id keeps sharing: the same model under another name."""
    cfg = SampleConfig(model_path=str(tiny_model_dir), problems_source="demo", max_problems=2, n=2,
                       max_new_tokens=4, device="cpu", run_id="fixed")
    assert run_sample_stage(cfg, store, progress=False).rows_written_now == 4
    dpo = cfg.model_copy(update={"policy_name": "dpo"})
    with pytest.raises(SamplingError, match=rf"^run_id 'fixed' holds samples of another policy than 'dpo'; sample "
                                            rf"into another run_id \(or leave run_id unset"):
        run_sample_stage(dpo, store, progress=False)
    assert run_sample_stage(cfg, store, progress=False).rows_written_now == 0
    derived = cfg.model_copy(update={"run_id": None})
    first = run_sample_stage(derived, store, progress=False)
    renamed = run_sample_stage(derived.model_copy(update={"policy_name": "again"}), store, progress=False)
    assert (renamed.run_id, renamed.rows_written_now) == (first.run_id, 0)


def test_an_explicit_run_id_reused_with_other_sampling_settings_is_a_one_line_error(store, tiny_model_dir):
    """Another temperature (a helper), max_new_tokens, seed... resumed the run: "cached, nothing sampled", or new
    rows drawn otherwise than the old ones. A run that holds no samples yet takes the new settings."""
    cfg = SampleConfig(model_path=str(tiny_model_dir), problems_source="demo", max_problems=2, n=2,
                       max_new_tokens=4, device="cpu", run_id="fixed")
    assert run_sample_stage(cfg, store, progress=False).rows_written_now == 4
    colder = cfg.model_copy(update={"temperature": 0.5, "max_new_tokens": 6, "max_problems": 3})
    with pytest.raises(SamplingError, match=r"^run_id 'fixed' was sampled with other settings than this config's "
                                            r"\(max_new_tokens 4 -> 6, temperature 1.0 -> 0.5\); sample into another "
                                            r"run_id \(or leave run_id unset"):
        run_sample_stage(colder, store, progress=False)
    assert store.count("samples", run_id="fixed") == 4  # nothing sampled
    more = run_sample_stage(cfg.model_copy(update={"max_problems": 3}), store, progress=False)  # the same settings
    assert more.rows_written_now == 2
    fresh = cfg.model_copy(update={"run_id": "other", "temperature": 0.5})
    store.record_run_settings("other", {"temperature": 2.0})  # recorded by a start that sampled nothing
    assert run_sample_stage(fresh, store, progress=False).rows_written_now == 4
    assert store.run_settings("other")["temperature"] == 0.5


def test_a_new_problem_among_the_first_max_problems_is_a_new_run_of_exactly_them(store, tiny_model_dir):
    """The first K problems in problem_id order change when one sorting before them is ingested: the earlier run
    must not resume on the new selection and keep the problem that left it (eval would score K + 1)."""
    cfg = SampleConfig(model_path=str(tiny_model_dir), problems_source="demo", max_problems=2, n=2,
                       max_new_tokens=4, device="cpu")
    first = run_sample_stage(cfg, store, progress=False)
    store.insert_new("problems", pl.DataFrame({"problem_id": ["demo-", "zz"], "source": "demo", "split": "test",
                                               "prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}))
    second = run_sample_stage(cfg, store, progress=False)
    assert second.run_id != first.run_id
    assert sorted(set(store.read("samples", run_id=second.run_id)["prompt_id"])) == ["demo-", "demo-00"]
    assert sorted(set(store.read("samples", run_id=first.run_id)["prompt_id"])) == ["demo-00", "demo-01"]
    store.insert_new("problems", pl.DataFrame({"problem_id": ["zzz"], "source": "demo", "split": "test",
                                               "prompt": ["3+3="], "answer": ["6"]}))
    assert run_sample_stage(cfg, store, progress=False).run_id == second.run_id  # past the first 2: the same run


def test_bad_inputs_are_one_line_errors(store, tiny_model_dir):
    with pytest.raises(StoreError, match=r"no problems rows in the store with split='train', source='nope'; it holds "):
        select_problems(store, SampleConfig(model_path="m", split="train", problems_source="nope"))
    with pytest.raises(ValueError, match="rewards\\[0\\].name: unknown reward 'bleu'"):  # when the config loads
        SampleConfig(model_path="m", rewards=[{"name": "bleu"}])
    with pytest.raises(AlignflowError, match="rewards: .*unknown reward 'bleu'"):  # and when built unvalidated
        build_reward_fn(SampleConfig.model_construct(model_path="m", rewards=[{"name": "bleu"}]))
    with pytest.raises(SamplingError, match=r"missing column\(s\) \['answer'\]"):
        _sample(GoldEveryOtherSampler({}), pl.DataFrame({"problem_id": ["a"], "prompt": ["1+1="]}), store)


def test_a_policy_and_reward_model_with_their_own_code_sample_only_with_trust_remote_code(store, tiny_model_dir,
                                                                                           tmp_path, remote_code_copy):
    """The hf backend's policy (model, tokenizer, chat template) and the reward model scoring its samples load
    through their dirs' own code: refused in one line, the code never run and no row written, unless the config
    sets trust_remote_code; then the rows are those of the same weights under the stock classes."""
    rm = RewardModel.from_policy(tiny_model_dir, device="cpu", seed=1).save_pretrained(tmp_path / "rm",
                                                                                     load_tokenizer(tiny_model_dir))
    policy, policy_ran = remote_code_copy(tiny_model_dir, tmp_path / "policy")
    reward_model, rm_ran = remote_code_copy(rm, tmp_path / "rm-remote")
    settings = dict(max_problems=2, n=2, max_new_tokens=4, chat_template=True, device="cpu",
                    rewards=({"name": "verifier"}, {"name": "reward_model"}))
    remote = SampleConfig(model_path=str(policy), reward_model_path=str(reward_model), **settings)
    with pytest.raises(ModelLoadError, match="contains custom code") as refused:
        run_sample_stage(remote, store, progress=False)
    assert "\n" not in str(refused.value) and not policy_ran.exists() and not rm_ran.exists()
    assert store.count("samples") == 0
    trusted = run_sample_stage(remote.model_copy(update={"trust_remote_code": True}), store, progress=False)
    assert policy_ran.exists() and rm_ran.exists() and trusted.n_rows == 4
    stock = run_sample_stage(SampleConfig(model_path=str(tiny_model_dir), reward_model_path=str(rm), **settings), store,
                             progress=False)
    rows = [store.read("samples", run_id=report.run_id).sort(KEY) for report in (trusted, stock)]
    assert rows[0]["completion"].to_list() == rows[1]["completion"].to_list()
    assert rows[0]["reward"].to_list() == pytest.approx(rows[1]["reward"].to_list(), abs=1e-5)
