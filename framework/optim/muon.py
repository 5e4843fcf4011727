"""Muon for a task's hidden 2-D weights and AdamW for the rest, in one optimizer, exact under
every layout.

Which parameters (`hidden_matrices`, the documented rule): Muon steps the 2-D weight of every
linear layer (`nn.Linear`, float8's included) except the model's output head (framework.nn's
LMHead, a linear named `*head` or `*output`, or one whose weight is tied to an embedding);
AdamW steps everything else: embeddings, the head, norms, biases, routed experts' stacked 3-D
weights and every other parameter. `TaskModule.make_optimizer` applies the rule to the task's
`param_groups()`, so a group's own settings (e.g. no weight decay for norms) stay with its
AdamW part; given plain parameters, the optimizer sends the 2-D ones to Muon.

The Muon update is torch's (`torch.optim.Muon`, torch 2.13): momentum, Nesterov, five
Newton-Schulz iterations in bf16, the learning rate adjusted by the matrix's shape. The
Newton-Schulz step needs the whole matrix, which under sharded layouts no rank holds. Each
rank keeps the momentum and the update of its own part (elementwise, as one process would
compute them), then the matrices are spread over the ranks that shard them, round-robin: each
rank gathers the parts of the matrices it owns, orthogonalises them whole, and sends each
rank back its part of the result (one all-to-all each way):
- FSDP2, tensor parallel and their combinations (DTensor parameters): matrices of one shape
  and placement are stacked, the stack re-sharded over its first dimension (DTensor's
  redistribute: an all-to-all), one whole matrix per rank, and back;
- DeepSpeed ZeRO-1/2/3 (flat partitions, `bind_flat`): the DeepSpeed strategy describes which
  stretch of which matrix each rank's partition holds (framework/strategies/deepspeed/muon.py);
- ddp, pipeline stages, one process: each rank holds its matrices whole and orthogonalises
  them itself (as torch's Muon does).
So every layout reproduces one process. Momentum is one tensor per parameter in the
parameter's shape and placement (ZeRO: per flat partition), AdamW's state is torch's AdamW's:
checkpoints resume across layouts by parameter name as AdamW's do.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)

HEAD_NAMES = ("*head", "*output")  # the output projection of a model, by its module name


def hidden_matrices(task: nn.Module) -> set[int]:
    """Ids of the parameters Muon steps (the module docstring's rule)."""
    embedded = {id(m.weight) for m in task.modules() if isinstance(m, nn.Embedding)}
    found = set()
    for name, module in task.named_modules():
        if not isinstance(module, nn.Linear) or type(module).__name__ == "LMHead":
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in HEAD_NAMES):
            continue
        if module.weight.dim() == 2 and id(module.weight) not in embedded:
            found.add(id(module.weight))
    return found


def split_groups(task: nn.Module, groups: Iterable[Any]) -> list[dict[str, Any]]:
    """The task's parameter groups (or parameters) split into Muon and AdamW groups
    (`use_muon`), each keeping its group's own settings; empty groups dropped."""
    hidden = hidden_matrices(task)
    groups = list(groups)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for group in groups:
        params = list(group["params"])
        settings = {k: v for k, v in group.items() if k != "params"}
        muon = [p for p in params if id(p) in hidden]
        adamw = [p for p in params if id(p) not in hidden]
        out += [{**settings, "params": muon, "use_muon": True}] if muon else []
        out += [{**settings, "params": adamw, "use_muon": False}] if adamw else []
    return out


