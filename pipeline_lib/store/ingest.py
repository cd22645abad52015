"""Ingest a data file into the store: read, validate, deduplicate by content hash, quarantine bad rows.

Files: .jsonl, .json (array), .csv (each also gzipped: .jsonl.gz ...), .parquet. Record shapes: pairs, hh,
chat, ranking, problem. Invariant of every ingest: rows read = accepted + duplicates + quarantined."""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import re
import shlex
import stat
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
import polars as pl

from pipeline_lib.errors import AlignflowError, text_start
from pipeline_lib.fingerprint import content_id, fingerprint_path
from pipeline_lib.store.db import Store, position
from pipeline_lib.store.parquet import ParquetError, read_parquet_lines
from pipeline_lib.store.shapes import (
    FIELDS, HH_TURN, SCHEMAS, TABLE_OF, TOO_DEEP, Rows, one_answer_per_prompt, pair_id, shape_records,
)

FORMATS = ("pairs", "hh", "chat", "ranking", "problem")
SUFFIXES = (".jsonl.gz", ".json.gz", ".csv.gz", ".jsonl", ".json", ".parquet", ".csv")
RAW_LIMIT = 10_000  # characters of a quarantined record kept in `raw`
_DETECT_SAMPLE = 1_000  # records whose keys vote for the detected format
# ends every object key, so a line with more of these than its record has keys may repeat a key
_KEY_END = re.compile(rb'"\s*:')
# orjson reads an integer past 64 bits as a float, which it writes with an exponent of 18 or more
_HUGE_NUMBER = re.compile(rb"e\+(?:1[89]|[2-9][0-9]|[0-9]{3})")
# the tokens that delimit the records of a JSON array: strings (whose text may hold brackets), brackets, commas.
# A string left open by a cut file runs to the end: retried from each escaped quote in it, the scan was quadratic
_ARRAY_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{},]')
# one object's end and the next one's start with a lone CR between: JSON text holds no raw CR inside a string.
# Possessive: a backtracking `}\s*\r\s*{` took time quadratic in a run of CRs (blank lines) after the last `}`
_CR_BETWEEN_RECORDS = re.compile(rb"}[^\S\r]*+\r\s*+{")
# the first line of a JSON Lines file named .json: an object on one line, and the next record's start
_FIRST_OF_LINES = re.compile(rb"\s*(\{[^\n]*)\n\s*\{")
# a NaN or Infinity value, as Python writes them; only words the reason of a line that failed to parse
_NON_JSON_NUMBER = re.compile(rb"[:\[,]\s*-?(?:NaN|Infinity)\s*[,}\]]")
_FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFCHR: "a character device",
               stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}  # what a data file is not
_UTF8_BOM = b"\xef\xbb\xbf"
# byte-order marks, UTF-32's before UTF-16's (FF FE 00 00 starts with FF FE); Python's codec names
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"),
         (b"\xff\xfe", "UTF-16LE"), (b"\xfe\xff", "UTF-16BE"))
# which of the byte positions mod 4 hold NUL bytes in text of these encodings without a byte-order mark: an ASCII
# character is its byte and one (UTF-16) or three (UTF-32) NULs; JSON and CSV text in UTF-8 holds none
_NUL_PATTERNS = {(False, True, False, True): "UTF-16LE", (True, False, True, False): "UTF-16BE",
                 (False, True, True, True): "UTF-32LE", (True, True, True, False): "UTF-32BE"}
_ID_FIELDS = {
    "preference_pairs": ("pair_id", ["prompt", "chosen", "rejected", "prompt_messages"]),  # shapes.pair_id
    "rankings": ("ranking_id", ["prompt", "responses"]),
    "problems": ("problem_id", ["prompt", "answer"]),
}


