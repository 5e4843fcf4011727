"""The one form every checkpoint layout is read in: a `Source`, tensors by parameter name, read
box by box into storage the reader does not own.

Each strategy writes its own layout (framework/checkpoint/formats/: a Lightning file, per-rank
ZeRO partitions, DCP shards). A `Source` opened on any of them answers, without reading any
tensor data:

- `model()`: every model tensor (parameters and buffers) by the task's `state_dict()` name, with
  its whole shape and dtype;
- `optimizers()`: per optimizer, its param groups (hyperparameters, parameter names) and each
  parameter's state entries (`exp_avg`: a tensor of the parameter's shape, `step`: a scalar);
- `rest()`: everything else Lightning keeps in a checkpoint (loops, callbacks, schedulers);

and `read(requests)` fills each request's `out` tensor with the box of a saved tensor that
starts at `offset` and has `out`'s shape, converting the dtype. The loader (framework/checkpoint/
load.py, a strategy's own for ZeRO partitions) points `out` at the storage the new layout keeps
(a parameter, a DTensor's local shard, a slice of a ZeRO partition), so a rank reads only what
it holds, and holds it once: its share of the state plus a reader's transient buffer (at most
one saved chunk of one tensor). Every reader is type-restricted (framework/checkpoint/safe.py):
loading a checkpoint never runs code.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

NAMES_KEY = "parameter_names"  # written into Lightning-format checkpoints by the checkpointer
# Lightning's wrapper around the task module under DeepSpeed (prefixes DeepSpeed's names)
WRAPPER_PREFIX = "_forward_module."
MODEL = "model"  # key kind of a model tensor: ("model", name)
STATE = "state"  # key kind of an optimizer state tensor: ("state", optimizer index, name, entry)


class NotPortable(Exception):
    """This checkpoint cannot be read into another layout (the message says why)."""


@dataclass(frozen=True)
class TensorSpec:
    """A saved tensor's whole shape and dtype (no data)."""

    shape: tuple[int, ...]
    dtype: Any  # a torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        import torch

        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class OptimizerSpec:
    """One saved optimizer: its param groups (hyperparameters and `params`: parameter names),
    and per parameter name its state entries, a TensorSpec for each tensor (read with a
    `("state", index, name, entry)` key) or the value itself for a plain number."""

    groups: list[dict[str, Any]]
    state: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Read:
    """Fill `out` with the box of the saved tensor `key` that starts at `offset` (one index per
    dimension; `out.shape` is the box's size), converted to `out.dtype`."""

    key: tuple
    out: Any  # a torch.Tensor (a view into the storage that keeps it)
    offset: tuple[int, ...] = ()


class Source(Protocol):
    """A checkpoint's state, read by name, box by box (see the module docstring)."""

    def model(self) -> dict[str, TensorSpec]:
        """Every model tensor: name -> spec."""

    def optimizers(self) -> list[OptimizerSpec]:
        """Every optimizer's groups and state entries."""

    def read(self, requests: list[Read]) -> None:
        """Fill every request's `out` (a batch: readers group what shares a file or a chunk)."""

    def rest(self) -> dict[str, Any]:
        """The Lightning checkpoint without its model and optimizer states."""

    def largest_read(self) -> int:
        """The most bytes the reader holds at once beyond the tensors it fills (one saved chunk,
        or one piece of a tensor), for `fw check`'s figure of a resume."""

    @property
    def bytes_read(self) -> int:
        """Bytes of tensor data read from the files so far."""

    def close(self) -> None:
        """Release open files and mappings."""


def model_key(name: str) -> tuple:
    return (MODEL, name)


def state_key(index: int, name: str, entry: str) -> tuple:
    return (STATE, index, name, entry)


def strip_prefix(name: str) -> str:
    return name.removeprefix(WRAPPER_PREFIX)


def whole(source: Source, key: tuple, spec: TensorSpec) -> Any:
    """A saved tensor read whole into new memory (one tensor: for a loader that needs a value,
    and for the streaming export)."""
    import torch

    out = torch.empty(spec.shape, dtype=spec.dtype)
    source.read([Read(key, out, (0,) * len(spec.shape))])
    return out


def model_tensors(source: Source) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every model tensor, read one at a time: a consumer that lets each go
    before the next holds one tensor at a time (`fw export`)."""
    for name, spec in source.model().items():
        yield name, whole(source, model_key(name), spec)


def full_state(source: Source) -> dict[str, Any]:
    """Every model tensor in memory at once: for inspecting small checkpoints (tests,
    debugging), never on a path that runs at the sizes users train."""
    return dict(model_tensors(source))


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple, tuple]]:
    """The elements [start, stop) of a row-major tensor of `shape` as boxes (offset, size), in
    order, at most 2 * len(shape) - 1 of them: the form a reader takes for a slice of a
    flattened tensor (a ZeRO partition)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner

    def row(index: int, lo: int, hi: int) -> list[tuple[tuple, tuple]]:
        return [((index, *o), (1, *s)) for o, s in flat_boxes(shape[1:], lo, hi)]

    if first == last:
        return row(first, start - first * inner, stop - first * inner)
    boxes, whole_from = [], first
    if start > first * inner:  # a partial first row
        boxes += row(first, start - first * inner, inner)
        whole_from = first + 1
    whole_to = last + 1 if stop == (last + 1) * inner else last
    if whole_to > whole_from:
        boxes.append(((whole_from, *(0,) * (len(shape) - 1)), (whole_to - whole_from, *shape[1:])))
    if whole_to == last:  # a partial last row
        boxes += row(last, 0, stop - last * inner)
    return boxes


def flat_reads(key: tuple, shape: tuple[int, ...], out: Any, start: int) -> list[Read]:
    """Reads that fill the 1-D `out` with the flat elements [start, start + out.numel()) of the
    saved tensor `key` (of whole `shape`)."""
    reads, pos = [], 0
    for offset, size in flat_boxes(tuple(shape), start, start + out.numel()):
        n = math.prod(size)
        reads.append(Read(key, out.narrow(0, pos, n).view(size), offset))
        pos += n
    return reads


def group_of(groups: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The hyperparameters of the saved param group holding these parameters."""
    for group in groups:
        if set(names) & set(group["params"]):
            return {k: v for k, v in group.items() if k != "params"}
    raise NotPortable(f"no saved param group holds {names[:3]}")


def copy_value(value: Any) -> Any:
    return value.clone() if hasattr(value, "clone") else value
