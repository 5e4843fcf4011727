"""Degrees of parallelism and the one DeviceMesh they build.

`ParallelDims` holds the degrees `pp` (pipeline), `dp` (replicated data), `fsdp` (sharded data),
`tp` (tensor), `ep` (expert) and `cp` (context). The first four multiply to the number of
processes; `ep` and `cp` do not add processes: they borrow their ranks from `fsdp`. (Tensor-parallel
ranks hold the same tokens, so they keep whole experts and are not borrowed: each of them runs the
same expert computation.) The ranks of a context-parallel group read the same batch and each keeps
two chunks of its sequences (framework/parallel/context/__init__.py); FSDP still shards over all the fsdp ranks,
so borrowing them costs no parameter memory.

The processes form one mesh, outermost first (pp, dp, fsdp, tp): tensor parallel is innermost
(neighbouring ranks, the fastest links), pipeline outermost (the fewest bytes). Every part of the
framework takes the view it needs from that one mesh by name:

| view | dims | used by |
|---|---|---|
| `pp` | pp | pipeline stages (send/recv, tied weights) |
| `dp`, `fsdp` | dp, fsdp | FSDP2 (replicate x shard: hybrid when both are above 1) |
| `tp` | tp | tensor-parallel plans |
| `data` | dp x fsdp / cp, flattened | samplers: ranks that read different data |
| `ep` | the fsdp ranks borrowed | expert parallel (when ep > 1): experts split over it |
| `efsdp` | dp x (fsdp / ep), flattened | the ranks holding the same experts (their gradients are summed) |
| `cp` | the fsdp ranks borrowed | context parallel (when cp > 1): the sequence split over it |
| `tokens` | dp x fsdp, flattened (cp > 1) | the ranks holding different tokens (MoE routers' load counts) |

With ep > 1 or cp > 1 the fsdp dimension is factored into `fsdp_out x ep x cp` (the degrees
above 1): neighbouring fsdp ranks share a sequence (attention's K/V traffic takes the fastest
links after tensor parallel's), the next ones form an expert-parallel group; the `fsdp` view is
those flattened, `data` leaves `cp` out, `efsdp` leaves `ep` out. Both together take disjoint
factors (cp x ep divides fsdp): an expert-parallel group then holds the same chunk positions of
different batches. Its all-to-all only moves tokens, which the MoE layers treat one by one, so
any grouping is exact; disjoint factors keep each view one set of mesh dimensions. The degrees are
plain integers: everything except `build_mesh` runs without torch (in the `fw` process, before
launch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from framework.errors import ConfigError

ORDER = ("pp", "dp", "fsdp", "tp")  # the mesh's dimensions, outermost first


def fit_degrees(values: Mapping[str, int], world_size: int) -> dict[str, int]:
    """Degrees (one may be -1, "the rest") resolved to multiply to the process count."""
    values = {k: int(v) for k, v in values.items()}
    for key, value in values.items():
        if value < 1 and value != -1:
            raise ConfigError(f"strategy.{key}", value, "must be at least 1, or -1 for the rest")
    rest = [k for k, v in values.items() if v == -1]
    if len(rest) > 1:
        raise ConfigError(
            f"strategy.{rest[1]}", -1, f"only one degree may be -1 (strategy.{rest[0]} is too)"
        )
    known = math.prod(v for v in values.values() if v != -1)
    if rest:
        if world_size % known:
            raise ConfigError(
                f"strategy.{rest[0]}",
                -1,
                f"the other degrees multiply to {known}, which does not divide the "
                f"{world_size} processes",
            )
        values[rest[0]] = world_size // known
    product = math.prod(values.values())
    if product != world_size:
        shown = " x ".join(f"{k}={v}" for k, v in values.items())
        raise ConfigError(
            "strategy",
            shown,
            f"the degrees multiply to {product}, but the job has {world_size} processes "
            "(trainer.devices x trainer.num_nodes)",
            hint=f"Make {' x '.join(values)} equal the process count, or set one degree to -1.",
        )
    return values


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees of one job (every degree >= 1, pp x dp x fsdp x tp = world size)."""

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1

    @classmethod
    def fit(cls, degrees: Mapping[str, int], world_size: int) -> ParallelDims:
        """Resolve `degrees` (pp, dp, fsdp, tp: one may be -1; ep: -1 means all of fsdp) against
        the process count; ConfigError naming the key when they do not fit. ep and cp borrow
        from fsdp (-1: all of it)."""
        found = fit_degrees({k: degrees.get(k, 1) for k in ORDER}, world_size)
        ep = borrowed("ep", "expert", int(degrees.get("ep", 1)), found["fsdp"])
        # ep and cp take disjoint factors of fsdp (cp x ep divides it): see the module's docstring
        cp = borrowed("cp", "context", int(degrees.get("cp", 1)), found["fsdp"] // ep, ep)
        return cls(**found, ep=ep, cp=cp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.fsdp * self.tp

    @property
    def data_size(self) -> int:
        """How many ranks read different data (dp x fsdp / cp)."""
        return self.dp * self.fsdp // self.cp

    @property
    def shard_size(self) -> int:
        """How many ranks FSDP spreads the parameters over (dp x fsdp: cp's ranks too)."""
        return self.dp * self.fsdp

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (row-major, as the mesh is laid out)."""
        out = {}
        for name in reversed(ORDER):
            size = getattr(self, name)
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in ORDER}

    def data_parallel(self, rank: int) -> tuple[int, int]:
        """(rank, size) of this process among the ranks that read different data (the ranks of
        a context-parallel group, neighbours along fsdp, read the same)."""
        c = self.coordinates(rank)
        per_dp = self.fsdp // self.cp
        return c["dp"] * per_dp + c["fsdp"] // self.cp, self.data_size

    def layout(self) -> tuple[list[tuple[str, int]], dict[str, tuple[str, ...]]]:
        """The mesh's dimensions [(name, size)] and its flattened views {name: dims}."""
        if self.ep == 1 and self.cp == 1:
            dims = [(n, getattr(self, n)) for n in ORDER]
            return dims, {"data": ("dp", "fsdp")}
        inner = [(n, getattr(self, n)) for n in ("ep", "cp") if getattr(self, n) > 1]
        outer = self.fsdp // (self.ep * self.cp)
        dims = [("pp", self.pp), ("dp", self.dp), ("fsdp_out", outer), *inner, ("tp", self.tp)]
        fsdp = ("fsdp_out", *(n for n, _ in inner))
        views = {"fsdp": fsdp, "data": ("dp", *(n for n in fsdp if n != "cp"))}
        if self.cp > 1:
            views["tokens"] = ("dp", *fsdp)
        if self.ep > 1:
            views["efsdp"] = ("dp", *(n for n in fsdp if n != "ep"))
        return dims, views

    def build_mesh(self, device_type: str) -> JobMesh:
        """The job's one DeviceMesh (needs the process group), with every view of `layout`."""
        from torch.distributed.device_mesh import init_device_mesh

        dims, views = self.layout()
        root = init_device_mesh(
            device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims)
        )
        return JobMesh(root, {name: root[parts]._flatten(name) for name, parts in views.items()})

    def describe(self) -> str:
        shown = [f"{n}={getattr(self, n)}" for n in (*ORDER, "ep", "cp") if getattr(self, n) > 1]
        return " x ".join(shown) or "one process"


def borrowed(key: str, what: str, degree: int, fsdp: int, ep: int = 1) -> int:
    """A degree that borrows its ranks from fsdp (-1: all of them), checked to divide it;
    `fsdp` is what is left of it (after expert parallel's `ep`, for cp)."""
    if degree == -1:
        return fsdp
    if degree < 1:
        raise ConfigError(f"strategy.{key}", degree, "must be at least 1, or -1 for all of fsdp")
    if fsdp % degree:
        left = f"fsdp / ep = {fsdp} left after strategy.ep={ep}" if ep > 1 else str(fsdp)
        raise ConfigError(
            f"strategy.{key}",
            degree,
            f"{what} parallel borrows its ranks from the fsdp degree ({left}), which it must "
            "divide",
            [d for d in range(1, fsdp + 1) if fsdp % d == 0],
            hint=f"Raise strategy.fsdp (e.g. strategy.fsdp=-1), or lower strategy.{key}.",
        )
    return degree


@dataclass(frozen=True)
class JobMesh:
    """The world mesh and its flattened views; `mesh[name]` or `mesh[(name, name)]` gives one."""

    root: object  # torch DeviceMesh over all processes
    flat: dict[str, object]  # flattened views, kept here (torch asks callers to keep them)

    def __getitem__(self, names):
        if isinstance(names, str) and names in self.flat:
            return self.flat[names]
        return self.root[names]
