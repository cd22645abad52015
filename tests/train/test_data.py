"""Rows -> tensors: prompt rendering, completion masks with left padding, truncation, length buckets, the
held-out split and the run file of `python -m pipeline_lib.train.<stage> --config run.json`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import polars as pl
import pytest
import torch

from pipeline_lib.config import ConfigError, SFTConfig
from pipeline_lib.models import build_tiny_model, load_tokenizer
from pipeline_lib.train.data import (
    Encoded,
    TrainDataError,
    collate,
    collate_groups,
    encode,
    encode_frame,
    encode_texts,
    group_width,
    holdout_split,
    length_buckets,
    micro_batches,
    per_row,
    read_run_file,
    render_prompts,
    write_run_file,
)
from pipeline_lib.train.dpo import encode_pairs
from pipeline_lib.train.rm import build_groups


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "base", ["0123456789+=", "hi there!"],
                            hidden_size=64, num_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny)


def test_plain_prompts_stay_raw_and_messages_use_the_chat_template(tokenizer):
    frame = pl.DataFrame({
        "prompt": ["12+34=", "user: 1+1="],
        "prompt_messages": [None, json.dumps({"prompt": [{"role": "user", "content": "1+1="}],
                                               "chosen": [{"role": "assistant", "content": "2"}]})],
    })
    texts, templated = render_prompts(tokenizer, frame)
    assert texts == ["12+34=", "<|user|>1+1=</s><|assistant|>"]
    assert templated == [False, True]
    bare = json.dumps([{"role": "user", "content": "1+1="}])
    bare_list = frame.with_columns(pl.Series("prompt_messages", [None, bare]))
    assert render_prompts(tokenizer, bare_list)[0] == texts
    with pytest.raises(TrainDataError, match=r"prompt_messages\[0\]: expected a JSON list"):
        render_prompts(tokenizer, pl.DataFrame({"prompt": ["x"], "prompt_messages": ['{"prompt": "hi"}']}))


STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                   "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
                   "{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def test_a_chat_template_refusing_a_conversation_is_one_line_naming_the_row(tokenizer):
    """Gemma's and Mistral's templates raise on a system turn (jinja2 TemplateError): one line, not a traceback."""
    strict = load_tokenizer(tokenizer.name_or_path)
    strict.chat_template = STRICT_TEMPLATE
    system = json.dumps({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]})
    frame = pl.DataFrame({"prompt": ["1+1=", "system: Be brief.\n\nuser: 2+2?"],
                          "prompt_messages": [json.dumps([{"role": "user", "content": "1+1="}]), system]})
    with pytest.raises(TrainDataError) as raised:
        render_prompts(strict, frame)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("prompt_messages[1] (prompt 'system: Be brief.")
    assert "roles system, user" in message
    assert "TemplateError: Only user and assistant roles are supported!" in message
    assert render_prompts(strict, frame[:1])[0] == ["<|user|>1+1=</s><|assistant|>"]


def test_conversations_for_a_tokenizer_without_a_chat_template_are_one_line_not_display_text(tokenizer):
    """DPO and RM on chat pairs with a template-less tokenizer trained on `system: ...\\n\\nuser: ...`; now they stop,
    and plain rows (HH-RLHF transcripts and the demo pairs store no messages) still train on their raw prompt."""
    bare = load_tokenizer(tokenizer.name_or_path)
    bare.chat_template = None
    chat = json.dumps({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]})
    pairs = pl.DataFrame({"prompt": ["\n\nHuman: 1+1=\n\nAssistant:", "system: Be brief.\n\nuser: 2+2?"],
                          "chosen": ["2", "4"], "rejected": ["3", "5"], "prompt_messages": [None, chat]},
                         schema_overrides={"prompt_messages": pl.String})
    for run in (lambda: render_prompts(bare, pairs), lambda: encode_pairs(bare, pairs, max_length=64),
                lambda: build_groups(bare, pairs, "bradley_terry", max_length=64)):
        with pytest.raises(TrainDataError) as raised:
            run()
        assert str(raised.value).startswith(
            f"1 of 2 rows are chat conversations (prompt_messages), but the tokenizer of {tokenizer.name_or_path} "
            "has no chat template to render them")
    assert render_prompts(bare, pairs[:1]) == (["\n\nHuman: 1+1=\n\nAssistant:"], [False])
    assert len(encode_pairs(bare, pairs[:1], max_length=64)) == 2


def test_encode_appends_eos_and_masks_only_the_completion(tokenizer):
    """Char-level ids: '12+34=' is 6 tokens, '46' 2 + eos; '9+9=' 4, '18' 2 + eos -> widths 9 and 7."""
    encoded = encode(tokenizer, ["12+34=", "9+9="], ["46", "18"], max_length=64)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert encoded.completion_ids[0][-1] == eos and len(encoded.completion_ids[0]) == 3
    assert tokenizer.decode(encoded.prompt_ids[1]) == "9+9="
    batch = collate(encoded, [0, 1], pad_id=pad)
    assert batch.input_ids.shape == (2, 9)
    assert batch.attention_mask.tolist() == [[1] * 9, [0, 0] + [1] * 7]
    assert batch.completion_mask.tolist() == [[0] * 6 + [1] * 3, [0] * 6 + [1] * 3]
    assert batch.input_ids[1, :2].tolist() == [pad, pad]  # left padding
    assert tokenizer.decode(batch.input_ids[1, 2:].tolist(), skip_special_tokens=True) == "9+9=18"
    same_length = collate(encoded, [0, 0], pad_id=pad)
    assert bool(same_length.attention_mask.all())  # equal lengths: no padding at all


def test_a_dataset_is_tokenized_in_chunks_to_the_same_ids(tokenizer, monkeypatch):
    """One tokenizer call over a whole dataset held an Encoding object per text (3.4 GiB for 450k texts, a helper);
    calls of TOKENIZE_CHUNK texts give the same ids, templated and raw prompts, completions and whole texts."""
    from pipeline_lib.models import tokens

    prompts = [f"{i}+{i}=" for i in range(11)]
    completions = [str(2 * i) for i in range(11)]
    templated = [i % 3 == 0 for i in range(11)]
    whole = encode(tokenizer, prompts, completions, max_length=64, templated=templated)
    texts = encode_texts(tokenizer, prompts, max_length=64)
    monkeypatch.setattr(tokens, "TOKENIZE_CHUNK", 2)  # 11 texts: six calls, the last of one text
    assert encode(tokenizer, prompts, completions, max_length=64, templated=templated) == whole
    assert encode_texts(tokenizer, prompts, max_length=64) == texts
    assert tokens.token_ids(tokenizer, prompts) == tokenizer(prompts)["input_ids"]


def test_a_prompt_without_tokens_is_refused(tokenizer):
    """The tiny tokenizer adds no bos: an empty prompt would leave the completion's first token unpredicted (a
    log-prob of 0 in the loss's denominator)."""
    assert tokenizer("")["input_ids"] == []
    with pytest.raises(TrainDataError, match="row 1: the prompt has no tokens"):
        encode(tokenizer, ["9+9=", ""], ["18", "5"], max_length=64)


