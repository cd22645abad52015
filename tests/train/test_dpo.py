"""DPO loop: loss log 2 while policy == reference, reference log-probs computed once and cached by weights +
data, LoRA with adapters-off reference and merged final weights, the NaN guard; slow: on the demo pairs DPO
raises held-out preference accuracy and the chosen - rejected log-prob margin over its SFT start."""

from __future__ import annotations

import errno
import json
import math
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import transformers
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from pipeline_lib.config import DPOConfig, SFTConfig
from pipeline_lib.errors import AlignflowError
from pipeline_lib.losses import dpo_loss
from pipeline_lib.models import build_tiny_model, load_policy, load_tokenizer
from pipeline_lib.train import dpo as dpo_module
from pipeline_lib.train.common import CheckpointWriteError, Dist, NonFiniteLossError, final_metrics, visited
from pipeline_lib.train.data import holdout_split
from pipeline_lib.train.dpo import add_lora, encode_pairs, logprob_sums, packed_pairs, reference_logps, train_dpo
from pipeline_lib.train.sft import sft_rows, train_sft

DEMO = Path(__file__).resolve().parents[2] / "data" / "demo"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("dpo") / "base", ["0123456789+=", "no idea!"],
                            hidden_size=64, num_heads=2, intermediate_size=128)


def toy_pairs(n: int, seed: int = 0) -> pl.DataFrame:
    rng = random.Random(seed)
    rows = [(rng.randrange(50), rng.randrange(50)) for _ in range(n)]
    return pl.DataFrame({"prompt": [f"{a:02d}+{b:02d}=" for a, b in rows], "chosen": [str(a + b) for a, b in rows],
                         "rejected": [str(a + b + 1) if i % 2 else "no idea!" for i, (a, b) in enumerate(rows)]})


def test_two_steps_start_at_log_2_and_train_every_weight(tiny, tmp_path, collect):
    """At the first step the policy is the reference: every logit is 0, the loss is log 2 and the implicit
    rewards are 0."""
    logged, log = collect()
    cfg = DPOConfig(policy_path=str(tiny), max_steps=2, batch_size=8, lr=1e-3, log_every=1, device="cpu")
    final = train_dpo(cfg, toy_pairs(40), tmp_path / "out", log=log)
    first = logged[1][1]
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected"} <= set(first)
    assert all(np.isfinite(list(m.values())).all() for _, m in logged)
    start = logged[0][1]
    assert start["eval/loss"] == pytest.approx(math.log(2), abs=1e-5)
    metrics = final_metrics(final)
    assert metrics["eval/pref_accuracy_start"] == start["eval/pref_accuracy"]
    assert {"eval/pref_accuracy", "eval/logp_margin", "eval/logp_margin_start"} <= set(metrics)
    assert metrics["train/packed_pairs"] == 40  # every pair ran as one row behind its prompt
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert all(not torch.equal(before[k], after[k]) for k in before)


