"""Reward-model loop: groups from pairs and rankings, the BT margin reaching the loss, pairwise accuracy,
2-step runs for both losses, the NaN guard; slow: >= 95% held-out accuracy on synthetic demo pairs."""

from __future__ import annotations

import json
import random
import re
import time
import warnings
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from pipeline_lib.config import RMConfig, SFTConfig
from pipeline_lib.models import RewardModel, build_tiny_model, load_tokenizer
from pipeline_lib.rewards.model import RewardModelScorer
from pipeline_lib.rewards.registry import build_reward
from pipeline_lib.train.common import NonFiniteLossError, batches, final_metrics
from pipeline_lib.train.data import TrainDataError, group_width, holdout_split, text_ids
from pipeline_lib.train import rm
from pipeline_lib.train.rm import build_groups, group_scores, packed_groups, pairwise_accuracy, train_rm
from pipeline_lib.train.sft import sft_rows, train_sft

DEMO = Path(__file__).resolve().parents[2] / "data" / "demo"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("rm") / "base", ["0123456789+=", "no idea!"],
                            hidden_size=64, num_heads=2, intermediate_size=128)


def toy_pairs(n: int) -> pl.DataFrame:
    rng = random.Random(0)
    rows = [(rng.randrange(50), rng.randrange(50)) for _ in range(n)]
    return pl.DataFrame({"prompt": [f"{a:02d}+{b:02d}=" for a, b in rows], "chosen": [str(a + b) for a, b in rows],
                         "rejected": [str(a + b + 1) if i % 2 else "no idea!" for i, (a, b) in enumerate(rows)]})


def toy_rankings(n: int) -> pl.DataFrame:
    return pl.DataFrame({"prompt": [f"{i:02d}+01=" for i in range(n)],
                         "responses": [[str(i + 1), str(i + 2), "no idea!"][: 2 + i % 2] for i in range(n)]})


class LengthScorer(torch.nn.Module):
    """A stand-in reward: the number of real tokens (so the hand-computed accuracy below is exact)."""

    def forward(self, input_ids, attention_mask):
        return attention_mask.sum(-1).float()


def test_groups_hold_whole_texts_best_first(tiny, capsys):
    tokenizer = load_tokenizer(tiny)
    groups = build_groups(tokenizer, toy_rankings(3), "plackett_luce", max_length=64)
    assert groups.sizes == [2, 3, 2] and groups.starts == [0, 2, 5]
    assert groups.rows([1, 2]) == [2, 3, 4, 5, 6]
    assert tokenizer.decode(groups.encoded.prompt_ids[3]) == "01+01=3"  # ranking 1, response 1 (second best)
    pairs = build_groups(tokenizer, toy_pairs(2), "bradley_terry", max_length=64)
    assert pairs.sizes == [2, 2] and pairs.encoded.completion_ids == [[], [], [], []]  # no eos: scorer's view
    assert capsys.readouterr().err == ""
    # cut to their last 4 tokens, the two responses of the second pair read alike: the model cannot rank them
    cut = build_groups(tokenizer, pl.DataFrame({"prompt": ["1+1=", "2+2="], "chosen": ["2", "1234"],
                                                "rejected": ["3", "01234"]}), "bradley_terry", max_length=4)
    assert cut.encoded.prompt_ids[2] == cut.encoded.prompt_ids[3]
    assert "warning: 1 of 2 pairs hold two responses whose scored texts are the same tokens (cut to max_length = " \
           "4)" in capsys.readouterr().err
    with pytest.raises(TrainDataError, match=r"rankings\[0\]: expected >= 2 responses, got 1"):
        build_groups(tokenizer, pl.DataFrame({"prompt": ["x"], "responses": [["1"]]}), "plackett_luce", max_length=8)
    with pytest.raises(TrainDataError, match=r"missing column\(s\) \['chosen', 'rejected'\]"):
        build_groups(tokenizer, toy_rankings(2), "bradley_terry", max_length=8)