class IngestError(AlignflowError):
    """A file that cannot be ingested at all (missing, unreadable, unknown type or shape); one line, whatever the
    file's name holds (a line break in it is written `\\n`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))


@dataclass(frozen=True)
class IngestReport:
    """What one ingest did; rows_read = accepted + duplicates + quarantined always holds.
    `fingerprint` is the input file's (pipeline_lib.fingerprint.fingerprint_path)."""

    file: str
    format: str
    source: str
    table: str
    rows_read: int
    accepted: int
    duplicates: int
    quarantined: int
    seconds: float
    fingerprint: str
    elsewhere: str = ""
    """Duplicates the store holds under another source (or split): where, e.g. "40 under source 'a'"."""
    own_splits: str = ""
    """The file's problems (quarantined ones and in-file duplicates left out) whose records name a split other than
    the one given, which they keep: e.g. "100 test"."""
    unread_fields: str = ""
    """The records' fields no stage reads (kept in each row's meta), with how many records hold each, ten at most:
    e.g. "'system' (20), 'id' (20)". A `system` beside text pairs is no system turn: chat messages carry one."""
    replaced: str = ""
    """With `replace`, the source's rows deleted before the file's were stored, per table: e.g. "problems 100"."""
    others: int = 0
    """Rows the source holds in the file's table (of the file's splits, for problems) that the file does not."""

    def summary(self, workspace: Path | None = None) -> str:
        """The counts line; the commands it names run in `workspace` where given."""
        at = f"-w {shlex.quote(str(workspace))} " if workspace else ""
        line = (f"{Path(self.file).name} ({self.format} -> {self.table}): read {self.rows_read} = "
                f"accepted {self.accepted} + duplicates {self.duplicates} + quarantined {self.quarantined}")
        if self.replaced:
            line += f"; the rows source {self.source!r} held were deleted first ({self.replaced})"
        if self.others:
            line += (f"; source {self.source!r} also holds {self.others} rows this file does not (another file's, or "
                     "an earlier version's: `--replace` keeps this file's alone)")
        if self.elsewhere:
            line += (f"; of the duplicates, {self.elsewhere} stay as first ingested (`alignflow {at}data "
                     f"delete --source NAME` removes a source)")
        if self.own_splits:
            line += f"; of its problems, these name their own split, which wins over the split given: {self.own_splits}"
        if self.unread_fields:
            line += f"; fields kept in meta, which no stage reads: {self.unread_fields}"
        return line

    def quarantine_hint(self, workspace: Path) -> str:
        """The command that shows why rows were quarantined (empty when none was)."""
        if not self.quarantined:
            return ""
        return (f"why {self.quarantined} rows were quarantined: alignflow -w {shlex.quote(str(workspace))} data "
                f"quarantine --source {shlex.quote(self.source)}")

    def metrics(self) -> dict[str, float]:
        """`ingest/<count>` metrics for the tracking log."""
        names = ("rows_read", "accepted", "duplicates", "quarantined", "seconds")
        return {f"ingest/{name}": float(getattr(self, name)) for name in names}

    def markdown(self) -> str:
        """The counts as a markdown table (a Prefect artifact)."""
        rows = "\n".join(
            f"| {name} | {getattr(self, name)} |" for name in ("rows_read", "accepted", "duplicates", "quarantined")
        )
        return f"**{self.summary()}**\n\n| count | rows |\n|---|---|\n{rows}\n"

    def as_dict(self) -> dict[str, str | int | float]:
        return asdict(self)


def ingest_file(
    path: str | Path,
    store: Store,
    *,
    format: str = "auto",
    source: str | None = None,
    split: str | None = None,
    max_record_bytes: int = 1_000_000,
    replace: bool = False,
) -> IngestReport:
    """Ingest one file into its table (by shape); bad rows go to `quarantine` with a reason.

    `source` defaults to the file name without its extension; `split` applies to problems whose
    records have no `split` field (default "train"; stripped as a record's own is, so `test ` is the test split).
    With `replace`, the source's stored rows (every ingested table, the quarantine too) are deleted in the
    transaction that stores the file's. Raises IngestError for a file it cannot read."""
    start = time.perf_counter()
    path = Path(path)
    if format not in ("auto", *FORMATS):
        raise IngestError(f"{path}: unknown format {format!r}; expected auto, {', '.join(FORMATS)}")
    if max_record_bytes <= 0:
        raise IngestError(f"{path}: max_record_bytes must be > 0, got {max_record_bytes}")
    suffix = suffix_of(path)
    source = source or default_source(path)
    lines, line_nos, pre_bad, fmt = _read_records(path, suffix, format, max_record_bytes)
    _refuse_split(path, fmt, split)
    given = split
    split = "train" if split is None else split.strip()
    if not split:
        raise IngestError(f"{path}: split is blank; expected a split name such as train or test")
    rows = _screen(lines, fmt, max_record_bytes, pre_bad)
    accepted, bad = shape_records(fmt, rows, split=split)
    table = TABLE_OF[fmt]
    if table == "problems":
        stored = {} if replace else store.stored_problems(source, accepted)  # replaced: no answer to conflict with
        accepted, conflicts = one_answer_per_prompt(accepted, stored)
        bad += conflicts
    # the file as named, not the target of a symlink: a Hugging Face snapshot's train.parquet links to a blob whose
    # name has no suffix, so neither the user nor `position` (row or line) would know it
    quarantine = _quarantine_frame(lines, line_nos, sorted(rows.bad + bad), source, os.path.abspath(path))
    rejected = {i for i, _ in bad}  # the fields a quarantined record held are kept nowhere
    read_from_meta = ("solution",) if fmt == "problem" else ()  # SFT trains on a problem's worked solution
    unread = Counter(name for i, names in rows.extra_fields.items() if i not in rejected
                     for name in names if name not in read_from_meta).most_common()
    n_records = rows.n_records
    del lines, rows  # free the raw lines and the parsed frame before hashing and inserting (peak memory)
    candidates = _with_ids(table, accepted, source)
    del accepted
    # first occurrence wins inside the file; the store's anti-join skips ids it already holds
    first = candidates.select(pl.col(_ID_FIELDS[table][0]).is_first_distinct()).to_series()
    unique = candidates if first.all() else candidates.filter(first)
    # a split given (`--split`) does not move the file's problems that name theirs: said, not silent
    own = unique.filter(pl.col("split") != split)["split"].value_counts(sort=True) \
        if given is not None and table == "problems" else None
    with store.transaction():
        deleted = store.delete_source(source) if replace else {}
        inserted = store.insert_new(table, unique)
        store.replace_quarantine(source, os.path.abspath(path), quarantine)
        # rows already stored under another source (or split) keep it: a new --source/--split does not move them.
        # Every candidate, not only the unique ones: a record repeated in the file is one duplicate held there per copy
        columns = ["source", "split"] if table == "problems" else ["source"]
        elsewhere = store.stored_elsewhere(table, candidates, columns) if inserted < candidates.height else []
        # rows of the source (of the file's splits) the file does not hold: another file's, an earlier version's of
        # this one, or rows an older alignflow accepted and this one quarantines
        others = store.count_others(table, source, candidates)
    report = IngestReport(
        file=str(path),
        format=fmt,
        source=source,
        table=table,
        rows_read=n_records,
        accepted=inserted,
        duplicates=candidates.height - inserted,
        quarantined=quarantine.height,
        seconds=time.perf_counter() - start,
        fingerprint=fingerprint_path(path),
        elsewhere=" and ".join(_placement(columns, row) for row in elsewhere),
        own_splits="" if own is None else ", ".join(f"{count} {name}" for name, count in own.iter_rows()),
        unread_fields=_unread_fields(unread),
        replaced=", ".join(f"{table} {n}" for table, n in deleted.items() if n),
        others=others,
    )
    if report.rows_read != report.accepted + report.duplicates + report.quarantined:
        raise RuntimeError(f"ingest invariant broken (a bug in alignflow): {report.summary()}")
    return report