def test_chat_pairs_end_with_the_turn_end_the_model_stops_on(chatml, tmp_path, collect):
    """An instruct model (ChatML, stopping on `<|im_end|>`): the held-out log-prob margin before training is that of
    chosen and rejected answers ending with `<|im_end|>`, the token its sampler stops on, not with eos."""
    pairs = toy_pairs(40)
    pairs = pairs.with_columns(prompt_messages=pl.Series([json.dumps([{"role": "user", "content": prompt}])
                                                          for prompt in pairs["prompt"]]))
    logged, log = collect()
    cfg = DPOConfig(policy_path=str(chatml), max_steps=1, batch_size=8, device="cpu")
    train_dpo(cfg, pairs, tmp_path / "out", log=log)
    tokenizer, model = load_tokenizer(chatml), load_policy(chatml, device="cpu")
    _, held_out = holdout_split(pairs["prompt"].to_list(), cfg.eval_fraction, seed=cfg.seed)

    def margin(stops: set[int]) -> float:
        encoded = encode_pairs(tokenizer, pairs, max_length=cfg.max_length, stops=stops)
        logps = logprob_sums(model, encoded, held_out, packed=(), pad_id=tokenizer.pad_token_id,
                             device=torch.device("cpu"), batch_size=64)
        return float((logps[:, 0] - logps[:, 1]).mean())

    turn_end = margin({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    assert logged[0][0] == 0 and logged[0][1]["eval/logp_margin"] == pytest.approx(turn_end, abs=1e-5)
    assert abs(turn_end - margin({tokenizer.eos_token_id})) > 1e-3


def test_pairs_past_the_models_learned_positions_are_cut_to_them_and_the_reference_reads_the_same_rows(
        short_positions, tmp_path, capsys, collect):
    """GPT-2 raises IndexError past its 16 positions (it crashed here under the default max_length 256): pairs are
    cut as max_length 16 would cut them (one prompt cut per pair), with one note; the reference log-probs, cached by
    the cut ids' fingerprint, are those of the rows the policy reads, so the first loss is log 2."""
    model_path = short_positions["gpt2"]
    pairs = pl.concat([toy_pairs(6), pl.DataFrame({"prompt": ["12+34+" * 8 + "56="], "chosen": ["102"],
                                                   "rejected": ["no idea!"]})])
    logged, log = collect()
    capsys.readouterr()
    cfg = DPOConfig(policy_path=str(model_path), max_steps=2, batch_size=4, lr=1e-3, log_every=1, device="cpu")
    final = train_dpo(cfg, pairs, tmp_path / "out", log=log)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("note:", "warning:"))]
    assert notes[0] == ("note: 2 of 14 rows are cut to the model's 16 positions (under max_length 256): prompts lose "
                        "their first tokens, then completions their last")
    assert logged[1][1]["train/loss"] == pytest.approx(math.log(2), abs=1e-5) and final.is_dir()
    tokenizer = load_tokenizer(model_path)
    encoded = encode_pairs(tokenizer, pairs, max_length=256, positions=16)
    assert encoded == encode_pairs(tokenizer, pairs, max_length=16)
    assert encoded.fingerprint() != encode_pairs(tokenizer, pairs, max_length=256).fingerprint()  # the ref cache key
    assert len(list((tmp_path / "out" / "cache" / "ref_logps").glob("*.safetensors"))) == 1


def test_dropout_is_off_unless_asked_so_a_dropout_checkpoint_still_starts_at_log_2(tiny, tmp_path, collect):
    """The cached reference log-probs are taken without dropout; the policy must be trained the same way, or the
    step-0 loss is not log 2 (TRL's disable_dropout)."""
    dropout_dir = tmp_path / "dropout"
    shutil.copytree(tiny, dropout_dir)
    config = json.loads((dropout_dir / "config.json").read_text())
    (dropout_dir / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.5}))
    first_losses, packed = {}, {}
    for disable in (True, False):
        logged, log = collect()
        cfg = DPOConfig(policy_path=str(dropout_dir), max_steps=1, batch_size=8, lr=1e-3, device="cpu",
                        disable_dropout=disable)
        final = train_dpo(cfg, toy_pairs(40), tmp_path / f"out-{disable}", log=log)
        first_losses[disable] = logged[1][1]["train/loss"]
        packed[disable] = final_metrics(final)["train/packed_pairs"]
    assert first_losses[True] == pytest.approx(math.log(2), abs=1e-5)
    assert abs(first_losses[False] - math.log(2)) > 1e-3  # dropout on: the policy is not the reference
    # dropout on, a pair runs as two rows: packed, chosen and rejected would share one dropout draw over the prompt
    assert packed == {True: 40, False: 0}
    with pytest.raises(ValueError, match="lora_dropout 0.1 has no effect while disable_dropout is true"):
        DPOConfig(policy_path="p", lora_r=8, lora_dropout=0.1)