def test_templated_rows_get_no_extra_special_tokens_and_long_rows_lose_the_prompt_head(tokenizer, capsys):
    encoded = encode(tokenizer, ["<|user|>1+1=</s><|assistant|>"], ["2"], max_length=64, templated=[True])
    assert tokenizer.convert_ids_to_tokens(encoded.prompt_ids[0])[0] == "<|user|>"
    assert capsys.readouterr().err == ""
    cut = encode(tokenizer, ["123456789=", "1="], ["12", "3"], max_length=6)
    assert tokenizer.decode(cut.prompt_ids[0]) == "89=" and len(cut.completion_ids[0]) == 3  # 6 - 3
    assert "warning: 1 of 2 prompts do not fit max_length = 6 tokens beside their completion and lost their " \
           "first tokens" in capsys.readouterr().err
    with pytest.raises(TrainDataError, match="no training rows"):
        encode(tokenizer, [], [], max_length=8)


def test_a_chat_row_ends_with_the_templates_end_of_turn_where_the_model_stops_on_it(tokenizer, chatml):
    """ChatML ends an assistant turn with `<|im_end|>`, not the tokenizer's eos. A model that stops on it (an
    instruct model's generation_config) gets chat rows ending as the template writes them (prompt + completion are
    the rendered conversation's tokens up to that end); a model that stops on eos alone (a base model given the
    template) keeps eos, which its sampler stops on; a plain row in the same data ends with eos."""
    chatml = load_tokenizer(chatml)
    turn = [{"role": "user", "content": "1+1="}]
    frame = pl.DataFrame({"prompt": ["user: 1+1=", "9+9="], "completion": ["2", "18"],
                          "prompt_messages": [json.dumps(turn), None]})
    eos, im_end = chatml.eos_token_id, chatml.convert_tokens_to_ids("<|im_end|>")
    encoded = encode_frame(chatml, frame, "completion", max_length=64, stops={eos, im_end})
    assert encoded.completion_ids[0] == chatml("2", add_special_tokens=False)["input_ids"] + [im_end]
    whole = chatml.apply_chat_template([*turn, {"role": "assistant", "content": "2"}], tokenize=False)
    row = encoded.prompt_ids[0] + encoded.completion_ids[0]
    assert row == chatml(whole, add_special_tokens=False)["input_ids"][:len(row)]
    assert whole.endswith("<|im_end|>\n")
    assert encoded.completion_ids[1][-1] == eos
    assert encode_frame(chatml, frame, "completion", max_length=64, stops={eos}).completion_ids[0][-1] == eos
    # the tiny model's template ends a turn with eos; one ending it with plain text gets eos too
    plain_end = encode_frame(tokenizer, frame, "completion", max_length=64, stops={tokenizer.eos_token_id})
    assert plain_end.completion_ids[0][-1] == tokenizer.eos_token_id
    chatml.chat_template = "{% for m in messages %}{{ m['content'] + '\\n\\n' }}{% endfor %}"
    assert encode_frame(chatml, frame, "completion", max_length=64, stops={eos, im_end}).completion_ids[0][-1] == eos