def _unread_fields(unread: list[tuple[str, int]], shown: int = 10) -> str:
    """`'system' (20), 'id' (20)`: the commonest `shown` names, quoted (a line break in a key stays on the counts
    line) and cut to 60 characters, then how many more (5,000 keys made a 79 KB line)."""
    names = [f"{text_start(name, 60)} ({count})" for name, count in unread[:shown]]
    return ", ".join(names) + (f" and {len(unread) - shown} more" if len(unread) > shown else "")


def _placement(columns: list[str], row: tuple) -> str:
    """`40 under source 'a', split 'train'` from a stored_elsewhere row."""
    return f"{row[-1]} under " + ", ".join(f"{column} {value!r}" for column, value in zip(columns, row))


def check_readable(path: Path, format: str = "auto", max_record_bytes: int = 1_000_000,
                   split: str | None = None) -> str:
    """The format ingest_file would read `path` as, or the IngestError it would raise for the file as a whole
    (unknown type, unreadable, no records, no detectable format, a split for records that have none), without
    touching the store: the CLI and preset loading call it before a run starts, so such a file fails in one line at
    once."""
    fmt = _read_records(path, suffix_of(path), format, max_record_bytes)[3]
    _refuse_split(path, fmt, split)
    return fmt


def _refuse_split(path: Path, fmt: str, split: str | None) -> None:
    """A split given for records that go to a table without one (pairs, rankings) would be ignored silently."""
    if split is not None and TABLE_OF[fmt] != "problems":
        raise IngestError(f"{path}: split {split!r} given, but its {fmt} records go to {TABLE_OF[fmt]}, which has no "
                          "split (only problems do); leave split out")


def _read_records(
    path: Path, suffix: str, format: str, limit: int
) -> tuple[list[bytes], Sequence[int], dict[int, str], str]:
    """_read_lines' (lines, line_nos, pre_bad) and the format to read them as. IngestError for a file with no record
    at all (empty, blank lines, `[]`, a CSV header alone), whatever the format: an ingest of nothing is a wrong path
    more often than an intended no-op."""
    try:
        lines, line_nos, pre_bad = _read_lines(path, suffix)
    except MemoryError:  # a gzip bomb, or a file larger than memory allows
        raise IngestError(f"{path}: the file's data does not fit in this process's memory") from None
    if all(not line or line.isspace() for line in lines):
        raise IngestError(f"{path}: the file holds no records")
    fmt = _detect_format(path, lines, line_nos, pre_bad, limit) if format == "auto" else format
    return lines, line_nos, pre_bad, fmt


# ---- reading: every file type becomes a list of JSON lines (one per record) plus its numbering


def default_source(path: Path) -> str:
    """The source of a file ingested without one: its name without its type ending (`hh.jsonl.gz` -> `hh`)."""
    return path.name[: -len(suffix_of(path))]