def test_rpo_term_adds_the_chosen_nll_and_holds_the_chosen_answers_up(tiny, tmp_path, collect):
    """rpo_alpha 1: the first loss is log 2 + the chosen per-token NLL; over the same steps the chosen answers'
    log-probs end higher than plain DPO's (its NLL pulls them up while DPO pushes the pair apart)."""
    runs = {}
    for alpha in (0.0, 1.0):
        logged, log = collect()
        cfg = DPOConfig(policy_path=str(tiny), max_steps=8, batch_size=8, lr=3e-3, log_every=1, rpo_alpha=alpha,
                        device="cpu")
        train_dpo(cfg, toy_pairs(40), tmp_path / f"alpha{alpha}", log=log)
        runs[alpha] = [m for step, m in logged if "train/loss" in m]
    first = runs[1.0][0]
    assert first["nll/chosen"] > 0 and "nll/chosen" not in runs[0.0][0]
    assert first["train/loss"] == pytest.approx(math.log(2) + first["nll/chosen"], abs=1e-5)
    assert runs[1.0][-1]["logps/chosen"] > runs[0.0][-1]["logps/chosen"] + 0.5


def test_eval_loss_is_the_training_objective_on_the_held_out_pairs(tiny, tmp_path, collect):
    """eval/loss is the loss train/loss is, label smoothing and RPO's NLL term included (TRL's DPOTrainer computes
    both with one loss); it was the plain DPO loss, log 2 at the start whatever rpo_alpha added to train/loss.
    Recomputed here from the saved final weights and the starting model on the held-out pairs."""
    logged, log = collect()
    cfg = DPOConfig(policy_path=str(tiny), max_steps=3, batch_size=8, lr=3e-3, log_every=1, rpo_alpha=0.5,
                    label_smoothing=0.2, eval_fraction=0.25, device="cpu")
    pairs = toy_pairs(40)
    final = train_dpo(cfg, pairs, tmp_path / "out", log=log)
    tokenizer = load_tokenizer(tiny)
    encoded = encode_pairs(tokenizer, pairs, max_length=cfg.max_length)
    _, eval_ids = holdout_split(pairs["prompt"].to_list(), cfg.eval_fraction, seed=cfg.seed)
    lengths = torch.tensor([len(encoded.completion_ids[2 * i]) for i in eval_ids])
    logps = {}
    for name, path in (("ref", tiny), ("final", final)):
        model = load_policy(str(path), dtype="float32", device="cpu").eval()
        logps[name] = logprob_sums(model, encoded, eval_ids, packed=(), pad_id=tokenizer.pad_token_id,
                                   device=torch.device("cpu"), batch_size=64)  # (P, 2)
    ref_nll = float(-(logps["ref"][:, 0] / lengths).mean())
    evals = [(step, m["eval/loss"]) for step, m in logged if "eval/loss" in m]
    assert evals[0] == (0, pytest.approx(math.log(2) + 0.5 * ref_nll, abs=1e-4))  # policy == reference
    expected, _ = dpo_loss(logps["final"][:, 0], logps["final"][:, 1], logps["ref"][:, 0], logps["ref"][:, 1],
                           beta=cfg.beta, label_smoothing=0.2, rpo_alpha=0.5, chosen_lengths=lengths)
    assert evals[-1] == (3, pytest.approx(float(expected), abs=1e-4))
    assert final_metrics(final)["eval/loss_start"] == pytest.approx(evals[0][1])


def test_a_long_pair_keeps_one_prompt_for_chosen_and_rejected(tiny):
    pairs = pl.DataFrame({"prompt": ["12+34+56+78="], "chosen": ["180"], "rejected": ["no idea"]})
    encoded = encode_pairs(load_tokenizer(tiny), pairs, max_length=12)
    assert encoded.prompt_ids[0] == encoded.prompt_ids[1] and len(encoded.prompt_ids[0]) == 12 - len("no idea") - 1