def test_data_the_tokenizer_cannot_read_is_a_warning(tokenizer, capsys):
    """The tiny model's tokenizer knows its corpus' characters only: HH-RLHF text became `<unk>` tokens, and the
    rows trained with no other sign of it."""
    capsys.readouterr()
    encode(tokenizer, ["1+1=", "2+2="], ["2", "4"], max_length=16)
    encode_texts(tokenizer, ["1+1=2"], max_length=16)
    assert "unknown token" not in capsys.readouterr().err
    encode(tokenizer, ["Human: What is the capital of France?"], ["Paris"], max_length=64)
    err = capsys.readouterr().err
    assert re.fullmatch(r"warning: (\d+) of (\d+) tokens \(\d+%\) are the tokenizer's unknown token '<unk>': its "
                        r"vocabulary does not cover this data \(a tiny model's tokenizer holds only the characters of "
                        r"its corpus_sources; build it with these sources too\)\n", err), err
    encode_texts(tokenizer, ["1+1=2 Paris"], max_length=16)
    assert "unknown token" in capsys.readouterr().err


def test_a_completion_longer_than_the_row_is_cut_with_a_warning(tokenizer, capsys):
    long_answer = encode(tokenizer, ["1=", "2="], ["123456", "7"], max_length=4)
    assert len(long_answer.prompt_ids[0]) == 1 and len(long_answer.completion_ids[0]) == 3  # 4 - 1 kept
    assert tokenizer.eos_token_id not in long_answer.completion_ids[0]
    assert "warning: 1 of 2 completions are longer than max_length - 1 = 3 tokens" in capsys.readouterr().err


def test_the_answers_of_one_prompt_share_one_prompt_cut(tokenizer):
    """A DPO pair: the prompt is cut once for the longer answer, so chosen and rejected see the same prompt."""
    pair = encode(tokenizer, ["0123456789+0123456789="] * 2, ["1", "123456"], max_length=12, group_size=2)
    assert pair.prompt_ids[0] == pair.prompt_ids[1]
    assert tokenizer.decode(pair.prompt_ids[0]) == "6789="  # 12 - len("123456" + eos)
    assert [len(ids) for ids in pair.completion_ids] == [2, 7]
    with pytest.raises(TrainDataError, match="group_size 2: expected a positive divisor of 3 rows"):
        encode(tokenizer, ["a", "b", "c"], ["1", "2", "3"], max_length=12, group_size=2)


