"""The record shapes: their fields, and the content checks that turn screened records
into table rows (pairs, hh, chat -> preference_pairs; ranking -> rankings; problem -> problems)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import orjson
import polars as pl

from pipeline_lib.fingerprint import content_id
from pipeline_lib.rewards.math import boxed_content

# (names, kind, required): the first of `names` that holds a value is the field; kinds are checked per record
# by ingest._field_problem (exact JSON types) before polars reads the values.
FIELDS: dict[str, tuple[tuple[tuple[str, ...], str, bool], ...]] = {
    "pairs": ((("prompt",), "text", True), (("chosen",), "text", True), (("rejected",), "text", True)),
    "hh": ((("chosen",), "text", True), (("rejected",), "text", True)),
    "chat": ((("prompt",), "chat_prompt", False), (("chosen",), "messages", True), (("rejected",), "messages", True)),
    "ranking": ((("prompt",), "text", True), (("responses",), "text_list", True), (("ranks",), "rank_list", False)),
    # MATH records have no answer field: the last \boxed{} of their solution is the answer
    "problem": ((("question", "prompt", "problem"), "text", True), (("answer", "solution"), "answer", True),
                (("split",), "text", False)),
}
SCHEMAS: dict[str, dict[str, pl.DataType]] = {
    "pairs": {"prompt": pl.String, "chosen": pl.String, "rejected": pl.String},
    "hh": {"chosen": pl.String, "rejected": pl.String},
    "ranking": {"prompt": pl.String, "responses": pl.List(pl.String), "ranks": pl.List(pl.Int64)},
    # numbers in `answer` (screened as int/float) become their decimal text
    "problem": {"question": pl.String, "prompt": pl.String, "problem": pl.String, "answer": pl.String,
                "solution": pl.String, "split": pl.String},
}
TABLE_OF = {"pairs": "preference_pairs", "hh": "preference_pairs", "chat": "preference_pairs",
            "ranking": "rankings", "problem": "problems"}
# the roles a stored prompt's messages may have: what HF chat templates know (a reply's is `assistant`, split_chat).
# OpenAI's `developer` (its newer name for `system`) is refused with that hint: most open models' templates would
# render it as a role the model never saw, and Gemma's and Mistral's raise on it
PROMPT_ROLES = ("system", "user", "assistant", "tool")
# What Python's str.strip() strips (str.isspace): Unicode White_Space, which polars' strip_chars() and the regex `\s`
# take, and the separators U+001C..U+001F, which they do not. Every emptiness and sameness test takes this one set
# (the chat checks are Python's): a reply of "\x1c" is empty in every record shape and to the filters.
WHITESPACE = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200b)))
              + "\u2028\u2029\u202f\u205f\u3000")
BLANK = r"^[\s\x1c-\x1f]*$"  # anchored: stops at the first non-space character, no copy of the text
# a chat message list written as text: JSON's `[{"role": ...` or a pandas CSV export's Python `[{'content': ...`
MESSAGES_AS_TEXT = r"""^\s*\[\s*\{\s*["'](?:role|content|from|value)["']\s*:"""
HH_TURN = "\n\nAssistant:"
HH_HUMAN_TURN = "\n\nHuman:"
MAX_DEPTH = 254  # levels of nesting orjson writes (it reads 1024): a deeper record cannot be stored
TOO_DEEP = f"nested deeper than {MAX_DEPTH} levels"


@dataclass(frozen=True)
class Rows:
    """Records that passed the screen: line indices, their polars frame (or parsed dicts for chat),
    the JSON of their extra fields by line index, and the (line index, reason) of those that failed."""

    n_records: int
    index: list[int]
    frame: pl.DataFrame | None
    records: list[dict]
    metas: dict[int, str]
    bad: list[tuple[int, str]]
    extra_fields: dict[int, list[str]]
    """The fields the format does not read (kept in meta) of each record that holds some, by line index."""


def shape_records(fmt: str, rows: Rows, *, split: str) -> tuple[pl.DataFrame, list[tuple[int, str]]]:
    """Rows of the format's table (without id and source) and the (line index, reason) rejected here."""
    if fmt == "chat":
        return _chat(rows)
    frame = rows.frame.with_columns(
        pl.Series("_idx", rows.index, dtype=pl.Int64),
        pl.Series("meta", [rows.metas.get(i) for i in rows.index], dtype=pl.String)
        if rows.metas
        else pl.lit(None, dtype=pl.String).alias("meta"),
    )
    if fmt == "problem":
        return _problem(frame, split)
    return {"pairs": _pairs, "hh": _hh, "ranking": _ranking}[fmt](frame)


def _blank(column: str) -> pl.Expr:
    return pl.col(column).str.contains(BLANK)


def _split_off(frame: pl.DataFrame, reason: pl.Expr) -> tuple[pl.DataFrame, list[tuple[int, str]]]:
    """Rows whose `reason` is null, and (line index, reason) of the others."""
    frame = frame.with_columns(reason.alias("_reason"))
    bad = frame.filter(pl.col("_reason").is_not_null()).select("_idx", "_reason").rows()
    return frame.filter(pl.col("_reason").is_null()).drop("_reason"), bad


def _empty_fields(*columns: str) -> pl.Expr:
    expr = pl.when(_blank(columns[0])).then(pl.lit(f"empty field '{columns[0]}'"))
    for column in columns[1:]:
        expr = expr.when(_blank(column)).then(pl.lit(f"empty field '{column}'"))
    return expr


def _stripped(expr: pl.Expr) -> pl.Expr:
    """Text without its surrounding whitespace: two responses that differ only there are identical (a pair of them
    holds no preference), in every record shape (chat turns compare so too)."""
    return expr.str.strip_chars(WHITESPACE)


def _pairs(frame: pl.DataFrame) -> tuple[pl.DataFrame, list[tuple[int, str]]]:
    reason = _empty_fields("prompt", "chosen", "rejected")
    for column in ("prompt", "chosen", "rejected"):  # the list's syntax and its user turn would be trained on
        reason = reason.when(pl.col(column).str.contains(MESSAGES_AS_TEXT)).then(pl.lit(
            f"field '{column}' holds a chat message list written as text ([{{'role': ...): store the list itself "
            "(a JSON array of {role, content} objects; a CSV cannot hold one: write JSON Lines or parquet)"))
    reason = reason.when(_stripped(pl.col("chosen")) == _stripped(pl.col("rejected"))) \
        .then(pl.lit("chosen identical to rejected"))
    ok, bad = _split_off(frame, reason)
    no_messages = pl.lit(None, dtype=pl.String).alias("prompt_messages")
    return ok.select("prompt", "chosen", "rejected", no_messages, "meta"), bad


def hh_prompt_end(chosen: str, rejected: str) -> int | None:
    """End of the HH prompt: the longest common prefix of both transcripts that ends right after a
    "\\n\\nAssistant:" turn marker. A marker inside a response (real rows have them) lies past the
    shared prefix unless both responses share the text up to it. None if there is no such prefix."""
    end = len(chosen)
    while (k := chosen.rfind(HH_TURN, 0, end)) >= 0:
        cut = k + len(HH_TURN)
        if rejected.startswith(chosen[:cut]):
            return cut
        end = cut - 1  # this marker is past the shared prefix: try the one before it
    return None


def _hh(frame: pl.DataFrame) -> tuple[pl.DataFrame, list[tuple[int, str]]]:
    """The prompt ends with "\\n\\nAssistant:"; responses keep their text as is (usually a leading
    space), so prompt + chosen is exactly the original transcript."""
    reason = _empty_fields("chosen", "rejected").when(pl.col("chosen") == pl.col("rejected")).then(
        pl.lit("chosen identical to rejected")
    )
    frame, bad = _split_off(frame, reason)
    keep, prompts, chosens, rejecteds = [], [], [], []
    for row, (idx, chosen, rejected) in enumerate(frame.select("_idx", "chosen", "rejected").iter_rows()):
        cut = hh_prompt_end(chosen, rejected)
        if cut is None:
            bad.append((idx, "no common prompt ending with '\\n\\nAssistant:'"))
            continue
        empty = [name for name, text in (("chosen", chosen), ("rejected", rejected)) if not text[cut:].strip()]
        if empty:
            bad.append((idx, f"empty response after prompt extraction ({empty[0]})"))
            continue
        # a Human turn after the last reply: the transcript of a chat record whose messages end with a user turn
        human_last = [name for name, text in (("chosen", chosen), ("rejected", rejected))
                      if text.rfind(HH_HUMAN_TURN, cut) > text.rfind(HH_TURN, cut)]
        if human_last:
            bad.append((idx, f"'{human_last[0]}' does not end with an assistant message (a '\\n\\nHuman:' turn "
                             f"follows its last reply)"))
            continue
        # more turns after the shared prompt: the sides differ at an earlier turn, as split_chat refuses
        more_turns = [name for name, text in (("chosen", chosen), ("rejected", rejected))
                      if HH_HUMAN_TURN in text[cut:]]
        if more_turns:
            bad.append((idx, f"'chosen' and 'rejected' differ before their last reply ('{more_turns[0]}' continues "
                             "with a '\\n\\nHuman:' turn and another reply): a pair needs one shared prompt and one "
                             "reply each"))
            continue
        if chosen[cut:].strip() == rejected[cut:].strip():  # as _stripped
            bad.append((idx, "chosen identical to rejected"))
            continue
        keep.append(row)
        prompts.append(chosen[:cut])
        chosens.append(chosen[cut:])
        rejecteds.append(rejected[cut:])
    kept = frame[keep] if keep else frame.clear()
    return pl.DataFrame(
        {
            "prompt": pl.Series(prompts, dtype=pl.String),
            "chosen": pl.Series(chosens, dtype=pl.String),
            "rejected": pl.Series(rejecteds, dtype=pl.String),
            "prompt_messages": pl.Series([None] * len(keep), dtype=pl.String),
            "meta": kept["meta"],
        }
    ), bad


def _render(messages: list[dict]) -> str:
    """Plain text of a conversation: the `prompt` column, for display (chat templates apply at training time)."""
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _turns(messages: list[dict]) -> list[tuple[str, str]]:
    """What makes two messages the same turn: role and content, surrounding whitespace aside. Other keys do not
    (a parquet column gives every message the union of its struct fields, `name: null` or `tool_calls: []` on
    one side only), nor does the trailing space of a string prompt."""
    return [(m["role"], m["content"].strip()) for m in messages]


def _message(message: dict) -> dict:
    """A message as stored: its keys without a null value (a parquet struct's absent fields)."""
    return {key: value for key, value in message.items() if value is not None}


def _conversation(prompt: list[dict] | None, messages: list[dict]) -> list[dict]:
    """The whole conversation of a chosen/rejected list given the record's prompt messages (split_chat)."""
    if not prompt:
        return messages
    k, turns, prompt_turns = len(prompt), _turns(messages), _turns(prompt)
    if any(turns[i:i + k] == prompt_turns for i in range(len(messages) - k + 1)):
        return messages  # it holds the prompt: a whole conversation (with a system message the prompt lacks)
    overlap = next((j for j in range(min(k, len(messages)), 0, -1) if prompt_turns[k - j:] == turns[:j]), 0)
    return prompt + messages[overlap:]


def split_chat(record: dict) -> str | tuple[str, str, str, str]:
    """(prompt text, chosen, rejected, messages JSON) of a conversational record, or a reason.

    chosen/rejected hold a whole conversation or, with `prompt` (a message list or one user message), a reply
    to it: a conversation is the prompt + the list, unless the list already holds the prompt's messages (then
    it is the conversation) or begins with the prompt's last ones (they are joined there: a `prompt` with a
    system message and conversations that start at the user turn). The prompt is the two conversations'
    longest common message prefix; after it each side must be exactly one assistant reply: a pair whose sides
    differ at an earlier turn has no one prompt to train on and is quarantined, not cut to its last reply. The
    prompt's messages must have a role of PROMPT_ROLES."""
    prompt = record.get("prompt")
    given = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    conversations = {name: _conversation(given, record[name]) for name in ("chosen", "rejected")}
    chosen, rejected = conversations["chosen"], conversations["rejected"]
    chosen_turns, rejected_turns = _turns(chosen), _turns(rejected)
    if chosen_turns == rejected_turns:
        return "chosen identical to rejected"
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen_turns[n] == rejected_turns[n]:
        n += 1
    if n == 0:
        missing = "" if given else " and there is no 'prompt'"
        return f"no prompt: 'chosen' and 'rejected' share no first message{missing}"
    prompt_messages = [_message(m) for m in chosen[:n]]
    completions = {"chosen": [_message(m) for m in chosen[n:]], "rejected": [_message(m) for m in rejected[n:]]}
    unknown = next((j for j, m in enumerate(prompt_messages) if m["role"] not in PROMPT_ROLES), None)
    if unknown is not None:
        role = prompt_messages[unknown]["role"]
        hint = " (OpenAI's newer name for 'system': rename it 'system')" if role == "developer" else ""
        return f"prompt message {unknown} has role {role!r}{hint}; expected one of {', '.join(PROMPT_ROLES)}"
    if not any(m["content"].strip() for m in prompt_messages):
        return "empty field 'prompt'"
    for name, messages in completions.items():
        if not messages or not messages[-1]["content"].strip():
            return f"empty response after prompt extraction ({name})"
        if messages[-1]["role"] != "assistant":
            return f"'{name}' does not end with an assistant message (role {messages[-1]['role']!r})"
        if len(messages) > 1:
            roles = ", ".join(m["role"] for m in messages)
            return (f"'chosen' and 'rejected' differ before their last reply ('{name}' continues with {roles}): "
                    f"a pair needs one shared prompt and one reply each")
    try:
        messages = orjson.dumps({"prompt": prompt_messages, **completions}).decode()
    except orjson.JSONEncodeError:  # a message holds more than the role and content it needs
        return TOO_DEEP
    return (_render(prompt_messages), completions["chosen"][0]["content"], completions["rejected"][0]["content"],
            messages)


def pair_id(prompt: str, chosen: str, rejected: str, prompt_messages: str | None) -> str:
    """A preference pair's id: content_id(prompt, chosen, rejected), or for a conversation its messages JSON
    (split_chat's, the prompt's messages and both replies). The rendered prompt text cannot key a conversation:
    [user "a\\n\\nassistant: b"] and [user "a", assistant "b"] render alike, and so does the plain prompt
    `user: q` and the conversation [user "q"]. JSON text holds no raw "\\x1f": the id is the JSON's sha256."""
    if prompt_messages is None:
        return content_id(prompt, chosen, rejected)
    return content_id(prompt_messages)


def _chat(rows: Rows) -> tuple[pl.DataFrame, list[tuple[int, str]]]:
    columns: dict[str, list] = {"prompt": [], "chosen": [], "rejected": [], "prompt_messages": [], "meta": []}
    bad = []
    for idx, record in zip(rows.index, rows.records):
        result = split_chat(record)
        if isinstance(result, str):
            bad.append((idx, result))
            continue
        for name, value in zip(("prompt", "chosen", "rejected", "prompt_messages"), result):
            columns[name].append(value)
        columns["meta"].append(rows.metas.get(idx))
    return pl.DataFrame({name: pl.Series(values, dtype=pl.String) for name, values in columns.items()}), bad


def _ranking(frame: pl.DataFrame) -> tuple[pl.DataFrame, list[tuple[int, str]]]:
    """Responses are stored best -> worst and their ranks as 1..K, aligned with them (the record's ranks refer to
    its own order of the responses and would misread beside the reordered ones). Without `ranks` the responses
    are best first as written; a record that carries scores of its own instead is refused (which way is best?)."""
    k = pl.col("responses").list.len()
    ranks = pl.col("ranks")
    scores = pl.coalesce([pl.when(pl.col("meta").str.json_path_match(f"$.{name}").is_not_null()).then(pl.lit(name))
                          for name in ("scores", "score", "ratings", "rating", "rewards", "rank", "ranking")])
    reason = (
        _empty_fields("prompt")
        .when(ranks.is_null() & scores.is_not_null())
        .then(pl.format("no 'ranks' but a field '{}': without ranks the responses are read best first as written, "
                        "which it may contradict; give 'ranks' (1 = best)", scores))
        .when(k < 2)
        .then(pl.format("ranking has {} response(s), needs at least 2", k))
        .when(pl.col("responses").list.eval(pl.element().str.contains(BLANK)).list.any())
        .then(pl.lit("empty response in 'responses'"))
        .when(ranks.is_not_null() & (ranks.list.len() != k))
        .then(pl.format("{} ranks for {} responses", ranks.list.len(), k))
        .when(ranks.is_not_null() & (ranks.list.sort() != pl.int_ranges(1, k + 1)))
        .then(pl.format("ranks [{}] are not a permutation of 1..{}", ranks.cast(pl.List(pl.String)).list.join(", "), k))
        .when(pl.col("responses").list.eval(_stripped(pl.element())).list.n_unique() < k)
        .then(pl.lit("ranking has identical responses"))
    )
    ok, bad = _split_off(frame, reason)
    ok = ok.with_columns(
        pl.when(ranks.is_null())
        .then(pl.col("responses"))
        .otherwise(pl.col("responses").list.gather(ranks.list.eval(pl.element().arg_sort())))
        .alias("responses"),
        pl.int_ranges(1, k + 1).cast(pl.List(pl.Int32)).alias("ranks"),
    )
    return ok.select("prompt", "responses", "ranks", "meta"), bad


def _problem(frame: pl.DataFrame, split: str) -> tuple[pl.DataFrame, list[tuple[int, str]]]:
    """GSM8K answers ("... #### 18"): `answer` is the text after "####", the solution goes to meta.solution (what SFT
    trains on). A record with a `solution` field of its own keeps it: if that differs from the answer's, the row is
    quarantined, as either way one of the two solutions would be lost. A MATH record has a `solution` and no
    `answer`: the answer is the content of its last \\boxed{}, the solution goes to meta.solution. `split` is used
    where a record has no `split` field of its own."""
    from_solution = pl.col("answer").is_null()
    # only the rows without an answer: boxed_content runs in Python, once a row
    boxed = pl.when(from_solution).then(pl.col("solution")) \
        .map_elements(boxed_content, return_dtype=pl.String, skip_nulls=True).str.strip_chars(WHITESPACE)
    frame = frame.with_columns(
        pl.coalesce("question", "prompt", "problem").alias("_prompt"),
        pl.when(pl.col("question").is_not_null()).then(pl.lit("question"))
        .when(pl.col("prompt").is_not_null()).then(pl.lit("prompt"))
        .otherwise(pl.lit("problem")).alias("_name"),
        pl.when(from_solution).then(boxed)
        .when(pl.col("answer").str.contains("####", literal=True))
        .then(pl.col("answer").str.split("####").list.last().str.strip_chars(WHITESPACE))
        .otherwise(pl.col("answer"))
        .alias("_final"),
    )
    reason = (
        pl.when(pl.col("_prompt").str.contains(BLANK))
        .then(pl.format("empty field '{}'", pl.col("_name")))
        .when(from_solution & pl.col("_final").is_null())
        .then(pl.lit("no 'answer' field, and field 'solution' has no \\boxed{} answer"))
        .when(from_solution & (pl.col("_final") == ""))
        .then(pl.lit("no 'answer' field, and the last \\boxed{} of field 'solution' is empty"))
        .when(_blank("answer"))
        .then(pl.lit("empty field 'answer'"))
        .when(~from_solution & ~pl.col("answer").str.contains("####", literal=True)
              & _stripped(pl.col("answer")).str.contains("\n", literal=True)
              & ~pl.col("answer").str.contains(r"\\(?:boxed|fbox)"))
        .then(pl.format("field 'answer' holds {} lines and no '####': a worked solution, not a gold answer (the "
                        "verifier would compare answers to all of it); put the final answer in 'answer', its "
                        "solution under 'solution'", _stripped(pl.col("answer")).str.count_matches("\n") + 1))
        .when(pl.col("_final") == "")
        .then(pl.lit("empty answer after '####'"))
    )
    ok, bad = _split_off(frame, reason)
    keep, metas = [], []
    for row, (idx, answer, solution, meta) in enumerate(ok.select("_idx", "answer", "solution", "meta").iter_rows()):
        worked = solution if answer is None else answer if "####" in answer else None
        if worked is not None:
            extra = json.loads(meta) if meta else {}  # the stdlib parser keeps integers past 64 bits exact
            if extra.setdefault("solution", worked) != worked:
                bad.append((idx, "fields 'solution' and 'answer' hold different worked solutions ('answer' has one "
                                 "before '####'); keep one of them"))
                continue
            meta = json.dumps(extra, ensure_ascii=False, separators=(",", ":"))
        keep.append(row)
        metas.append(meta)
    ok = ok[keep] if keep else ok.clear()
    return ok.select(
        pl.when(pl.col("split").is_null() | _blank("split"))
        .then(pl.lit(split))
        .otherwise(_stripped(pl.col("split")))  # `test ` is the test split, not one of its own
        .alias("split"),
        pl.col("_prompt").alias("prompt"),
        pl.col("_final").alias("answer"),
        pl.Series("meta", metas, dtype=pl.String),
        "_idx",  # for `one_answer_per_prompt`, which drops it
    ), bad


def one_answer_per_prompt(problems: pl.DataFrame, stored: dict[str, set[tuple[str, str | None]]]
                          ) -> tuple[pl.DataFrame, list[tuple[int, str]]]:
    """The problems (with `_idx`, which this drops) whose prompt has no other gold answer, nor another worked
    solution: neither in `stored` (prompt -> the (answer, solution) pairs the source already holds: one, or more in
    a store an older alignflow wrote) nor in an earlier row of the file. A second answer made a second problem, and
    evaluation then scored every sample against both; a second solution (the same id: prompt and answer) was a
    duplicate, dropped unsaid while SFT trained on the first. A record equal to a stored problem is kept (a
    duplicate). A problem is corrected by ingesting its file again with `replace`. Returns (kept problems, (line
    index, reason) of the others)."""
    first_seen: dict[str, tuple[str, str | None]] = {}
    keep, bad = [], []
    for row, (idx, prompt, answer, meta) in enumerate(problems.select("_idx", "prompt", "answer", "meta").iter_rows()):
        solution = orjson.loads(meta).get("solution") if meta else None
        held = stored.get(prompt)
        if held is None:
            first_answer, first_solution = first_seen.setdefault(prompt, (answer, solution))
            where = "an earlier record has it"
        else:
            first_answer, first_solution = (answer, solution) if (answer, solution) in held else \
                min(held, key=lambda problem: (problem[0], problem[1] or ""))
            where = "the store holds it under this source"
        if (first_answer, first_solution) == (answer, solution):
            keep.append(row)
            continue
        other = f"another answer ({first_answer!r})" if first_answer != answer else "another worked solution"
        bad.append((idx, f"{other} for this prompt: {where}; one prompt has one gold answer and solution (to correct "
                         "a source's problems, ingest its file again with `--replace`)"))
    kept = problems[keep] if keep else problems.clear()
    return kept.drop("_idx"), bad
