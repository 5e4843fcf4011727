"""`deepspeed`: the per-rank ZeRO partitions DeepSpeed writes (zero1, zero2, zero3).

A DeepSpeed checkpoint directory names its tag in `latest` (a plain name inside the directory;
anything else is refused) and holds, per saving rank r, `zero_pp_rank_{r}_mp_rank_00_optim_states.pt`
(its fp32 partition of every parameter group and the optimizer's moments over it) and the model
states file(s) (`mp_rank_00_model_states.pt` for stages 1 and 2, one per rank for stage 3: the
parameter shapes per group, the buffers and Lightning's client state).

The partitions: stage 3 cuts every parameter on its own into `ceil(numel / world)` pieces, one per
rank, laid one after the other in the rank's flat group; stages 1 and 2 flatten each group whole,
in order, and cut it into equal partitions (padding at the end). A flat range of one parameter
therefore lies in a few ranks' files, at offsets these rules give; only those ranks' files are
read, and only that range of them (torchfile.py). DeepSpeed's own loaders unpickle without
restriction; it is never called to read a checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from framework.checkpoint import safe
from framework.checkpoint.formats.torchfile import PIECE, TorchFile, largest_piece, spec_of
from framework.checkpoint.portable import (
    MODEL,
    NotPortable,
    OptimizerSpec,
    Read,
    TensorSpec,
    strip_prefix,
)

# The classes DeepSpeed's files name for data (DeepSpeed 0.19), read as inert stand-ins.
ALLOWED = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
# What a DeepSpeed model states file holds besides the Lightning client state.
DEEPSPEED_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "checkpoint_parallel_dimensions",
    "ds_config",
    "ds_version",
}
FP32 = "fp32"  # the key of a parameter's fp32 master copy in the partitions


class DeepSpeedSource:
    """A Source (framework/checkpoint/portable.py) over one DeepSpeed checkpoint directory."""

    def __init__(self, path: Path, trusted: bool = False) -> None:
        self.trusted = trusted
        latest = path / "latest"
        tag = latest.read_text().strip() if latest.is_file() else None
        self.root = safe.inside(path, tag, f"{path.name}/latest") if tag else path
        self.where = f"{path.parent.name}/{path.name}"
        optim = sorted(self.root.glob("zero_pp_rank_*_optim_states.pt"), key=_rank_of)
        models = sorted(self.root.glob("*model_states.pt"), key=_rank_of)
        # every file is opened (type-restricted) before anything else is judged
        self.trees = [
            safe.load_torch(
                f, f"{self.where}/{f.name}", meta=True, trusted=trusted, stand_ins=ALLOWED
            )
            for f in optim
        ]
        if not optim or not models:
            raise NotPortable(f"{self.root} holds no DeepSpeed ZeRO partitions")
        if not all(isinstance(t, dict) and "optimizer_state_dict" in t for t in self.trees):
            raise NotPortable(f"{self.root} holds ZeRO files without their optimizer state")
        self.trees = [t["optimizer_state_dict"] for t in self.trees]
        self.model_file = models[0]
        self.files = [TorchFile(f) for f in optim]
        self.model_tree = safe.load_torch(
            self.model_file,
            f"{self.where}/{self.model_file.name}",
            meta=True,
            trusted=trusted,
            stand_ins=ALLOWED,
        )
        self.model_reader = TorchFile(self.model_file)
        stage = self.trees[0]["zero_stage"]
        self.stage = int(getattr(stage, "value", stage))
        self.world = len(optim)
        if self.model_tree.get("frozen_param_shapes"):
            raise NotPortable(
                "it holds frozen parameters, which ZeRO stores outside its partitions"
            )
        self.shapes = [dict(s) for s in self.model_tree["param_shapes"]]
        self.place = self._places()
        self.aliases = {
            strip_prefix(a): strip_prefix(s)
            for a, s in (self.model_tree.get("shared_params") or {}).items()
        }
        self.buffers = {strip_prefix(n): n for n in self.model_tree.get("buffer_names", []) or []}

    def _places(self) -> dict[str, tuple[int, int, int]]:
        """name -> (sub-group, offset in the group's flat layout, numel)."""
        place = {}
        for sub, shapes in enumerate(self.shapes):
            offset = 0
            for name, shape in shapes.items():
                n = math.prod(shape)
                place[strip_prefix(name)] = (sub, offset, n)
                offset += math.ceil(n / self.world) if self.stage == 3 else n
        return place

    def _base(self, rank: int) -> dict[str, Any]:
        tree = self.trees[rank]
        return tree["optimizer_state_dict"] if self.stage == 3 else tree["base_optimizer_state"]

    def _flat(self, rank: int, sub: int, key: str) -> torch.Tensor:
        tree = self.trees[rank]
        if key == FP32:
            groups = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
            return tree[groups][sub]
        return self._base(rank)["state"][sub][key]

    # ---- what it holds
    def model(self) -> dict[str, TensorSpec]:
        found = {}
        for sub, shapes in enumerate(self.shapes):
            for name, shape in shapes.items():
                found[strip_prefix(name)] = TensorSpec(tuple(shape), self._flat(0, sub, FP32).dtype)
        module = self.model_tree.get("module") or {}
        for name, saved in self.buffers.items():
            if isinstance(module.get(saved), torch.Tensor):
                found[name] = spec_of(module[saved])
        for alias, source in self.aliases.items():
            found[alias] = found[source]
        return found

    def optimizers(self) -> list[OptimizerSpec]:
        base = self._base(0)
        groups, state = [], {}
        names_of = {
            sub: [strip_prefix(n) for n in shapes] for sub, shapes in enumerate(self.shapes)
        }
        for group in base["param_groups"]:
            names = [n for sub in group["params"] for n in names_of[sub]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
            for sub in group["params"]:
                for key, value in base["state"].get(sub, {}).items():
                    for name in names_of[sub]:
                        shape = tuple(self.shapes[sub][_saved_name(self.shapes[sub], name)])
                        if isinstance(value, torch.Tensor) and value.dim() == 1:
                            spec: Any = TensorSpec(shape, value.dtype)
                        elif isinstance(value, torch.Tensor):
                            spec = TensorSpec((), value.dtype)  # a scalar of the group (step)
                        else:
                            spec = value
                        state.setdefault(name, {})[key] = spec
        for alias, source in self.aliases.items():
            if source in state:
                state[alias] = state[source]
        return [OptimizerSpec(groups, state)]

    def rest(self) -> dict[str, Any]:
        real = safe.load_torch(
            self.model_file,
            f"{self.where}/{self.model_file.name}",
            mmap=True,
            trusted=self.trusted,
            stand_ins=ALLOWED,
        )
        return {k: v for k, v in real.items() if k not in DEEPSPEED_KEYS}

    # ---- reading
    def read(self, requests: list[Read]) -> None:
        for request in requests:
            if request.key[0] == MODEL:
                name, key = request.key[1], FP32
            else:
                _, _, name, key = request.key
            name = self.aliases.get(name, name)
            if key == FP32 and name in self.buffers:
                saved = self.model_tree["module"][self.buffers[name]]
                self.model_reader.read_box(saved, request.offset, request.out)
            elif request.out.dim() == 0 or name not in self.place:
                self._read_scalar(name, key, request.out)
            else:
                self._read_box(name, key, tuple(request.offset), request.out)

    def _read_scalar(self, name: str, key: str, out: torch.Tensor) -> None:
        if name not in self.place:
            raise NotPortable(f"{self.where} holds no tensor {name}")
        sub = self.place[name][0]
        self.files[0].read_box(self._base(0)["state"][sub][key], (), out)

    def _read_box(self, name: str, key: str, offset: tuple, out: torch.Tensor) -> None:
        """A box of a parameter's full tensor: whole rows of it read flat (a piece of rows at a
        time), narrowed to the box's other dimensions."""
        sub = self.place[name][0]
        shape = tuple(self.shapes[sub][_saved_name(self.shapes[sub], name)])
        if len(shape) == 0:
            return self._read_flat(name, key, 0, out.view(1))
        inner = math.prod(shape[1:])
        rows_per_piece = max(1, PIECE // max(1, inner * 4))
        for start in range(0, out.shape[0], rows_per_piece):
            rows = min(rows_per_piece, out.shape[0] - start)
            first = (offset[0] + start) * inner
            target = out.narrow(0, start, rows)
            if target.shape[1:] == shape[1:] and target.is_contiguous():
                self._read_flat(name, key, first, target.view(-1))
                continue
            whole_rows = torch.empty(rows * inner, dtype=target.dtype)
            self._read_flat(name, key, first, whole_rows)
            piece = whole_rows.view(rows, *shape[1:])
            for d in range(1, len(shape)):
                piece = piece.narrow(d, offset[d], target.shape[d])
            target.copy_(piece)
        return None

    def _read_flat(self, name: str, key: str, start: int, out: torch.Tensor) -> None:
        """Flat elements [start, start + out.numel()) of parameter `name`'s `key`."""
        sub, base, numel = self.place[name]
        stop = start + out.numel()
        if stop > numel:
            raise NotPortable(f"{self.where}: {name} has {numel} elements, not {stop}")
        if self.stage == 3:  # the parameter cut into `part` elements per rank
            part = math.ceil(numel / self.world)
            spans = [(r, r * part, base) for r in range(start // part, math.ceil(stop / part))]
        else:  # the group flattened whole, cut into equal partitions
            size = self._flat(0, sub, FP32).numel()
            first, last = (base + start) // size, math.ceil((base + stop) / size)
            spans = [(r, r * size - base, 0) for r in range(first, last)]
        for rank, begin, at in spans:  # rank `rank` holds the parameter from element `begin`
            flat = self._flat(rank, sub, key)
            lo, hi = max(start, begin), min(stop, begin + flat.numel() - at)
            if lo < hi:
                self.files[rank].read_box(
                    flat, (at + lo - begin,), out.narrow(0, lo - start, hi - lo)
                )

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in (*self.files, self.model_reader))

    def largest_read(self) -> int:
        return largest_piece(self.model(), self.optimizers())

    def close(self) -> None:
        for f in (*self.files, self.model_reader):
            f.close()


def _saved_name(shapes: dict[str, Any], name: str) -> str:
    """The name a parameter has in DeepSpeed's records (Lightning's wrapper prefix)."""
    return name if name in shapes else f"_forward_module.{name}"


def _rank_of(path: Path) -> int:
    parts = path.name.split("_")
    return int(parts[3]) if parts[0] == "zero" else -1


class DeepSpeedFormat:
    """ZeRO partitions: load as written only under the process count that wrote them."""

    name = "deepspeed"
    any_world = False
    state = "state.ckpt"
    allowed = ALLOWED

    def movable(self, meta: dict[str, Any]) -> str | None:
        return None

    def open(self, path: Path, trusted: bool = False) -> DeepSpeedSource:
        return DeepSpeedSource(path, trusted)


FORMAT = DeepSpeedFormat()
