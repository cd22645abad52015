"""SFT loop: loss on completion tokens only (checked against a hand-built NLL), a 2-step run changes the
weights, gradient accumulation gives the same update, the NaN guard, dataset builders; slow: held-out
Pass@1 on the demo task, and rejection-sampling SFT (Best-of-N -> SFT) raising it."""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from pipeline_lib.config import ConfigError, SFTConfig
from pipeline_lib.filters import best_of_n
from pipeline_lib.models import build_tiny_model, load_policy, load_tokenizer
from pipeline_lib.rewards.math import is_correct
from pipeline_lib.sampling.hf import HFSampler
from pipeline_lib.train.common import FINAL_MARKER, Dist, NonFiniteLossError, OtherRunError, batches, check_batch_split
from pipeline_lib.train.data import TrainDataError, collate, encode_frame
from pipeline_lib.train import sft as sft_module
from pipeline_lib.train.sft import sft_rows, train_sft

DEMO = Path(__file__).resolve().parents[2] / "data" / "demo"


def arithmetic_rows(n: int, seed: int = 0) -> pl.DataFrame:
    rng = random.Random(seed)
    pairs = [(rng.randrange(100), rng.randrange(100)) for _ in range(n)]
    return pl.DataFrame({"prompt": [f"{a:02d}+{b:02d}=" for a, b in pairs],
                         "completion": [str(a + b) for a, b in pairs]})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sft") / "base", ["0123456789+=", "no idea!"],
                            hidden_size=64, num_heads=2, intermediate_size=128)