def test_pairwise_accuracy_counts_every_ordered_pair(tiny):
    """Score = token count; a prompt is 6 tokens. Ranking 0: '1', '2' (7, 7: a tie is not right);
    ranking 1: '2', '3', 'no idea!' (7, 7, 14): 2>3 tie, 2>no-idea gap -7, 3>no-idea gap -7; ranking 2: tie.
    Nothing is right: accuracy 0, margin (0 + 0 - 7 - 7 + 0) / 5 = -2.8."""
    groups = build_groups(load_tokenizer(tiny), toy_rankings(3), "plackett_luce", max_length=64)
    result = pairwise_accuracy(LengthScorer(), groups, [0, 1, 2], packed=(), pad_id=0, device=torch.device("cpu"))
    assert result == {"eval/rm_accuracy": 0.0, "eval/rm_margin": pytest.approx(-2.8)}
    pairs = build_groups(load_tokenizer(tiny), toy_pairs(4), "bradley_terry", max_length=64)
    scores, mask = group_scores(LengthScorer(), pairs, [0, 1], packed=(), pad_id=0, device=torch.device("cpu"))
    assert mask.all() and scores[0, 1] == 14  # "no idea!" after a 6-token prompt
    odd = pairwise_accuracy(LengthScorer(), pairs, [1, 3], packed=(), pad_id=0, device=torch.device("cpu"))
    assert odd["eval/rm_accuracy"] == 0.0  # '+1' answers have the same length: ties


def test_groups_run_packed_where_that_saves_compute_and_gives_each_responses_own_score(tiny, capsys, dropping):
    tokenizer, cpu = load_tokenizer(tiny), torch.device("cpu")
    model = RewardModel.from_policy(tiny, device="cpu").eval()  # as train_rm sets it: dropout off
    rankings = build_groups(tokenizer, toy_rankings(12), "plackett_luce", max_length=64)
    capsys.readouterr()
    assert packed_groups(model, rankings, pad_id=tokenizer.pad_token_id, device=cpu) == frozenset(range(12))
    assert capsys.readouterr().err == ""
    # any mix of packed groups and rows gives each response its own row's score, in the groups' order
    ids = [5, 0, 11, 2, 7]
    rows, mask = group_scores(model, rankings, ids, packed=(), pad_id=tokenizer.pad_token_id, device=cpu)
    mixed, _ = group_scores(model, rankings, ids, packed={0, 2, 7}, pad_id=tokenizer.pad_token_id, device=cpu)
    assert mask.sum() == sum(rankings.sizes[g] for g in ids)
    torch.testing.assert_close(mixed, rows, atol=1e-5, rtol=0)
    # dropout on (disable_dropout false): packed, a group's texts would share one draw over their prefix
    assert packed_groups(model.train(), rankings, pad_id=tokenizer.pad_token_id, device=cpu) == frozenset()
    assert model.training and capsys.readouterr().err == ""
    backbone = dropping(transformers.LlamaModel, "attention_mask")(model.backbone.config)
    quirky = RewardModel(backbone, model.head, "mean").eval()
    quirky.backbone.load_state_dict(model.backbone.state_dict())
    assert packed_groups(quirky, rankings, pad_id=tokenizer.pad_token_id, device=cpu) == frozenset()
    assert re.fullmatch(r"note: _DropsMask's packed rows do not give the rows' values \(max difference [0-9.e+-]+ on "
                        r"the 8 widest groups\): each response runs as its own row\n", capsys.readouterr().err)
    assert not quirky.training  # as it was
    # cut from the left to 12 tokens, a short and a long response keep no common first token: packing them would
    # only lengthen the attention, so they run as rows (as do the toy pairs rejecting with "no idea!", cut too);
    # the uncut pairs beside them still pack
    cut = build_groups(tokenizer, pl.concat([toy_pairs(4), pl.DataFrame(
        {"prompt": ["12+34+56+78+90="] * 4, "chosen": ["270"] * 4, "rejected": ["no idea!"] * 4})]),
        "bradley_terry", max_length=12)
    capsys.readouterr()
    assert packed_groups(model.eval(), cut, pad_id=tokenizer.pad_token_id, device=cpu) == {1, 3}
    assert capsys.readouterr().err == ""


