"""Ingest throughput: N synthetic preference pairs (jsonl, ~1% duplicates, ~0.1% bad lines) through
`ingest_file` into a fresh store, a re-ingest of the same file, and the Hugging Face `datasets` way
(load_dataset("json") + the same validation as filter + dedup by hash with a set); markdown table.

    python benchmarks/ingest.py --n 1000000 [--csv]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import random
import shutil
import tempfile
import time
from pathlib import Path

import orjson

from bench_args import positive_int  # this directory

from pipeline_lib.store.db import open_store
from pipeline_lib.store.ingest import ingest_file

WORDS = (
    "the a model answer question why how what is of to in and you for that it with on are be this not "
    "have as we can explain step first then because number water light energy history city river"
).split()
# Bad-line kinds, planted in turn; the first two cannot be parsed by any JSON reader at all.
BAD_KINDS = ("malformed", "invalid_utf8", "missing", "identical", "empty", "not_string")
UNPARSEABLE = {"malformed", "invalid_utf8", "not_string"}  # pyarrow's JSON reader rejects the whole file


def make_file(path: Path, n: int, seed: int = 0) -> tuple[dict[str, int], Path]:
    """Write n lines (1% exact duplicates of an earlier line, 0.1% bad lines); returns the planted
    counts and a copy without the lines the `datasets` JSON reader cannot load (for the baseline)."""
    rng = random.Random(seed)
    pool = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) for _ in range(5000)]
    counts = dict.fromkeys(("good", "duplicate", *BAD_KINDS), 0)
    good_lines: list[bytes] = []
    hf_path = path.with_name("hf-" + path.name)
    with path.open("wb") as out, hf_path.open("wb") as hf_out:
        for i in range(n):
            if i % 1000 == 999:
                kind = BAD_KINDS[(i // 1000) % len(BAD_KINDS)]
                line = _bad_line(kind, i, pool)
                counts[kind] += 1
            elif i % 100 == 50 and good_lines:
                kind, line = "duplicate", good_lines[rng.randrange(len(good_lines))]
                counts[kind] += 1
            else:
                record = {"prompt": f"Question {i}: {pool[i % 5000]}?", "chosen": pool[(i * 7 + 1) % 5000],
                          "rejected": pool[(i * 13 + 2) % 5000]}
                if record["chosen"] == record["rejected"]:
                    record["rejected"] += " (worse)"
                kind, line = "good", orjson.dumps(record)
                good_lines.append(line)
                counts[kind] += 1
            out.write(line + b"\n")
            if kind not in UNPARSEABLE:
                hf_out.write(line + b"\n")
    return counts, hf_path


def _bad_line(kind: str, i: int, pool: list[str]) -> bytes:
    text = pool[i % 5000]
    if kind == "malformed":
        return orjson.dumps({"prompt": f"Q{i}", "chosen": text, "rejected": "x"})[:-5]
    if kind == "invalid_utf8":
        return b'{"prompt": "Q%d \xff\xfe", "chosen": "a", "rejected": "b"}' % i
    if kind == "missing":
        return orjson.dumps({"prompt": f"Q{i}", "chosen": text})
    if kind == "identical":
        return orjson.dumps({"prompt": f"Q{i}", "chosen": text, "rejected": text})
    if kind == "empty":
        return orjson.dumps({"prompt": f"Q{i}", "chosen": " ", "rejected": text})
    return orjson.dumps({"prompt": f"Q{i}", "chosen": 42, "rejected": text})


def timed_ingest(path: Path, store) -> tuple[tuple[float, float], str]:
    """(wall, cpu) seconds of one `ingest_file` and its summary."""
    cpu = time.process_time()
    report = ingest_file(path, store, source="bench")
    return (report.seconds, time.process_time() - cpu), report.summary()


def run_alignflow(path: Path, store_path: Path) -> tuple[tuple[float, float], tuple[float, float], str, str]:
    """(wall, cpu) seconds of a first ingest into a fresh store and of a re-ingest, and their summaries."""
    with open_store(store_path) as store:
        first, first_summary = timed_ingest(path, store)
        again, again_summary = timed_ingest(path, store)
    return first, again, first_summary, again_summary


def write_csv(jsonl: Path, path: Path) -> int:
    """The parseable records of `jsonl` as CSV rows (prompt, chosen, rejected; a missing field an empty cell)."""
    with jsonl.open("rb") as lines, path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(["prompt", "chosen", "rejected"])
        rows = 0
        for line in lines:
            record = orjson.loads(line)
            writer.writerow([record.get(name, "") for name in ("prompt", "chosen", "rejected")])
            rows += 1
    return rows


def run_csv(jsonl: Path, tmp: Path) -> tuple[int, float, tuple[float, float], str]:
    """Rows, file MB, (wall, cpu) seconds and the summary of ingesting the same pairs as CSV into a fresh store."""
    rows = write_csv(jsonl, tmp / "pairs.csv")
    with open_store(tmp / "csv-store.duckdb") as store:
        seconds, summary = timed_ingest(tmp / "pairs.csv", store)
    return rows, (tmp / "pairs.csv").stat().st_size / 1e6, seconds, summary


def run_datasets(path: Path, cache_dir: Path) -> tuple[tuple[float, float], int]:
    """What a user would write with `datasets`: load, filter with the same checks, hash, dedup.
    Returns (wall, cpu) seconds and the rows kept."""
    import datasets

    datasets.disable_progress_bars()
    start, cpu = time.perf_counter(), time.process_time()
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(cache_dir))

    def valid(row: dict) -> bool:
        fields = [row.get(k) for k in ("prompt", "chosen", "rejected")]
        return all(isinstance(f, str) and f.strip() for f in fields) and row["chosen"] != row["rejected"]

    ds = ds.filter(valid)
    ds = ds.map(lambda row: {"pair_id": hashlib.sha256(
        "\x1f".join((row["prompt"], row["chosen"], row["rejected"])).encode()).hexdigest()})
    seen: set[str] = set()

    def first_time(row: dict) -> bool:
        if row["pair_id"] in seen:
            return False
        seen.add(row["pair_id"])
        return True

    ds = ds.filter(first_time)
    return (time.perf_counter() - start, time.process_time() - cpu), len(ds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=positive_int, nargs="+", default=[100_000], help="pairs per file (several allowed)")
    parser.add_argument("--skip-datasets", action="store_true", help="do not run the HF datasets baseline")
    parser.add_argument("--csv", action="store_true", help="also ingest the parseable records as a CSV file")
    args = parser.parse_args()
    rows = []
    for n in args.n:
        tmp = Path(tempfile.mkdtemp(prefix="alignflow-bench-"))
        try:
            counts, hf_path = make_file(tmp / "pairs.jsonl", n)
            size_mb = (tmp / "pairs.jsonl").stat().st_size / 1e6
            first, again, summary, summary_again = run_alignflow(tmp / "pairs.jsonl", tmp / "store.duckdb")
            print(summary, f"({first[0]:.2f} s)")
            print(summary_again, f"({again[0]:.2f} s)")
            print("planted:", counts)
            expected = (n, counts["good"], counts["duplicate"], sum(counts[k] for k in BAD_KINDS))
            got = tuple(int(word) for word in summary.replace("=", " ").replace("+", " ").split() if word.isdigit())
            if got != expected:
                raise SystemExit(f"ingest counts {got} != planted (read, good, duplicates, bad) {expected}")
            csv_rows = []  # (rows, MB, method, seconds) of the CSV ingest
            if args.csv:
                csv_count, csv_mb, csv_secs, csv_summary = run_csv(hf_path, tmp)
                print("csv:", csv_summary, f"({csv_secs[0]:.2f} s)")
                csv_rows = [(csv_count, csv_mb, "alignflow ingest_file of the parseable records as CSV", csv_secs)]
            hf, hf_kept = (None, None) if args.skip_datasets else run_datasets(hf_path, tmp / "hf-cache")
            if hf_kept is not None:
                print(f"datasets kept {hf_kept} rows (its file lacks the {sum(counts[k] for k in UNPARSEABLE)} "
                      "lines its JSON reader cannot parse)")
            rows.append((n, size_mb, first, again, csv_rows, hf))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("| N pairs | file MB | method | wall s | CPU s | rows/s (wall) | speedup vs datasets (wall) |")
    print("|---|---|---|---|---|---|---|")
    for n, size_mb, first, again, csv_rows, hf in rows:
        for count, mb, method, secs in [(n, size_mb, "alignflow ingest_file, fresh store", first),
                                        (n, size_mb, "alignflow re-ingest, all duplicates", again),
                                        *csv_rows,
                                        (n, size_mb, "HF datasets load_dataset + filter + map + set dedup", hf)]:
            if secs is None:
                continue
            speedup = f"{hf[0] / secs[0]:.1f}x" if hf else "-"
            wall, cpu = secs
            print(f"| {count:,} | {mb:.0f} | {method} | {wall:.2f} | {cpu:.2f} | {count / wall:,.0f} | {speedup} |")


if __name__ == "__main__":
    main()