def test_a_pair_whose_answers_are_the_same_tokens_after_the_cut_is_warned_of(tiny, capsys):
    """Answers differing only past the cut, or only in characters the tokenizer maps to <unk>, are one answer to
    DPO (loss log 2, no gradient, a wrong held-out pair): only the generic "cut from the right" warning printed,
    where the reward model warns of the same case."""
    tokenizer = load_tokenizer(tiny)
    pairs = pl.DataFrame({"prompt": ["1+1=", "2+2=", "3+3="], "chosen": ["2", "41234567", "6ä"],
                          "rejected": ["3", "41234568", "6ö"]})
    capsys.readouterr()
    encoded = encode_pairs(tokenizer, pairs, max_length=8)
    answers = encoded.completion_ids
    assert answers[2] == answers[3] and answers[4] == answers[5]
    err = capsys.readouterr().err
    assert "warning: 2 of 3 pairs hold a chosen and a rejected answer that are the same tokens (cut to max_length = " \
           "8): DPO cannot tell them apart" in err
    encode_pairs(tokenizer, pairs.head(1), max_length=8)
    assert "same tokens" not in capsys.readouterr().err


def test_at_step_0_the_held_out_pairs_score_exactly_as_their_reference(tmp_path, collect):
    """The reference log-probs came from one pass over every pair, the held-out evaluation's from a pass over its
    own: a pair padded to other widths in the two (rows of 1-3 sums here), other float rounding (~1e-6), so a policy
    equal to its reference was preferred on 0.125 of the held-out pairs at step 0 (0.21 in the demo; the MLflow
    audit's 0.17). The held-out pairs now take their reference in a pass of their own, batched as the evaluation
    batches them. (An SFT-trained model: a random one's log-probs did not show the rounding.)"""
    tiny = build_tiny_model(tmp_path / "base", ["0123456789+="], hidden_size=128, num_heads=4, intermediate_size=512)
    rng = random.Random(0)
    rows = [(rng.randrange(50), rng.randrange(50)) for _ in range(240)]
    pairs = pl.DataFrame({"prompt": [f"{a:02d}+{b:02d}=" * (i % 3 + 1) for i, (a, b) in enumerate(rows)],
                          "chosen": [str(a + b) for a, b in rows],
                          "rejected": [str(a + b + rng.choice([1, -1, 10])) for a, b in rows]})
    sft = train_sft(SFTConfig(model_path=str(tiny), max_steps=60, batch_size=64, lr=1e-3, device="cpu"),
                    pairs.select("prompt", completion="chosen"), tmp_path / "sft")
    logged, log = collect()
    train_dpo(DPOConfig(policy_path=str(sft), max_steps=1, batch_size=8, log_every=1, device="cpu"), pairs,
              tmp_path / "dpo", log=log)
    (start,) = [metrics for step, metrics in logged if step == 0]
    assert start["eval/rewards_accuracy"] == 0.0  # every reward exactly 0 (0.125 here before)
    assert start["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_reference_logps_are_cached_by_weights_and_data(tiny, tmp_path):
    tokenizer, model = load_tokenizer(tiny), load_policy(tiny, device="cpu")
    encoded = encode_pairs(tokenizer, toy_pairs(6), max_length=64)
    kwargs = dict(parts=([0, 2, 3, 5], [1, 4]), packed=frozenset(range(6)), policy_path=str(tiny), cache_dir=tmp_path,
                  pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), batch_size=4, ctx=Dist())
    ref = reference_logps(model, encoded, **kwargs)
    files = list((tmp_path / "ref_logps").glob("*.safetensors"))
    assert len(files) == 1 and ref.shape == (12,)
    for packed in (range(6), (), (1, 4)):  # rows 2i, 2i + 1: pair i's chosen and rejected, whichever way it ran
        direct = logprob_sums(model, encoded, list(range(6)), packed=packed, pad_id=tokenizer.pad_token_id,
                              device=torch.device("cpu"), batch_size=12)
        assert direct.shape == (6, 2) and torch.allclose(ref, direct.flatten(), atol=1e-5) and bool((ref < 0).all())
    assert len(list((tmp_path / "ref_logps").glob("*.safetensors"))) == 1

    with torch.no_grad():  # a different model object with other weights still hits the cache: it is keyed by
        model.lm_head.weight.add_(1.0)  # the reference checkpoint's files, never recomputed from the live model
    assert torch.equal(reference_logps(model, encoded, **kwargs), ref)
    other = encode_pairs(tokenizer, toy_pairs(6, seed=1), max_length=64)
    reference_logps(model, other, **kwargs)
    assert len(list((tmp_path / "ref_logps").glob("*.safetensors"))) == 2
    reference_logps(model, encoded, **{**kwargs, "packed": ()})  # another layout, other last bits: its own file
    assert len(list((tmp_path / "ref_logps").glob("*.safetensors"))) == 3
    reference_logps(model, encoded, **{**kwargs, "packed": {0, 5}})  # and another
    assert len(list((tmp_path / "ref_logps").glob("*.safetensors"))) == 4
    reference_logps(model, encoded, **{**kwargs, "parts": ([0, 1, 2, 3], [4, 5])})  # another held-out split
    assert len(list((tmp_path / "ref_logps").glob("*.safetensors"))) == 5
    # another batch size batches the held-out pairs otherwise, as the evaluation then does: its own file (a run
    # with another ref_batch_size read the first's, and its step-0 held-out rewards were float noise again)
    reference_logps(model, encoded, **{**kwargs, "batch_size": 2})
    assert len(list((tmp_path / "ref_logps").glob("*.safetensors"))) == 6