def test_the_packing_check_holds_groups_sharing_a_prefix_when_the_widest_share_none(tiny, capsys, dropping):
    """A backbone reading column distances instead of position ids is right on a packed row whose texts share no
    prefix, wrong where the later texts sit behind the earlier ones: the check must look at the latter."""
    tokenizer, cpu = load_tokenizer(tiny), torch.device("cpu")
    long_cut = pl.DataFrame({"prompt": ["12+34+56+78+90=" * 3] * 8, "chosen": ["1"] * 8,
                             "rejected": ["no idea! no idea!"] * 8})  # cut from the left at different offsets
    pairs = pl.concat([toy_pairs(40), long_cut])
    groups = build_groups(tokenizer, pairs, "bradley_terry", max_length=24)
    model = RewardModel.from_policy(tiny, device="cpu").eval()
    backbone = dropping(transformers.LlamaModel, "position_ids")(model.backbone.config)
    quirky = RewardModel(backbone, model.head, "last_token").eval()
    quirky.backbone.load_state_dict(model.backbone.state_dict())
    capsys.readouterr()
    assert packed_groups(model, groups, pad_id=tokenizer.pad_token_id, device=cpu) == frozenset(range(40))
    widest = sorted(range(len(groups)), key=lambda g: -group_width(groups.encoded, groups.rows([g])))[:8]
    assert sorted(widest) == list(range(40, 48))  # the cut pairs, which share no first token
    assert packed_groups(quirky, groups, pad_id=tokenizer.pad_token_id, device=cpu) == frozenset()
    assert "note: _DropsPositions's packed rows do not give the rows' values" in capsys.readouterr().err


def test_a_group_wider_than_the_models_positions_runs_as_rows_and_the_others_pack(tiny):
    tokenizer, cpu = load_tokenizer(tiny), torch.device("cpu")
    model = RewardModel.from_policy(tiny, device="cpu").eval()
    assert model.backbone.config.max_position_embeddings == 256
    wide = pl.DataFrame({"prompt": ["12+34=" * 30], "chosen": ["1" * 50], "rejected": ["2" * 50]})  # 2 x ~231 tokens
    groups = build_groups(tokenizer, pl.concat([toy_pairs(6), wide]), "bradley_terry", max_length=256)
    assert group_width(groups.encoded, groups.rows([6])) > 256 >= len(groups.encoded.prompt_ids[12])
    assert packed_groups(model, groups, pad_id=tokenizer.pad_token_id, device=cpu) == frozenset(range(6))


def test_packed_groups_train_the_weights_their_rows_train(tiny, tmp_path, monkeypatch):
    cfg = RMConfig(model_path=str(tiny), loss="plackett_luce", pooling="mean", max_steps=3, batch_size=4, lr=1e-3,
                   log_every=1, device="cpu")
    logged: dict[str, list[dict]] = {"packed": [], "rows": []}
    packed = train_rm(cfg, toy_rankings(24), tmp_path / "packed", log=lambda m, s: logged["packed"].append(dict(m)))
    monkeypatch.setattr(rm, "packed_groups", lambda *args, **kwargs: frozenset())
    rows = train_rm(cfg, toy_rankings(24), tmp_path / "rows", log=lambda m, s: logged["rows"].append(dict(m)))
    assert [sorted(m) for m in logged["packed"]] == [sorted(m) for m in logged["rows"]]
    for ours, theirs in zip(logged["packed"], logged["rows"]):  # every step's loss and the held-out evaluations
        for key in ("train/loss", "eval/rm_margin"):
            assert ours.get(key) == pytest.approx(theirs.get(key), abs=1e-5)
    # AdamW steps every weight by about lr whatever its gradient's size, so the tolerance is far below one step
    before, after = load_file(str(rows / "model.safetensors")), load_file(str(packed / "model.safetensors"))
    assert all(torch.allclose(after[name], weights, atol=1e-4) for name, weights in before.items())
    assert not torch.equal(load_file(str(rows / "reward_head.safetensors"))["weight"],
                           RewardModel.from_policy(tiny, seed=cfg.seed).head.weight.detach())  # they trained
    assert (final_metrics(packed)["train/packed_groups"], final_metrics(rows)["train/packed_groups"]) == (24, 0)