def test_fingerprint_tracks_every_id(tokenizer):
    a = encode(tokenizer, ["1+1="], ["2"], max_length=16)
    assert a.fingerprint() == encode(tokenizer, ["1+1="], ["2"], max_length=16).fingerprint()
    assert a.fingerprint() != encode(tokenizer, ["1+1="], ["3"], max_length=16).fingerprint()
    assert a.fingerprint() != Encoded([[1], [2]], [[3], [4]]).fingerprint()


def test_encode_texts_matches_the_reward_scorer_tokenization(tokenizer, capsys):
    encoded = encode_texts(tokenizer, ["12+34=46", "hi"], max_length=5)
    assert encoded.prompt_ids[0] == tokenizer("12+34=46")["input_ids"][-5:]
    assert encoded.completion_ids == [[], []]
    assert "warning: 1 of 2 texts (prompt + response) are longer than max_length = 5 tokens and lost their first " \
           "tokens" in capsys.readouterr().err


def test_the_models_positions_cut_where_fewer_than_max_length_with_a_note_instead_of_the_warnings(tokenizer, capsys):
    """Learned absolute positions raise IndexError past them: `positions` below max_length cuts as max_length would
    (prompts from the left, one prompt cut per group, then the completion from the right; texts from the left), with
    one note, since raising max_length would not help; positions at or above max_length change nothing."""
    capsys.readouterr()
    rows = (["0123456789+0123456789="] * 2 + ["1="] * 2, ["1", "123456", "7", "8"])
    cut = encode(tokenizer, *rows, max_length=64, group_size=2, positions=12)
    assert capsys.readouterr().err == ("note: 2 of 4 rows are cut to the model's 12 positions (under max_length 64): "
                                       "prompts lose their first tokens, then completions their last\n")
    assert cut == encode(tokenizer, *rows, max_length=12, group_size=2)
    capsys.readouterr()
    long_answer = encode(tokenizer, ["1="], ["123456"], max_length=64, positions=4)
    assert capsys.readouterr().err.startswith("note: 1 of 1 rows are cut to the model's 4 positions")
    assert long_answer == encode(tokenizer, ["1="], ["123456"], max_length=4)
    capsys.readouterr()
    assert encode(tokenizer, *rows, max_length=12, group_size=2, positions=12) == cut
    assert encode(tokenizer, *rows, max_length=12, group_size=2, positions=100) == cut
    assert "warning: 1 of 2 prompts do not fit max_length = 12" in capsys.readouterr().err
    assert encode(tokenizer, *rows, max_length=64, positions=32) == encode(tokenizer, *rows, max_length=64)
    assert capsys.readouterr().err == ""  # nothing cut: no note
    texts = ["12+34=46", "hi"]
    encoded = encode_texts(tokenizer, texts, max_length=64, positions=5)
    assert capsys.readouterr().err == (
        "note: 1 of 2 texts (prompt + response) are longer than the model's 5 positions (under max_length 64) and "
        "lost their first tokens, as the reward model's scorer cuts them\n")
    assert encoded == encode_texts(tokenizer, texts, max_length=5)


def test_encode_frame_needs_its_columns(tokenizer):
    with pytest.raises(TrainDataError, match=r"missing column\(s\) \['completion'\]"):
        encode_frame(tokenizer, pl.DataFrame({"prompt": ["1+1="]}), "completion", max_length=8)


def test_length_buckets_and_per_row_keep_row_order(tokenizer):
    assert length_buckets([9, 75, 10, 80, 9]) == [[0, 4, 2], [1, 3]]
    assert length_buckets([4, 4, 4]) == [[0, 1, 2]]
    encoded = Encoded([[1] * 9, [1] * 75, [1] * 10], [[2], [2, 2], [2]])
    widths = per_row(lambda b: torch.full((b.input_ids.shape[0],), float(b.input_ids.shape[1])), encoded,
                     [0, 1, 2], pad_id=0, device=torch.device("cpu"))
    assert widths.tolist() == [11.0, 77.0, 11.0]  # rows 0, 2 share an 11-wide batch; row 1 goes alone
    lengths = per_row(lambda b: b.attention_mask.sum(-1).float(), encoded, [2, 0, 1], pad_id=0,
                      device=torch.device("cpu"))
    assert lengths.tolist() == [11.0, 10.0, 77.0]