def test_the_reference_pass_covers_the_pairs_the_run_trains_on_and_the_held_out_ones(tiny, tmp_path):
    """Two steps of 4 pairs out of 180 training pairs: the reference log-probs of those 8 and of the held-out
    pairs, not of all 200 (a pass over the whole set whatever max_steps was)."""
    pairs = toy_pairs(200)
    cfg = DPOConfig(policy_path=str(tiny), max_steps=2, batch_size=4, eval_fraction=0.1, device="cpu")
    train_dpo(cfg, pairs, tmp_path / "out")
    [file] = (tmp_path / "out" / "cache" / "ref_logps").glob("*.safetensors")
    logps = load_file(str(file))["logps"].view(-1, 2)
    train_ids, eval_ids = holdout_split(pairs["prompt"].to_list(), cfg.eval_fraction, seed=cfg.seed)
    trained = {train_ids[k] for k in visited(len(train_ids), cfg.batch_size, seed=cfg.seed, steps=cfg.max_steps)}
    assert len(trained) == 8 and len(eval_ids) >= 10
    assert {i for i in range(200) if bool((logps[i] < 0).all())} == trained | set(eval_ids)
    assert int((logps == 0).all(dim=1).sum()) == 200 - len(trained) - len(eval_ids)

def test_a_damaged_reference_cache_file_is_computed_again_and_a_failed_write_is_one_line(tiny, tmp_path,
                                                                                         monkeypatch):
    """A cached file cut or damaged (a disk fault) failed every later DPO run on that data with a traceback, never
    recomputed; a full disk while writing it was a traceback too."""
    tokenizer, model = load_tokenizer(tiny), load_policy(tiny, device="cpu")
    encoded = encode_pairs(tokenizer, toy_pairs(6), max_length=64)
    kwargs = dict(parts=([0, 2, 3, 5], [1, 4]), packed=frozenset(range(6)), policy_path=str(tiny), cache_dir=tmp_path,
                  pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), batch_size=4, ctx=Dist())
    ref = reference_logps(model, encoded, **kwargs).clone()  # not a view of the file that is damaged below
    (cached,) = (tmp_path / "ref_logps").glob("*.safetensors")
    for damage in (cached.read_bytes()[:100], b"", safetensors_bytes({"logps": torch.zeros(3)}),
                   safetensors_bytes({"other": ref})):
        cached.write_bytes(damage)
        with pytest.warns(RuntimeWarning, match=rf"^{cached} is unreadable \(\w+: .*\); computing the reference "
                                                "log-probs again$"):
            assert torch.equal(reference_logps(model, encoded, **kwargs), ref)
        assert torch.equal(load_file(cached)["logps"], ref)
    cached.unlink()

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dpo_module, "save_file", full_disk)
    with pytest.raises(CheckpointWriteError) as failed:
        reference_logps(model, encoded, **kwargs)
    assert str(failed.value) == f"{cached}: cannot write the reference log-probs (OSError: [Errno 28] No space " \
                                "left on device)"
    assert list(cached.parent.iterdir()) == []  # no temp file left behind


