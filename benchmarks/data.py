"""The data pipeline: how fast `fw prepare` encodes a corpus, how long a training step waits for
prepared data, and how much memory training needs, each beside its baseline.

The corpus: the standard library's `.py` files (about 13 MB), copied into numbered directories
until it holds `--corpus-mb` megabytes (default 100), so a preparation has thousands of files to
spread over its workers. The same bytes, concatenated in the same order, make one text file for
the in-memory side.

1. **Preparation throughput** (MB of source per second, wall time): `framework.data.prepared.prepare`
   (litdata's `optimize`) with 1 and 2 workers against a plain Python loop in one process that
   encodes each file and appends its tokens to one file. Two encoders: the gpt recipes' byte
   tokens (reading, converting and writing only) and a word-level tokenizer in pure Python (a
   regular expression, each word hashed into a 50,257-token vocabulary) that stands in for the
   CPU cost of a real tokenizer. The three sides alternate, twice; each one's faster run counts.
2. **Data wait**: `fw train task=gpt` (the recipe's default model and batch) for `--steps` steps on
   the prepared corpus and on the same corpus read into memory, with 0 and 1 loader workers.
   `callbacks.throughput` logs perf/data_wait_ms (from the end of one batch to the start of the
   next: the loader's hand-over plus the framework's hooks) and perf/steps_per_sec; the share is
   their product, the median over the logged windows after the first.
3. **Memory**: the training process's peak resident set (perf/memory_peak_gib, rank 0, 0 loader
   workers) on the prepared corpus and in memory.

Run from the repository root: `python -m benchmarks.data [--corpus-mb N] [--steps N]` (or
`make bench`). Results: benchmarks/results/data.json.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import statistics
import sysconfig
import tempfile
import time
import zlib
from pathlib import Path

from benchmarks.common import load_average, run_checked, save_results, train_command

WORD = re.compile(rb"\w+|[^\w\s]|\s+")
VOCAB = 50_257
REPEATS = 2


def word_tokens(path: str):
    """A file's words, punctuation and runs of spaces, each hashed to an id below VOCAB."""
    import torch

    ids = [zlib.crc32(w) % VOCAB for w in WORD.findall(Path(path).read_bytes())]
    return torch.tensor(ids, dtype=torch.int32)


def byte_tokens(path: str):
    from framework.data.prepared import byte_tokens as encode

    return encode(path)


ENCODERS = {"bytes": byte_tokens, "words": word_tokens}


