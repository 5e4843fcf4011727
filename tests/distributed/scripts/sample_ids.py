"""A callback the tests add with `+callbacks.ids._target_=...SampleIds +callbacks.ids.out=DIR`:
for every training batch, each rank appends `step<TAB>digest` per sample to DIR/rank<R>.txt.

The digest is a hash of the sample's input tokens, so the task, its data and the loader stay
exactly as users run them; the test checks that the digests of the samples it trains on are
distinct, which makes a digest a sample's identity."""

from __future__ import annotations

import hashlib
from pathlib import Path

import lightning.pytorch as pl


class SampleIds(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        inputs = batch[0]
        self.out.mkdir(parents=True, exist_ok=True)
        lines = "".join(
            f"{trainer.global_step}\t{hashlib.sha1(row.numpy().tobytes()).hexdigest()}\n"
            for row in inputs.cpu()
        )
        with open(self.out / f"rank{trainer.global_rank}.txt", "a") as f:
            f.write(lines)


def read(out: Path) -> list[tuple[int, str]]:
    """(step, digest) of every sample every rank trained on."""
    rows = []
    for path in sorted(Path(out).glob("rank*.txt")):
        for line in path.read_text().splitlines():
            step, digest = line.split("\t")
            rows.append((int(step), digest))
    return rows