def from_torch(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`torch.optim.Muon`'s arguments as this optimizer's: its `eps` is the Newton-Schulz one,
    and its learning-rate adjustment defaults to torch's (`original`)."""
    out = dict(kwargs)
    if "eps" in out:
        out["ns_eps"] = out.pop("eps")
    out.setdefault("adjust_lr_fn", None)
    return out


@dataclass
class FlatMatrix:
    """One matrix in a flat partition (DeepSpeed ZeRO): its shape, where this rank's stretch of
    it lies in the partition, and the stretch (start, count) of its flattened elements that
    each rank of the group holds."""

    shape: tuple[int, int]
    offset: int
    ranges: list[tuple[int, int]]


@dataclass
class FlatLayout:
    """The matrices of one flat partition and the process group that partitions them."""

    matrices: list[FlatMatrix]
    group: Any


class Muon(torch.optim.Optimizer):
    """torch's Muon update for the `use_muon` groups (hidden 2-D weights) and torch's AdamW for
    the others, exact under FSDP2, tensor parallel, pipeline and ZeRO (module docstring).

    `lr`, `weight_decay`: both parts (AdamW's unless `adamw_lr` / `adamw_weight_decay` say
    otherwise); `momentum`, `nesterov`, `ns_coefficients`, `ns_eps`, `ns_steps`: Muon's;
    `adjust_lr_fn`: how Muon's lr scales with the matrix's shape: `match_rms_adamw` (the
    default: updates of AdamW's size, so AdamW's lr and weight decay carry over) or
    `original` (torch's default: sqrt(max(1, rows/cols))); `betas`, `eps`: AdamW's."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        ns_eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = "match_rms_adamw",
        ns_dtype: str = "bfloat16",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        adamw_lr: float | None = None,
        adamw_weight_decay: float | None = None,
    ) -> None:
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}: original or match_rms_adamw")
        if ns_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"ns_dtype={ns_dtype!r}: bfloat16 or float32")
        aux = torch.optim.AdamW([torch.zeros(1)])  # its defaults: what its step reads per group
        self._adamw_defaults = {
            **aux.defaults,
            "lr": lr if adamw_lr is None else adamw_lr,
            "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            "betas": tuple(betas),
            "eps": eps,
        }
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "ns_eps": ns_eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
        }
        super().__init__(flagged(params), defaults)
        self._adamw = aux
        self._flat: dict[int, FlatLayout] = {}
        for group in self.param_groups:
            if group["use_muon"]:
                bad = [tuple(p.shape) for p in group["params"] if p.dim() != 2]
                if bad:
                    raise ValueError(f"Muon steps 2-D weights only; this group holds {bad}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group flagged `use_muon` gets Muon's defaults, any other AdamW's."""
        if not param_group.get("use_muon", False):
            param_group.setdefault("use_muon", False)
            for key, value in self._adamw_defaults.items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)

    def bind_flat(self, flat: torch.Tensor, layout: FlatLayout) -> None:
        """Say which matrices the flat partition `flat` (a ZeRO optimizer's, standing in for a
        Muon group's parameters) holds; called by the DeepSpeed strategy once the engine exists."""
        self._flat[id(flat)] = layout

    @torch.no_grad()
    def step(self, closure=None):
        """One step: AdamW on the AdamW groups, Muon on the others."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        adamw = [g for g in self.param_groups if not g["use_muon"]]
        if adamw:  # torch's AdamW on these groups and this optimizer's state
            self._adamw.param_groups = adamw
            self._adamw.state = self.state
            self._adamw.step()
        muon = [g for g in self.param_groups if g["use_muon"]]
        if muon:
            self._muon_step(muon)
        return loss

    def _muon_step(self, groups: list[dict[str, Any]]) -> None:
        jobs = []
        for group in groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = self._momentum(p, group)
                layout = self._flat.get(id(p))
                if layout is not None:  # this rank's stretch of each matrix of the partition
                    me = layout_rank(layout)
                    for m in layout.matrices:
                        part = update.narrow(0, m.offset, m.ranges[me][1])
                        jobs.append(Job(p, part, m.shape, group, m))
                else:
                    jobs.append(Job(p, update, tuple(p.shape), group))
        results = orthogonalize(jobs, self._flat)
        done = set()
        for job, result in zip(jobs, results, strict=True):
            group, target = job.group, local(job.param)
            if id(job.param) not in done:  # decoupled weight decay, once per tensor
                done.add(id(job.param))
                target.mul_(1 - group["lr"] * group["weight_decay"])
            if job.flat is not None:
                target = target.narrow(0, job.flat.offset, result.numel())
            lr = _adjust_lr(group["lr"], group["adjust_lr_fn"], torch.Size(job.shape))
            target.add_(result.view_as(target), alpha=-lr)

    def _momentum(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Torch's momentum and Nesterov update, elementwise: on whatever part of the
        parameter this rank holds, as one process computes it."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buf, grad = local(state["momentum_buffer"]), local(p.grad)
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        if is_dtensor(p):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(
                update, p.grad.device_mesh, p.grad.placements, shape=p.shape, stride=p.stride()
            )
        return update


def flagged(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Parameter groups with `use_muon` set: given as they are, else 2-D tensors to Muon."""
    params = list(params)
    if not params:
        return []
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    out = []
    for group in groups:
        if "use_muon" in group:
            out.append(group)
            continue
        tensors = list(group["params"])
        settings = {k: v for k, v in group.items() if k != "params"}
        matrices = [p for p in tensors if p.dim() == 2]
        rest = [p for p in tensors if p.dim() != 2]
        out += [{**settings, "params": matrices, "use_muon": True}] if matrices else []
        out += [{**settings, "params": rest, "use_muon": False}] if rest else []
    return out