def test_bradley_terry_two_steps_with_margin(tiny, tmp_path):
    """The first logged loss is mean -log σ(r_c - r_r - m) under the fresh head on the first batch."""
    data = toy_pairs(40)
    cfg = RMConfig(model_path=str(tiny), max_steps=2, batch_size=8, lr=1e-3, margin=0.5, log_every=1, device="cpu")
    logged = []
    final = train_rm(cfg, data, tmp_path / "out", log=lambda m, s: logged.append((s, dict(m))))
    assert [s for s, _ in logged] == [0, 1, 2, 2]
    assert all(np.isfinite(list(m.values())).all() for _, m in logged)
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"} <= set(logged[1][1])

    start = RewardModel.from_policy(tiny, device="cpu", seed=cfg.seed)
    groups = build_groups(load_tokenizer(tiny), data, "bradley_terry", max_length=cfg.max_length)
    train_ids, eval_ids = holdout_split(data["prompt"].to_list(), cfg.eval_fraction, seed=cfg.seed)
    _, first = next(batches(len(train_ids), 8, seed=cfg.seed))
    with torch.no_grad():
        scores, _ = group_scores(start, groups, [train_ids[p] for p in first], packed=(), pad_id=0,
                                 device=torch.device("cpu"))
    expected = float(-F.logsigmoid(scores[:, 0] - scores[:, 1] - 0.5).mean())
    assert logged[1][1]["train/loss"] == pytest.approx(expected, rel=1e-5)

    reward = RewardModel.from_pretrained(final, device="cpu")
    assert reward.pooling == "last_token"
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert all(not torch.equal(after[k], before["model." + k]) for k in after)  # the backbone trains too
    assert final_metrics(final)["eval/n_groups"] == len(eval_ids) >= 4  # 10% of the prompts


def test_texts_past_the_backbones_learned_positions_are_cut_to_them_as_the_scorer_cuts_them(short_positions, tmp_path,
                                                                                             capsys):
    """OPT raises IndexError past its 16 positions (it crashed here under the default max_length 256): texts lose
    their first tokens down to 16, as max_length 16 and the reward model's scorer cut them, with one note."""
    model_path = short_positions["opt"]
    data = pl.concat([toy_pairs(6), pl.DataFrame({"prompt": ["12+34+" * 8 + "56="], "chosen": ["102"],
                                                  "rejected": ["no idea!"]})])
    capsys.readouterr()
    cfg = RMConfig(model_path=str(model_path), max_steps=2, batch_size=4, lr=1e-3, device="cpu")
    final = train_rm(cfg, data, tmp_path / "out")
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("note:", "warning:"))]
    assert notes[0] == ("note: 2 of 14 texts (prompt + response) are longer than the model's 16 positions (under "
                        "max_length 256) and lost their first tokens, as the reward model's scorer cuts them")
    assert np.isfinite(final_metrics(final)["train/loss"])
    tokenizer = load_tokenizer(model_path)
    groups = build_groups(tokenizer, data, "bradley_terry", max_length=256, positions=16)
    assert groups.encoded == build_groups(tokenizer, data, "bradley_terry", max_length=16).encoded
    assert max(len(ids) for ids in groups.encoded.prompt_ids) == 16


def test_the_reward_model_records_its_prompt_form_and_scoring_checks_it(tiny, tmp_path):
    """Chat-shaped pairs train on chat-rendered prompts; a stage scoring the other form gets a warning."""
    plain = toy_pairs(16)
    chat = plain.with_columns(pl.col("prompt").map_elements(
        lambda p: json.dumps([{"role": "user", "content": p}]), return_dtype=pl.String).alias("prompt_messages"))
    for name, data, rendered in (("plain", plain, False), ("chat", chat, True)):
        cfg = RMConfig(model_path=str(tiny), max_steps=1, batch_size=4, device="cpu")
        final = train_rm(cfg, data, tmp_path / name)
        assert json.loads((final / "reward_config.json").read_text())["chat_prompts"] is rendered
        assert RewardModel.from_pretrained(final).chat_prompts is rendered
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            build_reward([{"name": "reward_model"}], reward_model_path=str(final), chat_prompts=rendered)
        form = "chat-rendered" if rendered else "plain-text"
        with pytest.warns(RuntimeWarning, match=f"was trained on {form} prompts but scores"):
            build_reward([{"name": "reward_model"}], reward_model_path=str(final), chat_prompts=not rendered)
    config = json.loads((final / "reward_config.json").read_text())  # a reward model saved before the record
    (final / "reward_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_prompts"}))
    assert RewardModel.from_pretrained(final).chat_prompts is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_reward([{"name": "reward_model"}], reward_model_path=str(final), chat_prompts=False)