def test_micro_batches_and_holdout_split():
    assert micro_batches([5, 6, 7, 8], 2) == [[5, 6], [7, 8]]
    with pytest.raises(TrainDataError, match="3 rows per rank is not a multiple of grad_accum_steps 2"):
        micro_batches([1, 2, 3], 2)
    prompts = [f"p{i}" for i in range(100)]
    train, held = holdout_split(prompts, 0.1, seed=0)
    assert len(held) == 10 and sorted(train + held) == list(range(100))
    assert holdout_split(prompts, 0.1, seed=0) == (train, held)
    assert holdout_split(prompts, 0.1, seed=1)[1] != held
    assert len(holdout_split(["a", "b", "c"], 0.01, seed=0)[1]) == 1  # at least one held out
    # rows sharing a prompt stay together: 3 prompts x 2 rows, one prompt (two rows) held out
    train, held = holdout_split(["a", "b", "a", "c", "b", "c"], 0.3, seed=0)
    assert len(held) == 2 and len({["a", "b", "a", "c", "b", "c"][i] for i in held}) == 1
    with pytest.raises(TrainDataError, match="at least 2 distinct prompts"):
        holdout_split(["a", "a"], 0.5, seed=0)


def test_run_file_round_trip_and_one_line_errors(tmp_path):
    cfg = SFTConfig(model_path="m", max_steps=3)
    rows = pl.DataFrame({"prompt": ["1+1="], "completion": ["2"]})
    path = write_run_file(tmp_path / "run.json", cfg, {"rows": rows}, tmp_path / "out", cache_dir="c")
    loaded, frames, out_dir, options = read_run_file(path, SFTConfig)
    assert loaded == cfg and frames["rows"].equals(rows)
    assert out_dir == tmp_path / "out" and options == {"cache_dir": "c"}

    raw = json.loads(path.read_text())
    raw["config"]["max_stepz"] = 4
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"run.json: config: unknown field 'max_stepz'"):
        read_run_file(path, SFTConfig)
    with pytest.raises(TrainDataError, match="run file not found"):
        read_run_file(tmp_path / "missing.json", SFTConfig)
    raw["config"].pop("max_stepz")
    raw["data"]["rows"] = "gone.parquet"
    path.write_text(json.dumps(raw))
    with pytest.raises(TrainDataError, match=r"data.rows: .*gone.parquet not found"):
        read_run_file(path, SFTConfig)


def test_a_group_packs_its_shared_prefix_once_then_each_texts_own_tokens():
    texts = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8, 1],  # group 0: prefix 5 6 (the second text leaves it at 9)
             [3, 4], [3, 4]]  # group 1: two equal texts keep their last token each
    encoded = Encoded(texts, [[] for _ in texts])
    assert [group_width(encoded, g) for g in ([0, 1, 2], [3, 4])] == [2 + 2 + 1 + 3, 1 + 1 + 1]
    batch = collate_groups(encoded, [[0, 1, 2], [3, 4]], pad_id=0, texts=3)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 7, 8, 1], [0, 0, 0, 0, 0, 3, 4, 4]]
    assert batch.attention_mask.tolist() == [[1] * 8, [0] * 5 + [1] * 3]
    packed = batch.packed
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 2, 3, 4], [0, 0, 0, 0, 0, 0, 1, 1]]
    assert packed.segments.tolist() == [[0, 0, 1, 1, 2, 3, 3, 3], [0, 0, 0, 0, 0, 0, 1, 2]]
    assert packed.ends.tolist() == [[3, 4, 7], [6, 7, 0]]  # each text's last token; 0 past a group's size
    assert packed.lengths.tolist() == [[4, 3, 5], [2, 2, 0]]
