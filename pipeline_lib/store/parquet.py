"""Parquet files as JSON lines for ingest, read in a child process: a damaged page header can make polars allocate
without bound and abort the process it runs in (no exception to catch), so only the reader dies and the file is
refused in one line."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

_ROOT = Path(__file__).resolve().parents[2]  # the dir holding pipeline_lib, for the child's imports


class ParquetError(ValueError):
    """A parquet file that cannot be read or written as JSON; one line, without the file's name."""


def read_parquet_lines(data: bytes) -> tuple[list[bytes], dict[int, str]]:
    """`parquet_json_lines(data)` computed by `python -m pipeline_lib.store.parquet` (bytes on its stdin, a JSON
    header line then the rows on its stdout); a reader that crashes or fails is a ParquetError naming how."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-m", "pipeline_lib.store.parquet"], input=data, capture_output=True,
                           env=env)
    if child.returncode < 0:
        raise ParquetError(f"unreadable parquet file (its reader crashed: {_signal_name(-child.returncode)})")
    if child.returncode != 0:
        last = child.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit {child.returncode}"]
        raise ParquetError(f"unreadable parquet file (its reader failed: {last[0]})")
    header, _, rows = child.stdout.partition(b"\n")
    outcome = orjson.loads(header)
    if outcome["error"] is not None:
        raise ParquetError(outcome["error"])
    return rows.splitlines(), {int(row): reason for row, reason in outcome["pre_bad"].items()}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name  # SIGABRT
    except ValueError:  # a real-time signal has no name
        return f"signal {number}"


def parquet_json_lines(data: bytes) -> tuple[list[bytes], dict[int, str]]:
    """The rows of a parquet file as JSON lines, and the rows refused while reading (row index -> reason): a float
    that is inf or NaN (not a JSON number), at the top level, or bytes that are not UTF-8.

    Binary values, at any depth (lists, structs, maps), become UTF-8 text (writers often store strings as binary,
    and polars cannot write binary as JSON); a row whose bytes are not UTF-8 is refused, its `raw` readable with
    replacement characters. Map keys become text, as JSON object keys are, and a UUID column (binary to polars)
    its canonical text."""
    try:
        frame = pl.read_parquet(io.BytesIO(data))
        uuid_columns = _uuid_columns(data)
    # a damaged file can make polars' Rust code panic: its PanicException derives from BaseException only
    except (pl.exceptions.PolarsError, pl.exceptions.PanicException, pa.ArrowException, OSError, ValueError) as exc:
        raise ParquetError(f"unreadable parquet file ({str(exc).splitlines()[0]})") from None
    frame = frame.with_columns(_uuid_text(name) for name in uuid_columns)
    pre_bad: dict[int, str] = {}
    for name, dtype in frame.schema.items():
        if dtype.is_float():  # polars writes inf and NaN as JSON null: the reason would name a null, not the value
            for i in frame.select(pl.arg_where(~pl.col(name).is_finite())).to_series():
                pre_bad.setdefault(i, f"field '{name}' is {_non_finite(frame[name][i])}, not a finite number")
        try:
            text_dtype = _text_dtype(dtype)
        except ValueError as exc:
            raise ParquetError(f"column '{name}' cannot be written as JSON: {exc}") from None
        if text_dtype == dtype:
            continue
        try:
            frame = frame.with_columns(frame[name].cast(text_dtype))  # every value UTF-8: one vectorised cast
        # some are not (find their rows), or map keys that polars does not cast (convert them one by one)
        except (pl.exceptions.ComputeError, pl.exceptions.InvalidOperationError):
            texts = []
            for i, value in enumerate(frame[name].to_list()):
                try:
                    texts.append(_decoded(value, "strict"))
                except UnicodeDecodeError:
                    pre_bad.setdefault(i, f"invalid UTF-8 in field '{name}'")
                    texts.append(_decoded(value, "replace"))
            frame = frame.with_columns(pl.Series(name, texts, dtype=text_dtype))
    try:
        text = frame.write_ndjson()
    except (pl.exceptions.PolarsError, pl.exceptions.PanicException) as exc:  # a type polars cannot write as JSON
        raise ParquetError(f"cannot write the parquet rows as JSON ({str(exc).splitlines()[0]})") from None
    return text.encode().splitlines(), pre_bad


def _non_finite(value: float) -> str:
    """inf, -inf or NaN, as a reason names a float that JSON cannot write."""
    return "NaN" if value != value else str(value)


def _uuid_columns(data: bytes) -> list[str]:
    """Top-level columns of parquet's UUID type (DuckDB writes its uuid columns so), which polars reads as binary."""
    return [column.name for column in pq.ParquetFile(io.BytesIO(data)).schema
            if column.logical_type.type == "UUID" and column.path == column.name]


def _uuid_text(name: str) -> pl.Expr:
    """The 16 bytes of each UUID in column `name` as the canonical text, 8-4-4-4-12 lowercase hex digits (RFC 9562)."""
    digits = pl.col(name).bin.encode("hex")
    groups = [digits.str.slice(start, length) for start, length in ((0, 8), (8, 4), (12, 4), (16, 4), (20, 12))]
    return pl.concat_str(groups, separator="-").alias(name)


def _decoded(value: object, errors: str) -> object:
    """A parquet value with its bytes, at any depth, decoded as UTF-8 (`errors` as in bytes.decode), and the keys of
    its maps as text."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors)
    if isinstance(value, list):
        return [_decoded(item, errors) for item in value]
    if isinstance(value, dict):  # a struct (text keys) or a map (keys of its key type: 1 -> "1")
        return {str(_decoded(key, errors)): _decoded(item, errors) for key, item in value.items()}
    return value


def _text_dtype(dtype: pl.DataType) -> pl.DataType:
    """`dtype` with Binary replaced by String at any depth (lists, arrays, structs, maps), and map keys by String;
    ValueError for a map keyed by a nested type, which no JSON object key can hold."""
    if dtype == pl.Binary:
        return pl.String
    if isinstance(dtype, pl.List):
        return pl.List(_text_dtype(dtype.inner))
    if isinstance(dtype, pl.Array):
        return pl.Array(_text_dtype(dtype.inner), dtype.shape)
    if isinstance(dtype, pl.Struct):
        return pl.Struct({field.name: _text_dtype(field.dtype) for field in dtype.fields})
    if isinstance(dtype, pl.Map):
        if dtype.key.is_nested():
            raise ValueError(f"its map keys are {dtype.key}, and a JSON object key is text")
        return pl.Map(pl.String, _text_dtype(dtype.value))
    return dtype


def main() -> None:
    """The child of `read_parquet_lines`: parquet bytes on stdin; on stdout a JSON header line (`error`, or the
    refused rows `pre_bad`) and then one JSON line per row."""
    try:
        lines, pre_bad = parquet_json_lines(sys.stdin.buffer.read())
    except ParquetError as exc:
        sys.stdout.buffer.write(orjson.dumps({"error": str(exc)}) + b"\n")
        return
    sys.stdout.buffer.write(orjson.dumps({"error": None, "pre_bad": {str(k): v for k, v in pre_bad.items()}}) + b"\n")
    sys.stdout.buffer.write(b"\n".join(lines))


if __name__ == "__main__":
    main()