def test_a_reward_model_scores_texts_cut_as_its_training_cut_them(tiny, tmp_path, capsys):
    """Trained with max_length 16, the model saw the last 16 tokens of each text, but the scorer every stage uses
    (`build_reward`) read whole texts, up to the model's positions: the audit's scores moved by 0.18 on average for
    a spread of 0.19. The model records the length, and its scorer cuts to it, with one note."""
    data = toy_pairs(8).with_columns(prompt=pl.lit("Q: what is twelve plus thirty-four? A: ") + pl.col("prompt"))
    cfg = RMConfig(model_path=str(tiny), max_steps=2, batch_size=4, lr=1e-3, max_length=16, device="cpu")
    final = train_rm(cfg, data, tmp_path / "out")
    assert json.loads((final / "reward_config.json").read_text())["max_length"] == 16
    model = RewardModel.from_pretrained(final, device="cpu")
    assert model.max_length == 16
    prompts, answers = data["prompt"].to_list(), data["chosen"].to_list()
    texts = [p + c for p, c in zip(prompts, answers)]
    tokenizer = load_tokenizer(final)
    assert min(len(ids) for ids in text_ids(tokenizer, texts)) > 16  # every text is cut
    scorer = build_reward([{"name": "reward_model"}], reward_model_path=str(final))
    capsys.readouterr()
    scored = scorer(prompts, answers, answers=[None] * len(texts), lengths=[1] * len(texts))[0]
    scorer(prompts, answers, answers=[None] * len(texts), lengths=[1] * len(texts))  # the note is given once
    assert capsys.readouterr().err == ("note: 8 of 8 texts are longer than the 16 tokens the reward model's training "
                                       "cut its texts to: they are scored on their last tokens\n")
    as_trained = RewardModelScorer(model, tokenizer, max_length=16)(texts)
    whole = RewardModelScorer(model, tokenizer, max_length=10_000)(texts)
    assert scored == as_trained and scored != whole


def test_plackett_luce_on_rankings_of_different_sizes(tiny, tmp_path):
    cfg = RMConfig(model_path=str(tiny), loss="plackett_luce", pooling="last_two_layers", max_steps=2, batch_size=4,
                   grad_accum_steps=2, lr=1e-3, device="cpu")
    final = train_rm(cfg, toy_rankings(20), tmp_path / "out")
    metrics = final_metrics(final)
    assert np.isfinite(metrics["train/loss"]) and 0 <= metrics["eval/rm_accuracy"] <= 1
    assert RewardModel.from_pretrained(final, device="cpu").pooling == "last_two_layers"


def test_plackett_luce_pair_stats_do_not_depend_on_the_micro_batch_split(tiny, tmp_path, collect):
    """Micro-batches of rankings with 2 to 5 responses hold 1 to 4 adjacent pairs: the logged pair accuracy and
    margin are those of the whole batch, not a mean of the micro-batches' ratios."""
    rankings = pl.DataFrame({"prompt": [f"{i:02d}+01=" for i in range(20)],
                             "responses": [[str(i + j) for j in range(2 + i % 4)] for i in range(20)]})
    base = dict(model_path=str(tiny), loss="plackett_luce", max_steps=1, batch_size=8, lr=1e-3, device="cpu")
    runs = []
    for accum in (1, 4):
        logged, log = collect()
        train_rm(RMConfig(**base, grad_accum_steps=accum), rankings, tmp_path / f"accum{accum}", log=log)
        runs.append(next(metrics for _, metrics in logged if "train/loss" in metrics))
    for key in ("train/loss", "rewards/accuracies", "rewards/margins", "rewards/top"):
        assert runs[1][key] == pytest.approx(runs[0][key], rel=1e-5, abs=1e-6), key


