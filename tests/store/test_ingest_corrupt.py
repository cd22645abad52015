"""Ingest of damaged files (issue #8): truncated .jsonl / .jsonl.gz, corrupted parquet, non-UTF-8 bytes, empty
files. Each ends as quarantined rows with reasons or one IngestError line naming the file; nothing else is
raised, nothing is written by a refused file, and rows read = accepted + duplicates + quarantined."""

from __future__ import annotations

import gzip
import io
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_lib.store.db import TABLES, open_store
from pipeline_lib.store.ingest import IngestError, check_readable, ingest_file
from pipeline_lib.store.parquet import ParquetError, parquet_json_lines

ROOT = Path(__file__).resolve().parents[2]
RECORDS = [{"prompt": f"question {i}?", "chosen": f"answer {i}", "rejected": f"wrong {7 * i}"} for i in range(40)]
JSONL = b"\n".join(orjson.dumps(r) for r in RECORDS) + b"\n"


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "store.duckdb") as s:
        yield s


def row_counts(store) -> dict[str, int]:
    return {table: store.count(table) for table in TABLES}


def refused(path: Path, store, message: str, format: str = "auto") -> str:
    """The ingest of `path` fails with one line naming the file, and leaves the store as it was."""
    before = row_counts(store)
    with pytest.raises(IngestError) as err:
        ingest_file(path, store, format=format)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}: ") and message in text, text
    assert row_counts(store) == before
    return text


def reasons(store) -> dict[int, str]:
    return dict(store.read("quarantine").select("line_no", "reason").iter_rows())


# ---- truncated files


def test_jsonl_cut_mid_record_quarantines_the_partial_last_line(tmp_path, store):
    path = tmp_path / "cut.jsonl"
    path.write_bytes(JSONL[:-12])  # the download stopped inside the 40th record, no final newline
    report = ingest_file(path, store)
    assert (report.rows_read, report.accepted, report.quarantined) == (40, 39, 1)
    # the 40th record is 69 bytes + "\n": 12 cut bytes leave 58, so the data ends at char 58
    assert reasons(store) == {40: "malformed JSON: unexpected end of data: line 1 column 59 (char 58)"}
    assert store.read("quarantine")["raw"].to_list() == [JSONL[:-12].split(b"\n")[-1].decode()]


@pytest.mark.parametrize("keep", [10, 40, 0.5, -8], ids=["header-only", "first-block", "half", "no-trailer"])
def test_truncated_gzip_is_one_line_error(tmp_path, store, keep):
    """gzip has no record boundaries to resume at: a cut stream is refused as a whole, in one line."""
    data = gzip.compress(JSONL * 20)
    cut = int(len(data) * keep) if isinstance(keep, float) else keep
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[:cut])
    refused(path, store, "not a readable gzip file (Compressed file ended before the end-of-stream marker was "
                         "reached)")


def test_gzip_of_a_truncated_jsonl_quarantines_its_partial_line(tmp_path, store):
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(JSONL[:-12]))
    report = ingest_file(path, store)
    assert (report.accepted, report.quarantined) == (39, 1)
    assert reasons(store)[40].startswith("malformed JSON: unexpected end of data")


def test_a_gzip_bomb_beyond_the_memory_limit_is_one_line(tmp_path):
    """3 GiB of newlines in 3 MB of gzip, read under a 2.5 GB address-space limit: MemoryError escaped."""
    member = gzip.compress(b"\n" * (64 << 20))
    path = tmp_path / "bomb.jsonl.gz"
    path.write_bytes(member * 48)  # gzip members one after another are one stream
    script = ("import resource, sys; from pathlib import Path\n"
              "from pipeline_lib.store.ingest import IngestError, check_readable\n"
              "resource.setrlimit(resource.RLIMIT_AS, (2500 << 20, 2500 << 20))\n"
              "try: check_readable(Path(sys.argv[1]))\nexcept IngestError as exc: print(exc)")
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == f"{path}: the file's data does not fit in this process's memory\n"


# ---- corrupted parquet