def suffix_of(path: Path) -> str:
    """The file type of `path`: the one of SUFFIXES its name ends with; IngestError if none, or if `path` is no
    regular file (missing, a dir; a FIFO would block until written to, /dev/zero never ends)."""
    try:
        kind = _FILE_KINDS.get(stat.S_IFMT(path.stat().st_mode))  # a symlink's target
    except FileNotFoundError:
        raise IngestError(f"{path}: no such file") from None
    except OSError as exc:
        raise IngestError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    if kind is not None:
        raise IngestError(f"{path}: is {kind}, expected a data file")
    name = path.name.lower()
    for suffix in SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return suffix
    raise IngestError(f"{path}: unknown file type; expected one of {', '.join(SUFFIXES)}")


def _read_lines(path: Path, suffix: str) -> tuple[list[bytes], Sequence[int], dict[int, str]]:
    """(lines, line_nos, pre_bad): record i is reported as line_no line_nos[i].

    Every number is 1-based: for text files (jsonl, json, csv) the physical line the record starts on (a CSV header
    is line 1), for parquet the row number. pre_bad maps record index -> reason for records the reader itself
    rejected."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise IngestError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    gzipped = suffix.endswith(".gz")
    if data.startswith(b"\x1f\x8b") and not gzipped:  # a reader of the named type would only say "invalid"
        named = f"*{suffix}.gz" if f"{suffix}.gz" in SUFFIXES else "*.jsonl.gz, *.json.gz or *.csv.gz by its content"
        raise IngestError(f"{path}: the content is a gzip file but the name ends in {suffix}; name it {named}")
    if data.startswith(b"PAR1") and suffix != ".parquet":
        raise IngestError(f"{path}: the content is a parquet file but the name ends in {suffix}; name it *.parquet")
    if gzipped:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise IngestError(f"{path}: not a readable gzip file ({exc})") from None
        suffix = suffix.removesuffix(".gz")
    if suffix == ".parquet":
        try:
            lines, pre_bad = read_parquet_lines(data)
        except ParquetError as exc:
            raise IngestError(f"{path}: {exc}") from None
        return lines, range(1, len(lines) + 1), pre_bad
    data = _utf8(path, data)
    if suffix == ".json" and _json_lines(data):  # `Dataset.to_json` writes JSON Lines under this name
        suffix = ".jsonl"
    elif suffix == ".jsonl" and re.match(rb"\s*\[", data) and _parses(data):
        suffix = ".json"  # one JSON array under a JSON Lines name: its records, not one record that is a list
    if suffix == ".jsonl":
        lines = data.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()
        if _UTF8_BOM in data:  # files joined with `cat`: each may start with its own mark
            lines = [line.removeprefix(_UTF8_BOM) for line in lines]
        return lines, range(1, len(lines) + 1), {}
    if suffix == ".json":
        try:
            items = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            # an array with a bad record (NaN, a cut end) has its records screened one by one, if any is whole
            lines, line_nos = _array_items(data) if re.match(rb"\s*\[", data) else ([], [])
            if not any(_parses(line) for line in lines):
                raise IngestError(f"{path}: not valid JSON ({exc})") from None
            return lines, line_nos, {}
        if not isinstance(items, list):
            raise IngestError(f"{path}: expected a JSON array of records, got {_json_type(items)}")
        # each record as written, screened like a JSONL line: orjson's parse of the whole array has already
        # dropped repeated keys and rounded huge integers
        lines, line_nos = _array_items(data) if items else ([], [])
        return lines, line_nos, {}
    return _csv_lines(path, data)


def _utf8(path: Path, data: bytes) -> bytes:
    """The text of a data file as UTF-8 without a byte-order mark: UTF-16 and UTF-32 (Excel's and PowerShell's
    "Unicode") are decoded when a byte-order mark names them; without one, such a file is a one-line IngestError
    naming the encoding, as is a file its mark does not fit. Other bytes stay as they are: a line that is not UTF-8
    is quarantined alone."""
    if data.startswith(_UTF8_BOM):  # a UTF-8 byte-order mark is not part of the first record
        return data[len(_UTF8_BOM):]
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data[len(bom):].decode(encoding).encode()
            except UnicodeDecodeError as exc:
                raise IngestError(f"{path}: starts with a {encoding} byte-order mark but is not {encoding} text "
                                  f"({exc.reason} at byte {len(bom) + exc.start})") from None
    sample = data[:4096]
    nul_bytes = tuple(sample[k::4].count(0) > len(sample) // 20 for k in range(4))  # a fifth of its bytes or more
    # the file's first character has the pattern too: UTF-16 lines after UTF-8 ones are that file's bad lines
    if tuple(byte == 0 for byte in sample[:4]) == nul_bytes and (encoding := _NUL_PATTERNS.get(nul_bytes)):
        raise IngestError(f"{path}: the file is {encoding} text without a byte-order mark; convert it to UTF-8 "
                          f"(iconv -f {encoding} -t UTF-8 FILE > NEW_FILE)")
    return data


def _parses(text: bytes) -> bool:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True


def _json_lines(data: bytes) -> bool:
    """Whether a .json file holds JSON Lines: its first line is a whole JSON object and a record follows."""
    first = _FIRST_OF_LINES.match(data)
    return first is not None and _parses(first[1])


def _array_items(data: bytes) -> tuple[list[bytes], list[int]]:
    """The text of each record of a JSON array as written, one line each, and the line (1-based) each record starts
    on. Line breaks become tabs: outside a string both are whitespace, inside one both are invalid JSON, so a
    record with a raw line break in a string is still quarantined, not read with a space there. Scans strings, brackets
    and commas only: no depth limit. A record that is not valid JSON stays one item (the screen quarantines it); an
    array cut short ends at the file's end."""
    commas, depth, first, last = [], 0, 0, len(data)
    for token in _ARRAY_TOKEN.finditer(data):
        char = token[0]
        if char in (b"[", b"{"):
            depth += 1
            if depth == 1:
                first = token.end()
        elif char in (b"]", b"}"):
            depth -= 1
            if depth == 0:
                last = token.start()
                break
        elif char == b"," and depth == 1:
            commas.append(token.start())
    spans = list(zip([first] + [comma + 1 for comma in commas], commas + [last]))
    if data[last + 1:].strip():  # text after the array's end
        spans.append((last + 1, len(data)))
    items, line_nos, line, counted = [], [], 1, 0
    for start, end in spans:
        text = data[start:end]
        begin = start + len(text) - len(text.lstrip())
        line += data.count(b"\n", counted, begin)
        counted = begin
        items.append(text.strip().replace(b"\n", b"\t").replace(b"\r", b"\t"))
        line_nos.append(line)
    return items, line_nos