def test_nan_loss_stops_the_reward_model(tiny, tmp_path):
    """lr 1e30 blows the weights up within a few steps; the error names the first bad step, counted from 1 as
    the metrics are logged: the last checkpoint (written after every finished step) holds the step before it."""
    cfg = RMConfig(model_path=str(tiny), max_steps=6, batch_size=8, lr=1e30, max_grad_norm=None, save_every=1,
                   device="cpu")
    with pytest.raises(NonFiniteLossError, match=r"train/(loss|grad_norm) is (nan|inf) at step \d+; stopping") as error:
        train_rm(cfg, toy_pairs(20), tmp_path / "out")
    step = int(str(error.value).split("at step ")[1].split(";")[0])
    assert json.loads((tmp_path / "out" / "checkpoint" / "trainer_state.json").read_text())["step"] == step - 1
    assert not (tmp_path / "out" / "final").exists()


# ---- learning (slow)


def synthetic_pairs(problems: pl.DataFrame, n: int, seed: int) -> pl.DataFrame:
    """Pairs on `n` problems by the recipe of data/generate.py: chosen = the sum; rejected = (40%) a polite
    non-answer, else a near miss with the units (60%) or the tens digit off."""
    rng = random.Random(seed)
    shipped = pl.read_ndjson(DEMO / "pairs.jsonl")
    non_answers = sorted(set(shipped.filter(pl.col("rejected_kind") == "non_answer")["rejected"].to_list()))
    rows = []
    for problem in problems.sample(n, seed=seed).to_dicts():
        answer = int(problem["answer"])
        if rng.random() < 0.4:
            rejected = rng.choice(non_answers)
        elif rng.random() < 0.6 or answer < 10:
            same_tens = [d for d in range(-9, 10) if d and answer + d >= 0 and (answer + d) // 10 == answer // 10]
            rejected = str(answer + rng.choice(same_tens or [1]))
        else:
            rejected = str(answer + rng.choice([d for d in (-20, -10, 10, 20) if answer + d >= 0]))
        rows.append({"prompt": problem["prompt"], "chosen": problem["answer"], "rejected": rejected})
    return pl.DataFrame(rows)


@pytest.mark.slow
def test_reward_model_reaches_95_percent_on_held_out_synthetic_pairs(tmp_path):
    """Verifying a sum takes an RM (measured) a backbone that can add, more pairs than the 2,700 shipped
    training pairs, and steady steps: from the demo's deliberately weak SFT on the shipped pairs, held-out
    accuracy stays near 72%; from an SFT run to ~98% greedy accuracy, on 9,000 pairs of the same recipe with
    batch 128 and 50 warm-up steps, it passes 95% (97.6-98.0% over two data draws when written, 97.0% on
    2026-12-04; batch 64 without warm-up landed anywhere from 80% to 97% depending on the draw; 1,000 SFT and 400
    RM steps, tried to shorten the test's ~200 s, 82.7% and 93.7% on two draws). Near misses are 60% of the pairs,
    all held out by prompt."""
    problems = pl.read_ndjson(DEMO / "problems.jsonl")
    train = problems.filter(pl.col("split") == "train")
    shipped = pl.read_ndjson(DEMO / "pairs.jsonl")
    base = build_tiny_model(tmp_path / "base", problems["prompt"].to_list() + problems["answer"].to_list()
                            + shipped["rejected"].to_list())
    started = time.perf_counter()
    sft = train_sft(SFTConfig(model_path=str(base), max_steps=1500, batch_size=128, lr=1e-3, device="cpu"),
                    sft_rows(train, "problems"), tmp_path / "sft")
    sft_seconds = time.perf_counter() - started
    # max_length 24 keeps every near miss whole and the last 24 tokens of a non-answer (cheaper steps)
    cfg = RMConfig(model_path=str(sft), max_steps=600, batch_size=128, lr=5e-4, warmup_steps=50, max_length=24,
                   device="cpu")
    started = time.perf_counter()
    final = train_rm(cfg, synthetic_pairs(train, 9000, seed=0), tmp_path / "rm")
    metrics = final_metrics(final)
    print(f"RM: SFT backbone {sft_seconds:.1f} s, RM {time.perf_counter() - started:.1f} s; held-out accuracy "
          f"{metrics['eval/rm_accuracy']:.4f} on {metrics['eval/n_groups']:.0f} pairs, "
          f"margin {metrics['eval/rm_margin']:.2f}")
    assert metrics["eval/rm_accuracy"] >= 0.95