def parquet_bytes(compression: str) -> bytes:
    buffer = io.BytesIO()
    pl.DataFrame(RECORDS).write_parquet(buffer, compression=compression)
    return buffer.getvalue()


@pytest.mark.parametrize(("damage", "message"), [
    (lambda data: data[: len(data) // 2], "unreadable parquet file (parquet: File out of specification: The file "
                                          "must end with PAR1"),
    (lambda data: data[:-8], "unreadable parquet file (parquet: File out of specification: The file must end with"),
    (lambda data: data[:4] + b"\0" * (len(data) - 8) + data[-4:], "unreadable parquet file"),
], ids=["half", "footer-cut", "zeroed-body"])
def test_damaged_parquet_is_one_line_error(tmp_path, store, damage, message):
    path = tmp_path / "damaged.parquet"
    path.write_bytes(damage(parquet_bytes("zstd")))
    refused(path, store, message)


@pytest.mark.parametrize("compression", ["zstd", "uncompressed"])
def test_parquet_with_flipped_bytes_never_escapes_as_another_exception(tmp_path, store, compression):
    """40 seeded corruptions (8 bytes XOR-ed at a random offset): each ingest either refuses the file in one
    line, writing nothing, or completes with the invariant holding. Parquet pages carry no checksum by default,
    so a flip inside a plain string value can pass as different text; that is the format's limit, not a crash."""
    data = parquet_bytes(compression)
    rng = random.Random(8)
    outcomes = {"refused": 0, "ingested": 0}
    for trial in range(40):
        damaged = bytearray(data)
        offset = rng.randrange(4, len(data) - 16)
        for i in range(offset, offset + 8):
            damaged[i] ^= 0x5A
        path = tmp_path / f"flip{trial}.parquet"
        path.write_bytes(bytes(damaged))
        before = row_counts(store)
        try:
            report = ingest_file(path, store)
        except IngestError as exc:
            assert "\n" not in str(exc) and str(exc).startswith(f"{path}: ")
            assert row_counts(store) == before
            outcomes["refused"] += 1
            continue
        assert report.rows_read == report.accepted + report.duplicates + report.quarantined
        outcomes["ingested"] += 1
    assert outcomes["refused"] > 0 and outcomes["ingested"] > 0  # both paths were exercised


def panicking_parquet(path: Path) -> Path:
    """A parquet file with a damaged first data page, on which polars' Rust code panics (polars 2.1: "assertion
    failed: values.len() >= 4"); the panic hook prints its note to stderr."""
    damaged = bytearray(parquet_bytes("uncompressed"))
    damaged[654] = 0
    path.write_bytes(bytes(damaged))
    return path


def test_parquet_that_makes_polars_panic_is_one_line_error(tmp_path, store):
    """pyo3's PanicException derives from BaseException only: it escaped the reader's except clause (and crashed the
    flow with a Rust backtrace)."""
    refused(panicking_parquet(tmp_path / "panic.parquet"), store, "unreadable parquet file (")


@pytest.mark.parametrize("where", ["read_parquet", "write_ndjson"])
def test_a_polars_panic_in_reading_or_converting_parquet_is_one_line_error(monkeypatch, where):
    """The reader's own conversion (what the child process runs), in this process so polars can be made to panic."""
    def panic(*args, **kwargs):
        raise pl.exceptions.PanicException("index out of bounds: the len is 0 but the index is 0")

    monkeypatch.setattr(pl if where == "read_parquet" else pl.DataFrame, where, panic)
    with pytest.raises(ParquetError) as err:
        parquet_json_lines(parquet_bytes("zstd"))
    assert "\n" not in str(err.value) and "(index out of bounds: the len is 0 but the index is 0)" in str(err.value)


def test_parquet_that_makes_polars_abort_its_process_is_one_line_error(tmp_path, store):
    """A data page header whose value count reads as -1 makes polars allocate 2**61 bytes, and Rust aborts the
    process on the failed allocation (no exception): that was the ingest task's, the flow's or the CLI's own process.
    The reader is a child process now, so only it dies, and the file is refused in one line."""
    data = parquet_bytes("uncompressed")
    page = data.index(b"\x2c\x15", 4)  # the first data page header: its num_values field, zigzag varint 0x50 (40)
    path = tmp_path / "abort.parquet"
    path.write_bytes(data[:page + 2] + b"\x01" + data[page + 3:])  # zigzag 1 = -1
    refused(path, store, "unreadable parquet file (its reader crashed: SIGABRT)")


def test_a_parquet_reader_killed_while_it_reads_is_one_line_error(tmp_path, store):
    """The reader process SIGKILLed (the kernel's OOM killer does so) while it reads: one line, nothing written."""
    path = tmp_path / "p.parquet"
    path.write_bytes(parquet_bytes("zstd"))
    me = os.getpid()

    def kill_the_reader() -> None:
        while True:
            for pid in os.listdir("/proc"):
                if pid.isdigit() and int(pid) != me and _is_parquet_reader_of(int(pid), me):
                    os.kill(int(pid), signal.SIGKILL)
                    return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_the_reader, daemon=True)
    killer.start()
    refused(path, store, "unreadable parquet file (its reader crashed: SIGKILL)")
    killer.join(timeout=5)


