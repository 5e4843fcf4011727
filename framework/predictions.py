"""Reading what `fw predict` wrote: each rank's outputs and their dataset indices, put back in
the dataset's order whatever the process count.

RUN_DIR/predictions/rankNNNNN.pt holds, for each batch a rank predicted, the dataset index of
every sample (`indices`) and the task's `predict_step` output (`outputs`). A sample that a rank
saw twice (a sampler pads the last batches so every rank gets as many) is kept once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FOLDER = "predictions"


def files(run_dir: Path) -> list[Path]:
    """The rank files of a run's predictions (RUN_DIR/predictions, or that folder itself)."""
    folder = Path(run_dir)
    if (folder / FOLDER).is_dir():
        folder = folder / FOLDER
    return sorted(folder.glob("rank*.pt"))


def read(run_dir: Path) -> list[Any]:
    """One output per sample, in the dataset's order. A batch's output is split into samples
    along its first dimension (a tensor) or its items (a list or tuple of the batch's length);
    any other output stands for its whole batch (listed once, at its first sample's place)."""
    by_index: dict[int, Any] = {}
    for path in files(run_dir):
        saved = torch.load(path, weights_only=True)
        for indices, output in zip(saved["indices"], saved["outputs"], strict=True):
            for index, sample in zip(indices, per_sample(output, len(indices)), strict=False):
                by_index.setdefault(index, sample)
    return [by_index[i] for i in sorted(by_index)]


def per_sample(output: Any, rows: int) -> list[Any]:
    """A batch's output as one item per sample (see `read`)."""
    if isinstance(output, torch.Tensor) and output.dim() > 0 and output.shape[0] == rows:
        return list(output.unbind(0))
    if isinstance(output, (list, tuple)) and len(output) == rows:
        return list(output)
    return [output]