def _csv_lines(path: Path, data: bytes) -> tuple[list[bytes], list[int], dict[int, str]]:
    """CSV records as JSON lines (header name -> cell text), with the physical line each starts on.

    Python's csv module reads the file (_csv_records): it reports a ragged row as it is (polars pads a short row, or
    refuses the file) and counts the lines a quoted cell spans. Blank lines hold no record."""
    text = data.decode("utf-8", errors="surrogateescape")  # invalid UTF-8 rejects its row, not the file
    physical = io.StringIO(text, newline="").readlines()
    # no cell is longer than the file; the record size limit applies later, as for every file type.
    # The limit is process-wide: only ever raise it, another thread may be reading a CSV file too.
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))
    records = _csv_records(physical)
    _, _, header = next(records, (1, 1, []))
    if isinstance(header, str):
        raise IngestError(f"{path}: cannot read the CSV header on line 1 ({header})")
    if not any(name.strip() for name in header) and text.strip():
        raise IngestError(f"{path}: the CSV header on line 1 is blank; the first line must name the columns")
    try:
        orjson.dumps(header)
    except orjson.JSONEncodeError:  # a name holds an undecodable byte (a surrogate escape)
        raise IngestError(f"{path}: invalid UTF-8 in the CSV header on line 1") from None
    header = [name.strip() for name in header]  # `prompt, chosen, rejected`
    repeated = [name for name, n in Counter(header).items() if n > 1 and name]
    if repeated:
        raise IngestError(f"{path}: the header repeats column '{repeated[0]}'")
    # a spreadsheet's trailing empty columns have no name: their cells must be empty too
    unnamed = [k for k, name in enumerate(header) if not name]
    lines, line_nos, pre_bad = [], [], {}
    for first, last, row in records:
        if isinstance(row, str):
            reason = row
        elif len(row) < 2 and not (row and row[0].strip()):  # blank lines hold no record
            continue
        elif len(row) != len(header):
            reason = f"row has {len(row)} fields, the header has {len(header)}"
        elif filled := [k for k in unnamed if row[k].strip()]:
            reason = f"field {filled[0] + 1} holds text but the header names no column there"
        elif (first_cell := row[0].removeprefix("\ufeff").strip()) == header[0] \
                and [first_cell, *(cell.strip() for cell in row[1:])] == header:
            reason = "row repeats the CSV header"  # files joined with `cat`: each may start with its own mark
        else:
            try:
                lines.append(orjson.dumps({name: cell for name, cell in zip(header, row) if name}))
                line_nos.append(first)
                continue
            except orjson.JSONEncodeError:  # a cell holds an undecodable byte (a surrogate escape)
                reason = "invalid UTF-8"
        line_nos.append(first)
        pre_bad[len(lines)] = reason  # the row's own text is its raw
        lines.append("".join(physical[first - 1 : last]).rstrip("\r\n").encode(errors="surrogateescape"))
    return lines, line_nos, pre_bad