def test_sft_rows_from_each_source():
    problems = pl.DataFrame({"problem_id": ["p", "g", "e"], "prompt": ["1+1=", "Two apples and one more?", "2+2="],
                             "answer": ["2", "3", "4"], "split": ["train"] * 3,
                             "meta": [None, '{"solution":"2 + 1 = <<2+1=3>>3\\n#### 3"}', '{"solution":" "}']})
    assert sft_rows(problems, "problems").to_dicts() == [  # GSM8K: the worked solution, not the bare number
        {"prompt": "1+1=", "completion": "2"},
        {"prompt": "Two apples and one more?", "completion": "2 + 1 = <<2+1=3>>3\n#### 3"},
        {"prompt": "2+2=", "completion": "4"}]  # a blank solution is no solution
    messages = '[{"role": "user", "content": "q"}]'
    pairs = pl.DataFrame({"prompt": ["q"], "chosen": ["good"], "rejected": ["bad"], "prompt_messages": [messages]})
    assert sft_rows(pairs, "pairs").to_dicts() == [
        {"prompt": "q", "completion": "good", "prompt_messages": messages}]
    mixed = pl.concat([pairs, pairs.with_columns(prompt=pl.lit("plain"), prompt_messages=pl.lit(None, pl.String))])
    assert sft_rows(mixed, "pairs", chat_template=True)["prompt_messages"].to_list() == [
        messages, '[{"role": "user", "content": "plain"}]']  # a plain pair beside conversations: one user turn
    samples = pl.DataFrame({"prompt_id": ["a", "a", "b"], "sample_idx": [0, 1, 0], "prompt": ["1+1=", "1+1=", "2+2="],
                            "completion": ["3", "2", "4"], "reward": [0.0, 1.0, 1.0]})
    assert sft_rows(best_of_n(samples), "best_of_n").to_dicts() == [
        {"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "4"}]
    with pytest.raises(TrainDataError, match=r"sft data=pairs: missing column\(s\) \['chosen'\]"):
        sft_rows(problems, "pairs")


def test_two_steps_change_the_weights_and_log_the_completion_nll(tiny, tmp_path, collect):
    rows = arithmetic_rows(32)
    cfg = SFTConfig(model_path=str(tiny), max_steps=2, batch_size=8, lr=1e-2, log_every=1, device="cpu")
    logged, log = collect()
    final = train_sft(cfg, rows, tmp_path / "out", log=log, eval_rows=arithmetic_rows(8, seed=1))
    assert final == tmp_path / "out" / "final"
    assert not (tmp_path / "out" / "checkpoint").exists()
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every weight trained
    # the final's config is its start's: training's use_cache false was saved with it, so a plain forward of the
    # final returned no cache
    assert json.loads((final / "config.json").read_text())["use_cache"] is True
    steps = [step for step, _ in logged]
    assert steps == [0, 1, 2, 2]  # eval before, two train steps, eval after
    train = [m for _, m in logged if "train/loss" in m]
    assert all(np.isfinite(list(m.values())).all() for _, m in logged)
    assert train[0]["train/lr"] == pytest.approx(1e-2)

    # the first logged loss is the token-mean NLL of the first batch's completion tokens (answer + eos)
    # under the starting model: no prompt token counts
    tokenizer, model = load_tokenizer(tiny), load_policy(tiny, device="cpu")
    encoded = encode_frame(tokenizer, rows, "completion", max_length=cfg.max_length)
    _, first = next(batches(len(encoded), 8, seed=cfg.seed))
    batch = collate(encoded, first, pad_id=tokenizer.pad_token_id)
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch.input_ids[:, 1:], reduction="none")
    mask = batch.completion_mask[:, 1:].bool()
    assert mask.sum() == sum(len(encoded.completion_ids[i]) for i in first)
    assert train[0]["train/loss"] == pytest.approx(float(nll[mask].mean()), rel=1e-5)
    assert json.loads((final / FINAL_MARKER).read_text())["metrics"]["eval/loss"] == logged[-1][1]["eval/loss"]

    # a rerun on the finished dir trains nothing and logs the stored final metrics once, at the last step
    rerun_logged, rerun_log = collect()
    assert train_sft(cfg, rows, tmp_path / "out", log=rerun_log) == final
    assert rerun_logged == [(2, json.loads((final / FINAL_MARKER).read_text())["metrics"])]


def test_chat_rows_train_and_evaluate_ending_with_the_turn_end_the_model_stops_on(chatml, tmp_path, collect):
    """An instruct model (ChatML, stopping on `<|im_end|>`): SFT's eval/loss before training is the NLL of the
    chat rows ending with `<|im_end|>`, the token its sampler stops on, not of rows ending with eos."""
    turns = [json.dumps([{"role": "user", "content": prompt}]) for prompt in arithmetic_rows(8, seed=1)["prompt"]]
    eval_rows = arithmetic_rows(8, seed=1).with_columns(prompt_messages=pl.Series(turns))
    logged, log = collect()
    cfg = SFTConfig(model_path=str(chatml), chat_template=True, max_steps=1, batch_size=4, device="cpu")
    train_sft(cfg, arithmetic_rows(8), tmp_path / "out", log=log, eval_rows=eval_rows)
    tokenizer, model = load_tokenizer(chatml), load_policy(chatml, device="cpu")
    stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}

    def nll(stops: set[int]) -> float:
        return sft_module.completion_nll(model, encode_frame(tokenizer, eval_rows, "completion", max_length=256,
                                                             stops=stops), pad_id=tokenizer.pad_token_id,
                                         device=torch.device("cpu"))

    assert logged[0] == (0, {"eval/loss": pytest.approx(nll(stops), rel=1e-5)})
    assert nll(stops) != pytest.approx(nll({tokenizer.eos_token_id}), rel=1e-3)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_rows_past_the_models_learned_positions_are_cut_to_them_with_a_note(short_positions, family, tmp_path,
                                                                            capsys, collect):
    """GPT-2 and OPT raise IndexError past their 16 positions (it crashed here under the default max_length 256):
    rows are cut to 16 tokens as max_length 16 would cut them, with one note, and the run trains."""
    model_path = short_positions[family]
    rows = pl.concat([arithmetic_rows(6), pl.DataFrame({"prompt": ["12+34+" * 8 + "56=", "1+" * 20 + "1="],
                                                        "completion": ["102", "21"]})])
    logged, log = collect()
    capsys.readouterr()
    final = train_sft(SFTConfig(model_path=str(model_path), max_steps=2, batch_size=4, lr=1e-3, device="cpu"), rows,
                      tmp_path / "out", log=log)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("note:", "warning:"))]
    assert notes == ["note: 2 of 8 rows are cut to the model's 16 positions (under max_length 256): prompts lose "
                     "their first tokens, then completions their last"]
    assert final == tmp_path / "out" / "final" and np.isfinite(logged[-1][1]["train/loss"])
    tokenizer = load_tokenizer(model_path)
    encoded = encode_frame(tokenizer, rows, "completion", max_length=256, positions=16)
    assert encoded == encode_frame(tokenizer, rows, "completion", max_length=16)
    assert max(len(p) + len(c) for p, c in zip(encoded.prompt_ids, encoded.completion_ids)) == 16