def test_the_reference_cache_key_follows_the_model_s_config_and_weights_in_subdirs(tiny, tmp_path):
    """Identical weights under an edited config.json give other log-probs: the key covered the safetensors alone, so
    DPO trained against the log-probs of the config before the edit (step 1's margins not 0)."""
    tokenizer = load_tokenizer(tiny)
    encoded = encode_pairs(tokenizer, toy_pairs(6), max_length=64)
    edited = tmp_path / "edited"
    shutil.copytree(tiny, edited)
    kwargs = dict(parts=(list(range(6)),), packed=frozenset(range(6)), cache_dir=tmp_path / "cache",
                  pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), batch_size=4, ctx=Dist())
    before = reference_logps(load_policy(edited, device="cpu"), encoded, policy_path=str(edited), **kwargs)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 0.5}))
    model = load_policy(edited, device="cpu")
    after = reference_logps(model, encoded, policy_path=str(edited), **kwargs)
    direct = logprob_sums(model, encoded, list(range(6)), packed=range(6), pad_id=tokenizer.pad_token_id,
                          device=torch.device("cpu"), batch_size=12).flatten()
    assert torch.allclose(after, direct, atol=1e-5) and not torch.allclose(after, before, atol=1e-3)
    (edited / "shards").mkdir()  # weights in a subdir are part of the key too
    (edited / "model.safetensors").rename(edited / "shards" / "model.safetensors")
    reference_logps(model, encoded, policy_path=str(edited), **kwargs)
    assert len(list((tmp_path / "cache" / "ref_logps").glob("*.safetensors"))) == 3


class _DropsWideMasks(transformers.LlamaForCausalLM):
    """One that drops the packed mask of rows over 20 columns only (as a window or a position limit bites on long
    rows): the toy pairs fit, the two long ones do not."""

    __module__ = "transformers.models.llama.modeling_llama"

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        wide_packed = attention_mask.dim() == 4 and input_ids.shape[1] > 20
        return super().forward(input_ids, attention_mask=None if wide_packed else attention_mask, **kwargs)