def _csv_records(physical: list[str]) -> Iterator[tuple[int, int, list[str] | str]]:
    """(first line, last line, cells) of each CSV record, lines 1-based; cells is the reason for a record the
    csv module cannot read.

    It reads strictly: its default dialect silently ends a cell still quoted at the end of the file and glues the
    text after a closing quote to the cell (`"q"z` is `qz`), so one unclosed quote would fold the rest of the file
    into one row. A record that fails on its first line is that line; one that fails further on began with a quote
    that did not close (it ran on to the next quote in the file, or to its end): then only its first line is
    rejected and the next record starts on the line after it, so the lines the quote ran over are records again."""
    offset, reader = 0, csv.reader(physical, strict=True)
    while True:
        first = offset + reader.line_num + 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            last = offset + reader.line_num
            if last == first:  # the reader goes on with the next line
                yield first, first, f"malformed CSV ({exc})"
                continue
            yield first, first, f"unclosed quote: the quoted cell runs on to line {last} ({exc})"
            # the lines from `first` on, without copying them (a copy per such record was quadratic)
            offset, reader = first, csv.reader(map(physical.__getitem__, range(first, len(physical))), strict=True)
            continue
        yield first, offset + reader.line_num, row


# ---- format detection and the per-record screen (JSON validity, object, field types)


def _shape_of(record: dict) -> str | None:
    if "responses" in record:
        return "ranking"
    if "chosen" in record and "rejected" in record:
        if isinstance(record["chosen"], list) or isinstance(record.get("prompt"), list):
            return "chat"
        if "prompt" in record:
            return "pairs"
        # an HH transcript holds its turn markers; pairs whose prompt sits under another name are no transcript
        return "hh" if isinstance(record["chosen"], str) and HH_TURN in record["chosen"] else None
    if ("answer" in record or "solution" in record) and ("question" in record or "prompt" in record
                                                         or "problem" in record):  # GSM8K, MATH
        return "problem"
    return None


