"""Functions a task calls on what a split model returns: the whole of a tensor-parallel output,
and the loss of a sequence split by context parallel."""

from __future__ import annotations

import torch

from framework.parallel.context import cross_entropy

__all__ = ["cross_entropy", "full_tensor"]


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (gathered: e.g. the logits of a vocabulary-split head, for
    sampling), or `x` itself."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x