def make_corpus(root: Path, megabytes: int) -> tuple[list[Path], Path]:
    """Copies of the standard library's sources under root/src (sorted order = reading order)
    and the same bytes as one file, root/corpus.txt."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    originals = [
        p
        for p in sorted(stdlib.rglob("*.py"))
        if "site-packages" not in p.parts and "test" not in p.parts and os.access(p, os.R_OK)
    ]
    files, size, copy = [], 0, 0
    while size < megabytes * 1e6:
        for original in originals:
            target = root / "src" / f"copy{copy:03d}" / original.relative_to(stdlib)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(original, target)
            files.append(target)
            size += target.stat().st_size
        copy += 1
    files.sort()
    whole = root / "corpus.txt"
    with open(whole, "wb") as out:
        for path in files:
            out.write(path.read_bytes())
    return files, whole


def plain_loop(files: list[Path], encode, out: Path) -> float:
    """Seconds to encode every file in this process and append the tokens to one file."""
    start = time.perf_counter()
    with open(out, "wb") as f:
        for path in files:
            f.write(encode(str(path)).numpy().tobytes())
    return time.perf_counter() - start


def prepared(files: list[Path], encode, out: Path, workers: int, name: str) -> float:
    """Seconds for framework.data.prepared.prepare with `workers` processes."""
    from framework.data.prepared import fingerprint, prepare

    manifest = {"input": fingerprint(files), "source": "benchmark", "encoder": name}
    start = time.perf_counter()
    prepare([str(f) for f in files], encode, out, workers, manifest, chunk_bytes=16_000_000)
    return time.perf_counter() - start


def preparation(files: list[Path], root: Path) -> dict:
    megabytes = sum(p.stat().st_size for p in files) / 1e6
    results = {}
    for name, encode in ENCODERS.items():
        seconds: dict[str, float] = {}
        for repeat in range(REPEATS):  # the sides alternate; the fastest of each is kept
            took = plain_loop(files, encode, root / f"{name}.bin")
            seconds["plain loop, 1 process"] = min(seconds.get("plain loop, 1 process", took), took)
            for workers in (1, 2):
                out = root / f"prep-{name}-{workers}"
                took = prepared(files, encode, out, workers, name)
                key = f"fw prepare, {workers} worker(s)"
                seconds[key] = min(seconds.get(key, took), took)
                if not (name == "bytes" and workers == 2 and repeat == REPEATS - 1):
                    shutil.rmtree(out)  # the last one is kept: training reads it
        results[name] = {k: round(megabytes / s, 1) for k, s in seconds.items()}
    return {"corpus_mb": round(megabytes, 1), "mb_per_sec": results}


def train(root: Path, name: str, steps: int, data: list[str], workers: int) -> dict:
    run_dir = root / f"run-{name}-{workers}"
    command = train_command(
        str(run_dir),
        steps,
        1,
        "task=gpt",
        *data,
        f"+task.data.num_workers={workers}",
        "+callbacks.throughput.kind=throughput",
        "+callbacks.throughput.window=10",
        "trainer.log_every_n_steps=10",
    )
    run_checked(command, f"training on {name} data")
    with open(run_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/data_wait_ms")]
    later = rows[1:] or rows
    shares = [float(r["perf/data_wait_ms"]) / 1000 * float(r["perf/steps_per_sec"]) for r in later]
    return {
        "data_wait_ms": round(statistics.median(float(r["perf/data_wait_ms"]) for r in later), 2),
        "step_ms": round(
            statistics.median(1000 / float(r["perf/steps_per_sec"]) for r in later), 1
        ),
        "wait_share_pct": round(100 * statistics.median(shares), 2),
        "memory_peak_gib": round(float(rows[-1]["perf/memory_peak_gib"]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus-mb", type=int, default=100)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    load = load_average()
    with tempfile.TemporaryDirectory(prefix="fw-bench-data-") as tmp:
        root = Path(tmp)
        files, whole = make_corpus(root, args.corpus_mb)
        prep = preparation(files, root)
        size = whole.stat().st_size
        sides = {
            "prepared": [
                f"task.data.prepared={root / 'prep-bytes-2'}",
                f"task.data.max_bytes={size}",
            ],
            "in memory": [f"task.data.path={whole}", f"task.data.max_bytes={size}"],
        }
        training = {
            f"{name}, {workers} loader worker(s)": train(root, name, args.steps, data, workers)
            for workers in (0, 1)
            for name, data in sides.items()
        }
    print(f"Preparation of {prep['corpus_mb']} MB (MB/s, higher is better):")
    for encoder, figures in prep["mb_per_sec"].items():
        base = figures["plain loop, 1 process"]
        cells = ", ".join(f"{k} {v} ({v / base:.2f}x)" for k, v in figures.items())
        print(f"  {encoder:6s} {cells}")
    print(f"Training (gpt recipe, {args.steps} steps, 1 process):")
    for name, figures in training.items():
        print(
            f"  {name:32s} step {figures['step_ms']} ms, data wait {figures['data_wait_ms']} ms "
            f"= {figures['wait_share_pct']}% of the step, peak memory "
            f"{figures['memory_peak_gib']} GiB"
        )
    save_results(
        "data",
        {"preparation": prep, "training": training, "steps": args.steps},
        load,
    )


if __name__ == "__main__":
    main()