@dataclass
class Job:
    """One matrix to orthogonalise: the tensor its update is applied to, this rank's part of
    the update, the whole matrix's shape, its group, and (ZeRO) its place in a flat partition."""

    param: torch.Tensor
    update: torch.Tensor
    shape: tuple[int, ...]
    group: dict[str, Any]
    flat: FlatMatrix | None = None


def layout_rank(layout: FlatLayout) -> int:
    import torch.distributed as dist

    return dist.get_rank(layout.group)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (sharing its storage), any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def newton_schulz(matrix: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """The Newton-Schulz orthogonalisation of one whole matrix, returned in its dtype: torch's
    own (bf16), or the same iteration in float32 (`ns_dtype`)."""
    coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["ns_eps"]
    if group.get("ns_dtype", "bfloat16") == "bfloat16":
        return _zeropower_via_newtonschulz(matrix, coefficients, steps, eps).to(matrix.dtype)
    a, b, c = coefficients
    x = matrix.float()
    tall = matrix.size(0) > matrix.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(matrix.dtype)


def orthogonalize(jobs: list[Job], flat: dict[int, FlatLayout]) -> list[torch.Tensor]:
    """This rank's part of each job's orthogonalised update, in order (the module docstring's
    three cases); every rank of a group calls it with its jobs in the same order."""
    results: list[torch.Tensor | None] = [None] * len(jobs)
    buckets: dict[Any, list[int]] = {}
    flats: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        if job.flat is not None:
            flats.setdefault(id(job.param), []).append(i)
        elif is_dtensor(job.update):
            u = job.update
            key = (id(u.device_mesh), tuple(u.placements), tuple(u.shape), u.dtype)
            buckets.setdefault(key, []).append(i)
        else:
            results[i] = newton_schulz(job.update, job.group)
    for pid, indices in flats.items():
        for i, out in zip(
            indices, exchange_flat([jobs[i] for i in indices], flat[pid]), strict=True
        ):
            results[i] = out
    first = 0  # the owner of the next matrix: round-robin across the buckets too
    for indices in buckets.values():
        done = exchange_dtensors([jobs[i] for i in indices], first)
        for i, out in zip(indices, done, strict=True):
            results[i] = out
        first += len(indices)
    return results  # type: ignore[return-value]


def exchange_dtensors(jobs: list[Job], first: int = 0) -> list[torch.Tensor]:
    """Matrices of one mesh, placement, shape and dtype: in rounds of as many as the mesh has
    ranks, stacked, re-sharded so that each rank holds whole matrices (DTensor's
    redistribute), orthogonalised there, and re-sharded back; this rank's parts returned. The
    matrices go to the ranks in turn, matrix i to the rank at place (first + i) mod N."""
    from torch.distributed.tensor import DTensor, Shard

    update = jobs[0].update
    mesh, placements, shape = update.device_mesh, shifted(update.placements), tuple(update.shape)
    n = mesh.size()
    owners = [Shard(0)] * mesh.ndim  # the stack's first dimension over all ranks: one each
    whole = (n, *shape)
    stride = contiguous_stride(whole)
    place = owned_index(mesh)
    out: list[torch.Tensor] = []
    for start in range(0, len(jobs), n):
        chunk = jobs[start : start + n]
        slots = [(first + start + i) % n for i in range(len(chunk))]
        # every rank owns exactly one slot of the stack; the slots no matrix fills this round
        # hold zeros (DTensor's re-sharding of an uneven first dimension is not safe on gloo)
        parts = [torch.zeros_like(chunk[0].update.to_local())] * n
        for slot, job in zip(slots, chunk, strict=True):
            parts[slot] = job.update.to_local()
        spread = DTensor.from_local(
            torch.stack(parts), mesh, placements, shape=whole, stride=stride
        )
        mine = spread.redistribute(mesh, owners).to_local()[0]
        done = newton_schulz(mine, chunk[0].group) if place in slots else mine
        back = DTensor.from_local(done.unsqueeze(0), mesh, owners, shape=whole, stride=stride)
        returned = back.redistribute(mesh, placements).to_local()
        out += [returned[slot] for slot in slots]
    return out


def owned_index(mesh) -> int:
    """Which slot of a stack of `mesh.size()` matrices this rank holds once the stack is
    sharded over its first dimension by every mesh dimension in turn: its place in the mesh."""
    index = 0
    for dim in range(mesh.ndim):
        index = index * mesh.size(dim) + mesh.get_local_rank(dim)
    return index


def shifted(placements) -> list[Any]:
    """A matrix's placements as those of a stack of such matrices (sharded dims one further)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in placements:
        if isinstance(p, _StridedShard):
            out.append(_StridedShard(p.dim + 1, split_factor=p.split_factor))
        elif isinstance(p, Shard):
            out.append(Shard(p.dim + 1))
        elif isinstance(p, Replicate):
            out.append(p)
        else:
            raise ValueError(f"Muon cannot orthogonalise a matrix placed as {p}")
    return out


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= size
    return tuple(reversed(out))


def exchange_flat(jobs: list[Job], layout: FlatLayout) -> list[torch.Tensor]:
    """The matrices of one flat partition (ZeRO): matrix j belongs to rank j mod N; one
    all-to-all sends each owner the stretches the other ranks hold, the owner orthogonalises
    the whole matrix, one all-to-all sends each rank its stretches of the results."""
    import torch.distributed as dist

    group = layout.group
    n, me = dist.get_world_size(group), dist.get_rank(group)
    matrices = layout.matrices
    mine = [j for j in range(len(matrices)) if j % n == me]
    dtype, device = jobs[0].update.dtype, jobs[0].update.device
    # to each owner, this rank's stretches of its matrices, in matrix order
    send = [torch.cat([jobs[j].update.reshape(-1) for j in range(len(matrices)) if j % n == d]
                      or [torch.zeros(0, dtype=dtype, device=device)]) for d in range(n)]  # fmt: skip
    send_sizes = [int(s.numel()) for s in send]
    recv_sizes = [sum(matrices[j].ranges[s][1] for j in mine) for s in range(n)]
    received = all_to_all(torch.cat(send), send_sizes, recv_sizes, group)
    pieces = list(received.split(recv_sizes))
    results: dict[int, torch.Tensor] = {}
    reply = [[] for _ in range(n)]
    offsets = [0] * n
    for j in mine:  # assemble, orthogonalise, cut back into the ranks' stretches
        rows, cols = matrices[j].shape
        full = torch.zeros(rows * cols, dtype=dtype, device=device)
        for s in range(n):
            start, count = matrices[j].ranges[s]
            full[start : start + count] = pieces[s][offsets[s] : offsets[s] + count]
            offsets[s] += count
        result = newton_schulz(full.view(rows, cols), jobs[j].group).reshape(-1)
        for s in range(n):
            start, count = matrices[j].ranges[s]
            reply[s].append(result[start : start + count])
        results[j] = result
    back = [torch.cat(r) if r else torch.zeros(0, dtype=dtype, device=device) for r in reply]
    returned = all_to_all(torch.cat(back), recv_sizes, send_sizes, group)
    out, offsets_by_owner = [], [0] * n
    parts = list(returned.split(send_sizes))
    for j, job in enumerate(jobs):
        owner, count = j % n, job.update.numel()
        out.append(parts[owner][offsets_by_owner[owner] : offsets_by_owner[owner] + count])
        offsets_by_owner[owner] += count
    return out


def all_to_all(send: torch.Tensor, send_sizes, recv_sizes, group) -> torch.Tensor:
    """torch's all_to_all_single with uneven splits (gloo and NCCL take it)."""
    import torch.distributed as dist

    received = send.new_empty(sum(recv_sizes))
    dist.all_to_all_single(received, send, recv_sizes, send_sizes, group=group)
    return received