class _RefusesMasks(transformers.LlamaForCausalLM):
    """One whose forward raises on a prepared 4D mask (Bloom's ALiBi did: `too many values to unpack`)."""

    __module__ = "transformers.models.llama.modeling_llama"

    def forward(self, *args, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            raise ValueError("too many values to unpack (expected 2)\nsecond line")
        return super().forward(*args, attention_mask=attention_mask, **kwargs)


def test_packed_pairs_are_checked_against_the_two_rows_on_the_widest_pairs(tiny, capsys, dropping):
    tokenizer, model = load_tokenizer(tiny), load_policy(tiny, device="cpu")
    long_pairs = pl.DataFrame({"prompt": ["12+34+56+78+90=", "98+76+54+32+10="],
                               "chosen": ["310", "270"], "rejected": ["no idea!", "no idea! no idea!"]})
    encoded = encode_pairs(tokenizer, pl.concat([toy_pairs(12), long_pairs]), max_length=64)
    cpu = torch.device("cpu")
    capsys.readouterr()  # the loading progress bar
    assert packed_pairs(model, encoded, pad_id=tokenizer.pad_token_id, device=cpu) == frozenset(range(14))
    assert "note:" not in capsys.readouterr().err
    for cls in (dropping(transformers.LlamaForCausalLM, "position_ids"),
                dropping(transformers.LlamaForCausalLM, "attention_mask"), _DropsWideMasks):
        quirky = cls(model.config).eval()
        quirky.load_state_dict(model.state_dict())
        assert not packed_pairs(quirky, encoded, pad_id=tokenizer.pad_token_id, device=cpu)
        assert re.fullmatch(rf"note: {cls.__name__}'s packed rows do not give the rows' values \(max "
                            r"difference [0-9.e+-]+ on the 8 widest pairs\): each pair runs as two rows\n",
                            capsys.readouterr().err)
    refuses = _RefusesMasks(model.config).eval()
    refuses.load_state_dict(model.state_dict())
    assert not packed_pairs(refuses, encoded, pad_id=tokenizer.pad_token_id, device=cpu)
    assert capsys.readouterr().err == ("note: _RefusesMasks's forward refuses packed rows (ValueError: too many "
                                       "values to unpack (expected 2) second line): each pair runs as two rows\n")
    assert not refuses.training  # the check leaves the model's mode as it found it
    # dropout on (disable_dropout false): packed, chosen and rejected would share one dropout draw over the prompt
    assert not packed_pairs(model.train(), encoded, pad_id=tokenizer.pad_token_id, device=cpu)
    assert model.training and capsys.readouterr().err == ""


def test_lora_reference_disables_adapters_and_final_is_merged(tiny, tmp_path, collect):
    """LoRA on the attention projections: the cached reference is the same file as a full fine-tune's (adapters
    off = the base weights), the MLP stays untouched and the saved model has no adapter left."""
    pairs = toy_pairs(24)
    base = dict(policy_path=str(tiny), max_steps=2, batch_size=8, lr=1e-2, log_every=1, device="cpu")
    train_dpo(DPOConfig(**base), pairs, tmp_path / "full", cache_dir=tmp_path / "cache")
    logged, log = collect()
    final = train_dpo(DPOConfig(**base, lora_r=4, lora_alpha=8), pairs, tmp_path / "lora", log=log,
                      cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache" / "ref_logps").glob("*.safetensors"))) == 1
    assert logged[1][1]["train/loss"] == pytest.approx(math.log(2), abs=1e-5)  # B = 0: policy == reference
    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert set(after) == set(before)  # plain Llama keys: merged, no lora_A/lora_B
    assert json.loads((final / "config.json").read_text())["use_cache"] is True  # as its start's, not training's
    assert torch.equal(after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(after[q_proj], before[q_proj])
    load_policy(final, device="cpu")


@pytest.mark.parametrize(("targets", "expected"), [
    (("c_attn", "c_proj"), r"\['c_attn', 'c_proj'\] name no module of .*; its 2-D weights belong to \[.*'q_proj'.*\]$"),
    (("q_proj", "v_prj"), r"\['v_prj'\] name no module of .*; its 2-D weights belong to \[.*'v_proj'.*\]$"),
    (("mlp",), r"ValueError: Target module LlamaMLP\(.* is not supported\. .*; its 2-D weights belong to "),
], ids=["gpt2-names", "one-misspelled", "not-a-layer"])
def test_lora_targets_this_model_lacks_are_a_one_line_error_naming_its_own(tiny, targets, expected):
    """GPT-2 names its attention `c_attn` / `c_proj`: the Llama default must not end in peft's traceback. A
    misspelled name beside a right one was dropped by peft without a word (only q_proj got adapters); a module
    peft cannot adapt kept only the first line of its reason, which named the module and not why."""
    cfg = DPOConfig(policy_path=str(tiny), lora_r=4, lora_target_modules=targets)
    with pytest.raises(AlignflowError, match=rf"^lora_target_modules \[.*\]: {expected}") as raised:
        add_lora(load_policy(tiny, device="cpu"), cfg)
    assert "\n" not in str(raised.value)


def test_lora_on_an_embedding_tied_to_the_output_layer_is_refused(tiny):
    """Merging an adapter of a tied embedding or output layer changes the one matrix both read: the final scored
    the held-out pairs otherwise than the run logged (accuracy 0.60 -> 0.80, a helper's run). The layers around it are adapted."""
    tied = load_policy(tiny, device="cpu")
    tied.lm_head.weight = tied.get_input_embeddings().weight
    for targets in (("lm_head", "q_proj"), ("embed_tokens",)):
        cfg = DPOConfig(policy_path=str(tiny), lora_r=4, lora_target_modules=targets)
        with pytest.raises(AlignflowError, match=rf"^lora_target_modules .*: \[{targets[0]!r}\]: {tiny} ties its "
                                                 "embeddings to its output layer"):
            add_lora(tied, cfg)
    adapted = add_lora(tied, DPOConfig(policy_path=str(tiny), lora_r=4, lora_target_modules=("q_proj",)))
    assert adapted.get_output_embeddings().weight is adapted.get_input_embeddings().weight
    untied = DPOConfig(policy_path=str(tiny), lora_r=4, lora_target_modules=("lm_head",))
    adapted = add_lora(load_policy(tiny, device="cpu"), untied)  # untied: its own matrix, adapted
    assert any("lm_head.lora_A" in name for name, _ in adapted.named_parameters())


def test_nan_loss_stops_dpo(tiny, tmp_path):
    cfg = DPOConfig(policy_path=str(tiny), max_steps=4, batch_size=8, lr=1e30, max_grad_norm=None, device="cpu")
    # Adam's first update moves every weight by ~1e30: a loss or gradient within the next steps is not finite
    with pytest.raises(NonFiniteLossError, match=r"at step [1-3]; stopping"):
        train_dpo(cfg, toy_pairs(20), tmp_path / "out")
    assert not (tmp_path / "out" / "final").exists()


# ---- learning on the demo pairs (slow)


@pytest.mark.slow
def test_dpo_raises_held_out_preference_accuracy_and_margin_over_its_sft_start(tmp_path):
    """A deliberately short SFT (60 steps: held-out preference accuracy ~0.69; 150 steps already give ~0.89
    and leave only pairs DPO cannot fix in a few minutes) leaves near-miss pairs to learn from; DPO on the demo
    pairs then prefers the chosen answer on more held-out pairs (measured 0.693 -> 0.757), by a wider margin."""
    problems = pl.read_ndjson(DEMO / "problems.jsonl")
    pairs = pl.read_ndjson(DEMO / "pairs.jsonl")
    corpus = problems["prompt"].to_list() + problems["answer"].to_list() + pairs["rejected"].to_list()
    base = build_tiny_model(tmp_path / "base", corpus)
    sft = train_sft(SFTConfig(model_path=str(base), max_steps=60, batch_size=128, lr=1e-3, device="cpu"),
                    sft_rows(problems.filter(pl.col("split") == "train"), "problems"), tmp_path / "sft")
    cfg = DPOConfig(policy_path=str(sft), max_steps=150, batch_size=64, lr=3e-4, warmup_steps=10, beta=0.1,
                    device="cpu")
    started = time.perf_counter()
    final = train_dpo(cfg, pairs, tmp_path / "dpo")
    seconds = time.perf_counter() - started
    m = final_metrics(final)
    print(f"DPO demo: {seconds:.1f} s; held-out pref accuracy {m['eval/pref_accuracy_start']:.3f} -> "
          f"{m['eval/pref_accuracy']:.3f}, logp margin {m['eval/logp_margin_start']:.1f} -> "
          f"{m['eval/logp_margin']:.1f}, "
          f"implicit reward accuracy {m['eval/rewards_accuracy']:.3f}")
    assert m["eval/pref_accuracy"] >= m["eval/pref_accuracy_start"] + 0.03
    assert m["eval/logp_margin"] >= m["eval/logp_margin_start"] + 10.0
    assert m["eval/rewards_accuracy"] >= m["eval/rewards_accuracy_start"] + 0.4  # measured 0.207 -> 0.773