def _detect_format(
    path: Path, lines: list[bytes], line_nos: Sequence[int], pre_bad: dict[int, str], limit: int
) -> str:
    """The shape most of the first parsable records have; IngestError if none has a known shape, naming the most
    common reason the records were refused (and how many were) if no record could be read as a JSON object."""
    votes: Counter[str] = Counter()
    first_keys: list[str] | None = None
    seen = 0
    for i, line in enumerate(lines):
        if seen >= _DETECT_SAMPLE:
            break
        if i in pre_bad or not line or line.isspace():
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        seen += 1
        first_keys = first_keys if first_keys is not None else sorted(record)
        shape = _shape_of(record)
        if shape:
            votes[shape] += 1
    if votes:
        return votes.most_common(1)[0][0]
    if first_keys is None:  # nor here: it would quarantine every record, refused by the reader
        bad = _screen(lines, "pairs", limit, pre_bad).bad  # any format: no record gets as far as its fields
        reason, same = Counter(reason for _, reason in bad).most_common(1)[0]
        first = next(line_nos[i] for i, other in bad if other == reason)
        raise IngestError(f"{path}: cannot detect the record format: no record could be read ({same} of {len(bad)} "
                          f"records: {reason}; the first on {position(str(path), first)})")
    if len(first_keys) == 1 and any(sep in first_keys[0] for sep in ";\t|"):
        raise IngestError(f"{path}: cannot detect the record format (one field {first_keys[0]!r}): "
                          f"only comma-separated CSV is read; convert the file to commas")
    if {"chosen", "rejected"} <= set(first_keys):
        raise IngestError(f"{path}: cannot detect the record format (fields {first_keys}): pairs need a 'prompt' "
                          f"field, and 'chosen' holds no HH-RLHF transcript ({HH_TURN!r} turns); name the "
                          f"prompt's field 'prompt'")
    raise IngestError(
        f"{path}: cannot detect the record format (fields {first_keys}); the shapes read are pairs (prompt, chosen, "
        "rejected), hh (chosen and rejected HH-RLHF transcripts), chat (chosen and rejected message lists), ranking "
        "(prompt, responses[, ranks]) and problem (question, prompt or problem, with answer or solution): rename "
        "the fields"
    )


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    return {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _screen(lines: list[bytes], fmt: str, limit: int, pre_bad: dict[int, str]) -> Rows:
    """Parse every record once with orjson (strict JSON and UTF-8, exact types); polars then reads
    only the lines that passed, so its lenient casts (1 -> "1") never see a wrong type. The stdlib
    parser reads a line again only where orjson loses something: a repeated key, a huge integer."""
    fields = FIELDS[fmt]
    known = frozenset(name for names, _, _ in fields for name in names)
    # required one-name string fields are checked inline (the common case, ~0.2 us a record);
    # _field_problem runs for the other fields and to word the reason of a failed record
    simple = tuple(names[0] for names, kind, required in fields if kind == "text" and required and len(names) == 1)
    rest = tuple(field for field in fields if field[0][0] not in simple)
    only_simple = not rest
    alternatives = tuple(names for names, _, _ in fields if len(names) > 1)
    keep = fmt == "chat"  # chat is shaped from the parsed messages, not from a polars read
    loads, decode_error, key_ends = orjson.loads, orjson.JSONDecodeError, _KEY_END.findall
    good: list[int] = []
    bad: list[tuple[int, str]] = []
    metas: dict[int, str] = {}
    extra_fields: dict[int, list[str]] = {}
    records: list[dict] = []
    n_records = 0
    for i, line in enumerate(lines):
        if i in pre_bad:
            n_records += 1
            bad.append((i, pre_bad[i]))
            continue
        # the record's JSON text: a JSON Lines record without the CR of a CRLF ending, a CSV or parquet row as the
        # JSON record it becomes (its cells' line breaks and control characters escaped)
        if len(line) > limit and (size := len(line) - line.endswith(b"\r")) > limit:
            n_records += 1
            bad.append((i, f"record is {size:,} bytes as JSON > max_record_bytes {limit:,}"))
            continue
        try:
            record = loads(line)
        except decode_error as exc:
            if not line or line.isspace():  # blank lines hold no record
                continue
            n_records += 1
            bad.append((i, _decode_reason(line, exc)))
            continue
        n_records += 1
        if type(record) is not dict:
            bad.append((i, f"record is {_json_type(record)}, expected a JSON object"))
            continue
        for name in simple:
            if type(record.get(name)) is not str:
                reason = _field_problem(record, fields)
                break
        else:
            reason = None if only_simple else _field_problem(record, rest)
        if reason is not None:
            bad.append((i, reason))
            continue
        if only_simple:  # with only required fields, a longer record must have extra fields
            extra = len(record) > len(simple)
        else:  # a field's second name (problem: prompt beside question) is an extra field too
            extra = bool(alternatives) or not record.keys() <= known
        try:
            if len(key_ends(line)) > len(record):  # more key ends than keys: a key may be repeated
                _check_unique_keys(line)
            if extra and (extras := _extra_keys(record, known, alternatives)):
                metas[i] = _meta(line, record, extras)
                extra_fields[i] = extras
        except _Rejected as exc:
            bad.append((i, str(exc)))
            continue
        good.append(i)
        if keep:
            records.append(record)
    frame = None
    if not keep:
        buffer = b"\n".join([lines[i] for i in good])
        frame = pl.read_ndjson(buffer, schema=SCHEMAS[fmt]) if good else pl.DataFrame(schema=SCHEMAS[fmt])
        if frame.height != len(good):
            raise RuntimeError(f"polars read {frame.height} records of {len(good)} screened lines (a bug)")
    return Rows(n_records=n_records, index=good, frame=frame, records=records, metas=metas, bad=bad,
                extra_fields=extra_fields)


class _Rejected(Exception):
    """A record the screen quarantines; the message is the reason."""


def _check_unique_keys(line: bytes) -> None:
    """Raise _Rejected if an object in the line repeats a key: orjson keeps the last value and polars the
    first, so the record would be checked with one value and stored with the other."""

    def unique(pairs: list[tuple[str, object]]) -> None:
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _Rejected(f"duplicate key '{key}'")
            seen.add(key)

    try:
        json.loads(line, object_pairs_hook=unique)
    except RecursionError:  # the stdlib parser reads fewer levels than orjson
        raise _Rejected(TOO_DEEP) from None


def _extra_keys(record: dict, known: frozenset[str], alternatives: tuple[tuple[str, ...], ...]) -> list[str]:
    """Keys no field uses: unknown names, and a field's other names that hold a value besides the one it uses (the
    first that holds one, as `_field_problem` picks)."""
    extras = [key for key in record if key not in known]
    for names in alternatives:
        extras += [name for name in names if record.get(name) is not None][1:]
    return extras


def _meta(line: bytes, record: dict, extras: list[str]) -> str:
    """JSON of the record's `extras` fields, with integers past 64 bits exact (orjson reads them as
    floats: then the stdlib parser reads the line again). Raises _Rejected if it nests too deep."""
    try:
        meta = orjson.dumps({key: record[key] for key in extras})
    except orjson.JSONEncodeError:  # orjson reads 1024 levels but writes only MAX_DEPTH
        raise _Rejected(TOO_DEEP) from None
    if _HUGE_NUMBER.search(meta):
        exact = json.loads(line)
        return json.dumps({key: exact[key] for key in extras}, ensure_ascii=False, separators=(",", ":"))
    return meta.decode()


def _decode_reason(line: bytes, exc: orjson.JSONDecodeError) -> str:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid UTF-8"
    if _CR_BETWEEN_RECORDS.search(line):  # the file's lines end in CR alone (classic Mac OS)
        return "records separated by a lone '\\r': JSON Lines ends each line with '\\n'"
    if _NON_JSON_NUMBER.search(line):  # Python's json.dumps writes float('nan') so by default
        return f"malformed JSON: NaN and Infinity are not JSON numbers (write null) ({exc})"
    return f"malformed JSON: {exc}"


def _field_problem(record: dict, fields: tuple) -> str | None:
    """The first field of `record` whose JSON type is wrong for its kind, as a reason; else None."""
    for names, kind, required in fields:
        # of alternatives, the first that holds a value (a table's column is null in the rows that use another),
        # else the first present, to word the reason
        name = next((alt for alt in names if record.get(alt) is not None),
                    next((alt for alt in names if alt in record), names[0]))
        value = record.get(name)
        if type(value) is str and kind in ("text", "answer", "chat_prompt"):
            continue
        if value is None:
            if required:
                alts = f" (or {' or '.join(repr(alt) for alt in names[1:])})" if len(names) > 1 else ""
                return f"field '{name}' is null" if name in record else f"missing field '{name}'{alts}"
            continue
        reason = _value_problem(name, value, kind)
        if reason is not None:
            return reason
    return None


def _value_problem(name: str, value: object, kind: str) -> str | None:
    got = _json_type(value)
    if kind == "text":
        return f"field '{name}' is {got}, expected a string"
    if kind == "answer":
        return None if type(value) in (int, float) else f"field '{name}' is {got}, expected a string or number"
    if kind == "text_list":
        if type(value) is not list:
            return f"field '{name}' is {got}, expected a list of strings"
        for j, item in enumerate(value):
            if type(item) is not str:
                return f"field '{name}' item {j} is {_json_type(item)}, expected a string"
        return None
    if kind == "rank_list":
        if type(value) is not list:
            return f"field '{name}' is {got}, expected a list of integers"
        for j, item in enumerate(value):
            if type(item) is not int or not -(2**31) <= item < 2**31:
                return f"field '{name}' item {j} is {_json_type(item)} {item!r}, expected an integer rank"
        return None
    # messages, or a chat prompt given as a list of messages
    if type(value) is not list:
        return f"field '{name}' is {got}, expected a list of {{role, content}} messages"
    for j, message in enumerate(value):
        if type(message) is not dict:
            return f"field '{name}' message {j} is {_json_type(message)}, expected an object"
        for key in ("role", "content"):
            if key not in message:  # ShareGPT's messages are {from, value}; an OpenAI tool call may leave content out
                keys = sorted(message)
                return (f"field '{name}' message {j} has no '{key}' (its keys: {keys[:8]}{'...' if keys[8:] else ''}); "
                        "expected {role, content} messages")
            if type(message[key]) is not str:
                return f"field '{name}' message {j}: '{key}' is {_json_type(message[key])}, expected a string"
    return None


# ---- ids, quarantine rows


def _with_ids(table: str, accepted: pl.DataFrame, source: str) -> pl.DataFrame:
    """Add the content-hash id (content_id of the row's id fields, a list field's items in order; a pair's is
    shapes.pair_id) and source."""
    id_column, parts = _ID_FIELDS[table]
    rows = accepted.select(parts).iter_rows()
    if table == "preference_pairs":
        ids = [pair_id(*row) for row in rows]
    else:
        ids = [content_id(*(item for value in row for item in (value if isinstance(value, list) else [value])))
               for row in rows]
    ids = pl.Series(id_column, ids, dtype=pl.String)
    return accepted.with_columns(ids, pl.lit(source, dtype=pl.String).alias("source"))


def _quarantine_frame(
    lines: list[bytes], line_nos: Sequence[int], bad: list[tuple[int, str]], source: str, file: str
) -> pl.DataFrame:
    raws, reasons = [], []
    for i, reason in bad:
        raw = lines[i].rstrip(b"\r").decode("utf-8", errors="replace")
        if len(raw) > RAW_LIMIT:
            raw = raw[:RAW_LIMIT]
            reason += f" (raw truncated to {RAW_LIMIT // 1000} KB)"
        # records of one line (a minified JSON array) share their line_no: the reason says which record it is
        if any(0 <= j < len(line_nos) and line_nos[j] == line_nos[i] for j in (i - 1, i + 1)):
            reason += f" (record {i + 1} of the file, on line {line_nos[i]})"
        raws.append(raw)
        reasons.append(reason)
    return pl.DataFrame(
        {
            "source": pl.Series([source] * len(bad), dtype=pl.String),
            "file": pl.Series([file] * len(bad), dtype=pl.String),
            "line_no": pl.Series([line_nos[i] for i, _ in bad], dtype=pl.Int64),
            "raw": pl.Series(raws, dtype=pl.String),
            "reason": pl.Series(reasons, dtype=pl.String),
        }
    )