def test_gradient_accumulation_gives_the_same_update(tiny, tmp_path, collect):
    """Same global batch of 8 as one micro-batch or as 4 of 2: the same loss and gradient norm (Adam would
    hide a gradient scale error, the norm does not), and weights within 1% of one Adam step."""
    rows = arithmetic_rows(16)
    base = dict(model_path=str(tiny), max_steps=2, batch_size=8, lr=1e-3, log_every=1, device="cpu")
    (one_log, log_one), (four_log, log_four) = collect(), collect()
    one = train_sft(SFTConfig(**base), rows, tmp_path / "one", log=log_one)
    four = train_sft(SFTConfig(**base, grad_accum_steps=4), rows, tmp_path / "four", log=log_four)
    for (_, m1), (_, m4) in zip(one_log, four_log, strict=True):
        assert m4["train/loss"] == pytest.approx(m1["train/loss"], rel=1e-6)
        assert m4["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-5)
    a, b = load_file(str(one / "model.safetensors")), load_file(str(four / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-2 * 1e-3


def test_an_interrupted_run_resumes_under_a_new_checkpoint_interval(tiny, tmp_path, collect):
    """save_every changes how a run is kept, not what it trains: a run stopped after step 2's checkpoint and
    rerun with another interval resumes from it (not step 0) and ends with the uninterrupted weights; the finished
    model is then reused under a third interval. log_every changes the logged curves: another run."""
    class Stop(Exception):
        pass

    def stop_at_3(metrics, step):
        if step == 3:
            raise Stop

    rows = arithmetic_rows(32)
    base = dict(model_path=str(tiny), max_steps=4, batch_size=8, lr=1e-2, log_every=1, device="cpu")
    full = train_sft(SFTConfig(**base, save_every=1), rows, tmp_path / "full")
    with pytest.raises(Stop):
        train_sft(SFTConfig(**base, save_every=1), rows, tmp_path / "cut", log=stop_at_3)
    logged, log = collect()
    resumed = train_sft(SFTConfig(**base, save_every=3), rows, tmp_path / "cut", log=log)
    assert [step for step, _ in logged] == [3, 4]  # from step 2's checkpoint
    a, b = load_file(str(full / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    marker = (resumed / FINAL_MARKER).read_text()
    assert train_sft(SFTConfig(**base, save_every=7), rows, tmp_path / "cut") == resumed
    assert (resumed / FINAL_MARKER).read_text() == marker  # reused, not trained again
    with pytest.raises(OtherRunError, match="another run"):
        train_sft(SFTConfig(**{**base, "log_every": 2}, save_every=1), rows, tmp_path / "cut")


def test_nan_loss_stops_with_the_step_and_no_final_model(tiny, tmp_path):
    """lr 1e30: Adam's first update moves every weight by ~1e30, so within the next steps a loss or a gradient
    is not finite (the gradient at step 2 with this model and data)."""
    cfg = SFTConfig(model_path=str(tiny), max_steps=5, batch_size=8, lr=1e30, max_grad_norm=None, save_every=1,
                    device="cpu")
    with pytest.raises(NonFiniteLossError, match=r"train/(loss|grad_norm) is (nan|inf) at step [1-5]; stopping"):
        train_sft(cfg, arithmetic_rows(16), tmp_path / "out")
    assert not (tmp_path / "out" / "final").exists() and not (tmp_path / "out" / ".final.tmp").exists()


def test_a_non_finite_gradient_under_a_finite_loss_stops_before_the_update(tiny, tmp_path, monkeypatch):
    """A NaN gradient in the last step (its loss finite) would step every weight to NaN into the final model,
    seen by no later loss; the guard on the gradient norm stops before optimizer.step."""
    def load_with_a_nan_gradient(*args, **kwargs):
        model = load_policy(*args, **kwargs)
        backwards = itertools.count()
        model.get_input_embeddings().weight.register_hook(lambda g: g * float("nan") if next(backwards) == 2 else g)
        return model

    monkeypatch.setattr(sft_module, "load_policy", load_with_a_nan_gradient)
    cfg = SFTConfig(model_path=str(tiny), max_steps=3, batch_size=8, save_every=1, device="cpu")
    with pytest.raises(NonFiniteLossError, match=r"^train/grad_norm is nan at step 3; stopping, no final model"):
        train_sft(cfg, arithmetic_rows(16), tmp_path / "out")
    assert not (tmp_path / "out" / "final").exists() and not (tmp_path / "out" / ".final.tmp").exists()


def test_a_batch_that_does_not_split_over_ranks_is_a_config_error():
    """A ConfigError (an AlignflowError): under torchrun every rank prints one line, not a traceback."""
    check_batch_split(Dist(world_size=2), 8, 2)
    with pytest.raises(ConfigError, match=r"^batch_size 6: expected a multiple of world size 2 x grad_accum_steps 2$"):
        check_batch_split(Dist(world_size=2), 6, 2)


def test_chat_template_without_one_in_the_tokenizer_is_a_one_line_error(tmp_path):
    """As the sampling stage: a config asking for the chat form must not silently train on raw prompts."""
    model = build_tiny_model(tmp_path / "plain", ["0123456789+="], hidden_size=16, num_heads=2, intermediate_size=32)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    assert load_tokenizer(model).chat_template is None
    cfg = SFTConfig(model_path=str(model), max_steps=1, chat_template=True, device="cpu")
    with pytest.raises(TrainDataError, match=f"^chat_template=True but the tokenizer in {model} has no chat template$"):
        train_sft(cfg, sft_rows(arithmetic_rows(4).rename({"completion": "answer"}), "problems", chat_template=True),
                  tmp_path / "out")


# ---- learning on the demo task (slow)


def demo_tiny_model(out_dir: Path) -> Path:
    """The demo's tiny model: character-level vocabulary over every demo text, hidden 128, 2 layers."""
    problems = pl.read_ndjson(DEMO / "problems.jsonl")
    pairs = pl.read_ndjson(DEMO / "pairs.jsonl")
    corpus = problems["prompt"].to_list() + problems["answer"].to_list() + pairs["rejected"].to_list()
    return build_tiny_model(out_dir, corpus)


def sampled_pass_at_1(model_dir: Path, problems: pl.DataFrame, *, n: int = 8, seed: int = 0) -> float:
    """Mean verifier accuracy of n samples at temperature 1 per problem (unbiased Pass@1)."""
    sampler = HFSampler.from_pretrained(model_dir, device="cpu")
    out = sampler.generate(problems["prompt"].to_list(), n=n, max_new_tokens=6, temperature=1.0, seed=seed)
    answers = problems["answer"].to_list()
    return float(np.mean([is_correct(c.text, gold) for group, gold in zip(out, answers) for c in group]))


@pytest.mark.slow
def test_demo_sft_reaches_a_pass_at_1_between_zero_and_perfect(tmp_path):
    problems = pl.read_ndjson(DEMO / "problems.jsonl")
    base = demo_tiny_model(tmp_path / "base")
    cfg = SFTConfig(model_path=str(base), max_steps=500, batch_size=128, lr=1e-3, device="cpu")
    started = time.perf_counter()
    final = train_sft(cfg, sft_rows(problems.filter(pl.col("split") == "train"), "problems"), tmp_path / "sft")
    seconds = time.perf_counter() - started
    test = problems.filter(pl.col("split") == "test")
    before, after = sampled_pass_at_1(base, test), sampled_pass_at_1(final, test)
    print(f"SFT demo: {seconds:.1f} s; held-out Pass@1 (T=1, n=8) {before:.3f} -> {after:.3f}")
    assert before < 0.02
    assert 0.2 < after < 0.9


@pytest.mark.slow
def test_rejection_sampling_sft_raises_pass_at_1(tmp_path):
    """A weak SFT model samples 8 answers per train problem; the verifier scores them; Best-of-N keeps the
    best per problem (correct ones, when any) and SFT on that raises held-out Pass@1."""
    problems = pl.read_ndjson(DEMO / "problems.jsonl")
    train = problems.filter(pl.col("split") == "train").head(4096)
    test = problems.filter(pl.col("split") == "test")
    base = demo_tiny_model(tmp_path / "base")
    weak = train_sft(SFTConfig(model_path=str(base), max_steps=200, batch_size=128, lr=1e-3, device="cpu"),
                     sft_rows(problems.filter(pl.col("split") == "train"), "problems"), tmp_path / "weak")

    started = time.perf_counter()
    sampler = HFSampler.from_pretrained(weak, device="cpu")
    prompts = train["prompt"].to_list()
    groups = [group for start in range(0, len(prompts), 512)
              for group in sampler.generate(prompts[start:start + 512], n=8, max_new_tokens=6, seed=start)]
    samples = pl.DataFrame([
        {"prompt_id": f"p{i}", "sample_idx": j, "prompt": prompt, "completion": c.text,
         "reward": float(is_correct(c.text, gold))}
        for i, (prompt, gold, group) in enumerate(zip(train["prompt"], train["answer"], groups))
        for j, c in enumerate(group)
    ])
    selected = best_of_n(samples).filter(pl.col("reward") > 0)  # RS-SFT keeps verified answers only
    rs = train_sft(SFTConfig(model_path=str(weak), max_steps=150, batch_size=128, lr=5e-4, device="cpu"),
                   sft_rows(selected, "best_of_n"), tmp_path / "rs")
    seconds = time.perf_counter() - started
    before, after = sampled_pass_at_1(weak, test), sampled_pass_at_1(rs, test)
    print(f"RS-SFT: {selected.height} of {train.height} prompts kept, {seconds:.1f} s (sampling + SFT); "
          f"held-out Pass@1 {before:.3f} -> {after:.3f}")
    assert after > before + 0.05


@pytest.mark.parametrize(("min_reward", "reason"), [
    (None, "(no such run, no whole scored samples)"),
    (0.5, "(no such run, no whole scored samples, or none with reward >= 0.5)"),
])
def test_best_of_n_data_of_an_unknown_run_is_one_line_naming_what_was_asked(tmp_path, min_reward, reason):
    from pipeline_lib.store.db import open_store
    from pipeline_lib.train.sft import load_sft_data

    cfg = SFTConfig(model_path="/m", data="best_of_n", samples_run_id="sample-nosuch", min_reward=min_reward)
    with open_store(tmp_path / "store.duckdb") as store:
        with pytest.raises(TrainDataError) as raised:
            load_sft_data(store, cfg)
    assert str(raised.value) == f"samples run 'sample-nosuch': no Best-of-N rows to train on {reason}"


def test_best_of_n_data_with_another_chat_template_than_its_run_is_one_line_naming_both(tmp_path):
    """RS-SFT renders its prompts as its sampling run did (as DPO's West-of-N pairs of the run do), or says so."""
    from pipeline_lib.store.db import open_store
    from pipeline_lib.train.sft import load_sft_data

    problems = pl.DataFrame({"problem_id": ["p"], "source": "s", "split": "train", "prompt": ["1+1="],
                             "answer": ["2"]})
    samples = pl.DataFrame({"run_id": ["chat"] * 2 + ["old"], "prompt_id": ["p"] * 3, "sample_idx": [0, 1, 0],
                            "prompt": ["1+1="] * 3, "completion": ["2", "3", "2"], "reward": [1.0, 0.0, 1.0],
                            "chat_template": [True, True, None]})
    with open_store(tmp_path / "store.duckdb") as store:
        store.insert_new("problems", problems)
        store.append("samples", samples)
        with pytest.raises(TrainDataError) as raised:
            load_sft_data(store, SFTConfig(model_path="/m", data="best_of_n", samples_run_id="chat"))
        rows, _ = load_sft_data(store, SFTConfig(model_path="/m", data="best_of_n", samples_run_id="chat",
                                                 chat_template=True))
        assert json.loads(rows["prompt_messages"][0]) == [{"role": "user", "content": "1+1="}]
        for chat_template in (False, True):  # a run that recorded nothing: the config decides
            cfg = SFTConfig(model_path="/m", data="best_of_n", samples_run_id="old", chat_template=chat_template)
            assert load_sft_data(store, cfg)[0]["completion"].to_list() == ["2"]
    assert str(raised.value) == (
        "samples run 'chat' was sampled with chat_template=True, but this SFT config has chat_template=False: "
        "Best-of-N rows would train on other prompts than their completions answered; set chat_template: true")