def _is_parquet_reader_of(pid: int, parent: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"pipeline_lib.store.parquet" in cmdline


def write_pairs_parquet(path: Path, **columns: pa.Array) -> Path:
    """Two pairs (p1, p2) with extra columns written by pyarrow (polars writes neither maps nor UUIDs)."""
    base = {"prompt": ["p1", "p2"], "chosen": ["a", "a"], "rejected": ["b", "b"]}
    pq.write_table(pa.table({**base, **columns}), path)
    return path


def test_parquet_map_keys_become_json_object_keys(tmp_path, store):
    """polars writes a map as a JSON object only with text keys (a ComputeError traceback, retried by Prefect,
    for other keys): integer keys become their decimal text, binary keys UTF-8 text, at any depth."""
    path = write_pairs_parquet(
        tmp_path / "maps.parquet",
        scores=pa.array([[(1, "good"), (2, "bad")], []], pa.map_(pa.int64(), pa.string())),
        nested=pa.array([[[(3, "x")]], [[]]], pa.list_(pa.map_(pa.int32(), pa.string()))),
        raw=pa.array([[(b"k", b"v")], [(b"\xfe", b"v")]], pa.map_(pa.binary(), pa.binary())))
    report = ingest_file(path, store)
    assert (report.rows_read, report.accepted, report.quarantined) == (2, 1, 1)
    (row,) = store.read("preference_pairs").to_dicts()
    assert orjson.loads(row["meta"]) == {"scores": {"1": "good", "2": "bad"}, "nested": [{"3": "x"}], "raw": {"k": "v"}}
    assert store.read("quarantine")[["line_no", "reason", "raw"]].rows() == [
        (2, "invalid UTF-8 in field 'raw'", '{"prompt":"p2","chosen":"a","rejected":"b","scores":{},"nested":[{}],'
                                            '"raw":{"\ufffd":"v"}}')]


def test_parquet_map_keyed_by_structs_is_one_line_error(tmp_path, store):
    path = write_pairs_parquet(tmp_path / "struct_keys.parquet", m=pa.array(
        [[({"x": 1}, "v")], []], pa.map_(pa.struct([("x", pa.int64())]), pa.string())))
    refused(path, store, "column 'm' cannot be written as JSON: its map keys are Struct({'x': Int64}), and a JSON "
                         "object key is text")


def test_parquet_uuid_column_is_its_canonical_text(tmp_path, store):
    """DuckDB writes uuid columns as parquet UUIDs, which polars reads as 16 binary bytes: read as text they made every
    row "invalid UTF-8 in field 'id'", and the file "cannot detect the record format". A UUID is not text stored as
    bytes: it gets its canonical 8-4-4-4-12 form."""
    ids = ["9a0781d6-3a58-4153-85c6-56f96dfc0df5", "00000000-0000-0000-0000-000000000001"]
    path = write_pairs_parquet(tmp_path / "uuid.parquet", id=pa.array(
        [uuid.UUID(ids[0]).bytes, uuid.UUID(ids[1]).bytes], pa.uuid()))
    report = ingest_file(path, store)
    assert (report.accepted, report.quarantined) == (2, 0)
    assert sorted(orjson.loads(meta)["id"] for meta in store.read("preference_pairs")["meta"]) == sorted(ids)


def test_a_symlinked_parquet_file_is_named_as_given_and_its_rows_counted_as_rows(tmp_path, store):
    """A Hugging Face snapshot's data/train.parquet is a symlink to blobs/<hash>: the quarantine named the blob, and
    `data quarantine` called its rows lines."""
    blob = tmp_path / "blobs" / "9f86d081884c7d65"
    blob.parent.mkdir()
    pl.DataFrame({"prompt": ["p1", "p2"], "chosen": ["a", "same"], "rejected": ["b", "same"]}).write_parquet(blob)
    link = tmp_path / "snapshot" / "train.parquet"
    link.parent.mkdir()
    link.symlink_to(blob)
    assert ingest_file(link, store).quarantined == 1
    assert store.quarantine_reasons()[["file", "first"]].rows() == [(str(link), "row 2")]


def test_parquet_whose_every_row_is_refused_names_the_reason(tmp_path, store):
    path = tmp_path / "latin1.parquet"
    frame = pl.DataFrame({"prompt": ["é".encode("latin-1"), b"\xff"], "chosen": ["a", "a"], "rejected": ["b", "b"]})
    frame.write_parquet(path)
    refused(path, store, "cannot detect the record format: no record could be read (2 of 2 records: invalid UTF-8 "
                         "in field 'prompt'; the first on row 1)")


# ---- bytes that are not UTF-8


def test_latin1_lines_are_quarantined_and_the_utf8_ones_kept(tmp_path, store):
    lines = [orjson.dumps(RECORDS[0]), '{"prompt": "café?", "chosen": "oui", "rejected": "non"}'.encode("latin-1"),
             orjson.dumps(RECORDS[1]), b'{"prompt": "\xff\xfe", "chosen": "a", "rejected": "b"}']
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    report = ingest_file(path, store)
    assert (report.rows_read, report.accepted, report.quarantined) == (4, 2, 2)
    assert reasons(store) == {2: "invalid UTF-8", 4: "invalid UTF-8"}
    raw = dict(store.read("quarantine").select("line_no", "raw").iter_rows())
    assert raw[2] == '{"prompt": "caf\ufffd?", "chosen": "oui", "rejected": "non"}'  # kept, readable


def test_parquet_binary_columns_are_read_as_text(tmp_path, store):
    """Parquet writers often store strings as binary; polars cannot write binary as JSON (it panicked)."""
    frame = pl.DataFrame({"prompt": [b"p1", b"p2", b"p3"], "chosen": ["a", "a", "a"], "rejected": ["b", "b", "b"],
                          "x": [b"\x00", b"\xff\xfe", None], "tags": [[b"t"], [b"u"], []]})
    frame.write_parquet(tmp_path / "bin.parquet")
    report = ingest_file(tmp_path / "bin.parquet", store)
    assert (report.rows_read, report.accepted, report.quarantined) == (3, 2, 1)
    rows = store.read("preference_pairs").sort("prompt").to_dicts()
    assert [(r["prompt"], orjson.loads(r["meta"])) for r in rows] == [
        ("p1", {"x": "\x00", "tags": ["t"]}), ("p3", {"x": None, "tags": []})]
    assert store.read("quarantine")[["line_no", "reason", "raw"]].rows() == [
        (2, "invalid UTF-8 in field 'x'", '{"prompt":"p2","chosen":"a","rejected":"b","x":"\ufffd\ufffd","tags":["u"]}')]


def test_parquet_nested_binary_that_is_not_utf8_quarantines_its_row_not_the_file(tmp_path, store):
    frame = pl.DataFrame({"prompt": ["n1", "n2", "n3"], "chosen": ["a", "a", "a"], "rejected": ["b", "b", "b"],
                          "tags": [[b"t"], [b"ok", b"\xff"], []],
                          "info": [{"k": [b"v"]}, {"k": [b"w"]}, {"k": [b"\xfe"]}]})
    frame.write_parquet(tmp_path / "nested.parquet")
    report = ingest_file(tmp_path / "nested.parquet", store)
    assert (report.rows_read, report.accepted, report.quarantined) == (3, 1, 2)
    (row,) = store.read("preference_pairs").to_dicts()
    assert (row["prompt"], orjson.loads(row["meta"])) == ("n1", {"tags": ["t"], "info": {"k": ["v"]}})
    assert store.read("quarantine").sort("line_no")[["line_no", "reason", "raw"]].rows() == [
        (2, "invalid UTF-8 in field 'tags'",
         '{"prompt":"n2","chosen":"a","rejected":"b","tags":["ok","\ufffd"],"info":{"k":["w"]}}'),
        (3, "invalid UTF-8 in field 'info'",
         '{"prompt":"n3","chosen":"a","rejected":"b","tags":[],"info":{"k":["\ufffd"]}}')]


ENCODINGS = ["UTF-16LE", "UTF-16BE", "UTF-32LE", "UTF-32BE"]
UNICODE_RECORDS = [{"prompt": "café 中文 😀?", "chosen": "a", "rejected": "b"},
                   {"prompt": "same", "chosen": "x", "rejected": "x"}, RECORDS[0]]
UNICODE_FILES = {  # the same records, a bad one second, as each text file type (CRLF line ends in the CSV)
    "jsonl": "\n".join(orjson.dumps(r).decode() for r in UNICODE_RECORDS) + "\n",
    "json": orjson.dumps(UNICODE_RECORDS, option=orjson.OPT_INDENT_2).decode(),
    "csv": "prompt,chosen,rejected\r\n" + "".join(f"{r['prompt']},{r['chosen']},{r['rejected']}\r\n"
                                                   for r in UNICODE_RECORDS),
}


@pytest.mark.parametrize("suffix", UNICODE_FILES)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_utf16_or_utf32_file_with_a_byte_order_mark_reads_as_its_utf8_text(tmp_path, store, encoding, suffix):
    """What Excel and PowerShell write as "Unicode": the mark names the encoding, so the file is its text. Before,
    every line was "invalid UTF-8" (refused, or with --format every byte-line quarantined)."""
    text = UNICODE_FILES[suffix]
    (tmp_path / f"utf8.{suffix}").write_text(text, encoding="utf-8", newline="")
    (tmp_path / f"wide.{suffix}").write_bytes(("\ufeff" + text).encode(encoding))
    first = ingest_file(tmp_path / f"utf8.{suffix}", store)
    report = ingest_file(tmp_path / f"wide.{suffix}", store)
    assert (first.accepted, first.quarantined) == (2, 1)
    assert (report.format, report.rows_read, report.accepted, report.duplicates, report.quarantined) == (
        "pairs", 3, 0, 2, 1)
    quarantined = {source: store.read("quarantine", source=source)[["line_no", "raw", "reason"]].rows()
                   for source in ("utf8", "wide")}
    assert quarantined["wide"] == quarantined["utf8"] != []
    assert "café 中文 😀?" in store.read("preference_pairs")["prompt"].to_list()


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_utf16_or_utf32_without_a_byte_order_mark_is_one_line_naming_it(tmp_path, store, encoding):
    path = tmp_path / "wide.jsonl"
    path.write_bytes(JSONL.decode().encode(encoding))
    message = (f"the file is {encoding} text without a byte-order mark; convert it to UTF-8 "
               f"(iconv -f {encoding} -t UTF-8 FILE > NEW_FILE)")
    refused(path, store, message)
    refused(path, store, message, format="pairs")  # before: 41 byte-lines quarantined as invalid UTF-8
    with pytest.raises(IngestError, match=re.escape(message)):
        check_readable(path)


def test_utf16_lines_after_utf8_ones_are_quarantined_not_the_file_refused(tmp_path, store):
    """Files of two encodings joined: the NULs of the UTF-16 part, at odd offsets from the file's start, read as
    "UTF-16BE text without a byte-order mark" and refused the UTF-8 records too."""
    path = tmp_path / "joined.jsonl"
    first = JSONL.index(b"\n") + 1  # an odd number of bytes: the first record's line
    path.write_bytes(JSONL[:first] + ("\ufeff" + JSONL[first:].decode()).encode("utf-16-le"))
    report = ingest_file(path, store)
    # "\n" is b"\n\0" in UTF-16: 39 records and the b"\0" after the last newline are 40 byte-lines
    assert (report.rows_read, report.accepted, report.quarantined) == (41, 1, 40)
    assert store.read("preference_pairs")["prompt"].to_list() == [RECORDS[0]["prompt"]]


def test_a_file_its_byte_order_mark_does_not_fit_is_one_line(tmp_path, store):
    path = tmp_path / "cut.jsonl"
    path.write_bytes(("\ufeff" + JSONL.decode()).encode("utf-16-le")[:-1])  # cut inside its last character
    refused(path, store, "starts with a UTF-16LE byte-order mark but is not UTF-16LE text (truncated data at byte "
                         f"{2 * len(JSONL)})")


def test_non_utf8_json_array_is_one_line_error(tmp_path, store):
    path = tmp_path / "bad.json"
    path.write_bytes(b'[{"prompt": "\xe9", "chosen": "a", "rejected": "b"}]')
    refused(path, store, "not valid JSON (str is not valid UTF-8")


# ---- empty files


EMPTY = [
    ("empty.jsonl", b"", "the file holds no records"),
    ("blank.jsonl", b"\n\n  \n", "the file holds no records"),
    ("empty.jsonl.gz", b"", "the file holds no records"),
    ("nothing.jsonl.gz", gzip.compress(b""), "the file holds no records"),
    ("empty.csv", b"", "the file holds no records"),
    ("header.csv", b"prompt,chosen,rejected\n", "the file holds no records"),
    ("empty.json", b"", "not valid JSON (Input is a zero-length, empty document"),
    ("list.json", b"[]", "the file holds no records"),
    ("empty.parquet", b"", "unreadable parquet file"),
]


@pytest.mark.parametrize(("name", "content", "message"), EMPTY, ids=[case[0] for case in EMPTY])
def test_empty_files_are_one_line_errors(tmp_path, store, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    refused(path, store, message)
    refused(path, store, message, format="pairs")  # a named format reads no more records
    with pytest.raises(IngestError, match=re.escape(message)):
        check_readable(path, "pairs")  # what the CLI runs before starting a flow


def test_parquet_with_zero_rows_is_one_line_error(tmp_path, store):
    path = tmp_path / "zero.parquet"
    pl.DataFrame(RECORDS).head(0).write_parquet(path)
    refused(path, store, "the file holds no records")


# ---- through the CLI: the same one line, no traceback from Prefect's logs


@pytest.mark.slow  # three `alignflow ingest` subprocesses, each starting Prefect's temporary server
def test_cli_ingest_of_damaged_files_prints_one_error_line_and_no_traceback(tmp_path, subprocess_env):
    env = subprocess_env | {"ALIGNFLOW_HOME": str(tmp_path / "ws"), "PYTHONPATH": str(ROOT)}
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(JSONL)[:-8])
    result = subprocess.run([sys.executable, "-m", "flows.cli", "ingest", str(gz)], capture_output=True,
                            text=True, env=env, timeout=300, cwd=ROOT)
    assert result.returncode == 2
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {gz}: not a readable gzip file (Compressed file ended before the end-of-stream "
                      "marker was reached)"]

    panic = panicking_parquet(tmp_path / "panic.parquet")
    result = subprocess.run([sys.executable, "-m", "flows.cli", "ingest", str(panic)], capture_output=True,
                            text=True, env=env, timeout=300, cwd=ROOT)
    assert result.returncode == 2
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {panic}: unreadable parquet file ("), errors

    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(JSONL[:-12])
    result = subprocess.run([sys.executable, "-m", "flows.cli", "ingest", str(cut)], capture_output=True,
                            text=True, env=env, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "read 40 = accepted 39 + duplicates 0 + quarantined 1" in result.stdout + result.stderr
    assert os.path.getsize(tmp_path / "ws" / "store.duckdb") > 0
