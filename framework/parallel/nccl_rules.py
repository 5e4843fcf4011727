"""The rules NCCL enforces and gloo forgives, checked on a CPU run.

Our tests run on gloo, which buffers point-to-point messages, takes CPU tensors and lets two
ranks share a device; NCCL does none of that, and no GPU runs the tests. So what the code asks
of the communication library is recorded during a real CPU step (`NcclRecorder`) and held to
NCCL's rules:

1. **Point-to-point pairs progress together.** NCCL runs a pair of ranks' sends and receives
   in the order they were issued and a send only once the peer's receive is posted: two ranks
   that each first send to the other (unbatched) wait on each other for any message above
   NCCL's buffers. Such pairs must be issued in one `dist.batch_isend_irecv` (`p2p_violations`,
   over every rank's record).
2. **Every tensor handed to a collective on an NCCL group is on the group's device.** On a CPU
   run every tensor is on the CPU, so the recorder marks the tensors that would be on the CPU
   on a GPU too: those a factory (`torch.zeros`, `torch.tensor`, ...) made without `device=`,
   and what is computed from them alone; `.to(device)` clears the mark. A marked tensor handed
   to a collective of a group that would be NCCL (every group but the CPU-side gloo groups of
   `framework.world.host_group`), or mixed with unmarked ones in one operation, fails on a GPU
   (`device_violations`). The marks follow autograd into the backward of custom Functions.
3. **No two ranks of one NCCL group share a GPU** (`shared_devices`, on the plan: which machine
   and GPU each member of each NCCL group would take).
4. **Every gloo group a multi-node CUDA job creates binds to an explicit network interface.**
   `framework.world.host_group` makes every CPU-side gloo group and sets the interface; a gloo
   group made any other way during the recorded span is reported (`group_violations`).

`fw check` for a CUDA target holds a rank's setup, forward and backward to rule 2 on the meta
device instead (framework/preflight/devices.py); the test suite records real multi-process steps
(cp ring, pipeline, expert all-to-all) with this module.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from framework.parallel.placement import COLLECTIVES, caller
from framework.world import HOST_GROUP

P2P = ("send", "recv_")  # c10d's point-to-point ops (dist.send/isend, dist.recv/irecv)


@dataclass
class Event:
    """One collective or point-to-point op a rank issued (or an operation mixing devices)."""

    op: str
    step: int
    at: str  # the framework line that issued it
    group: str = ""
    host: bool = False  # on a CPU-side gloo group (framework.world.host_group)
    backward: bool = False
    side: str = ""  # where a tensor without a device given to it was made, if one was handed
    peer: int | None = None  # point-to-point: the global rank of the other end
    batch: int | None = None  # point-to-point: the batch_isend_irecv call it was issued in
    mixed: bool = False


@dataclass
class Record:
    """What a rank asked of the communication library while recording."""

    events: list[Event] = field(default_factory=list)
    gloo_groups: list[tuple[str, str, str]] = field(default_factory=list)  # (name, desc, at)


class NcclRecorder(TorchDispatchMode):
    """While active, records this rank's collectives and point-to-point ops, the tensors it made
    without a device, and the gloo groups it creates (`record`); `step` labels the events."""

    def __init__(self) -> None:
        super().__init__()
        self.record = Record()
        self.step = 0
        self.side: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # tensor -> where made
        self._inside = 0
        self._depth = 0
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self):
        self._depth += 1
        if self._depth == 1:  # entered again inside a DTensor op: the dispatch mode only
            self._function_mode = _Unplaced(self)
            self._function_mode.__enter__()
            self._patch()
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        try:
            return super().__exit__(*exc)
        finally:
            if self._depth == 0:
                for owner, name, value in reversed(self._undo):
                    setattr(owner, name, value)
                self._undo = []
                self._function_mode.__exit__(*exc)

    def _patch(self) -> None:
        """Function modes do not follow autograd into a custom Function's backward: re-entered
        there; and every gloo group created is noted."""
        backward = torch.autograd.function.BackwardCFunction
        apply, new_group, recorder = backward.apply, dist.new_group, self

        def apply_marking(node, *args):
            with _Unplaced(recorder):
                return apply(node, *args)

        def noted_new_group(*args, **kwargs):
            group = new_group(*args, **kwargs)
            if str(kwargs.get("backend") or "").lower() == "gloo":
                desc = kwargs.get("group_desc") or ""
                recorder.record.gloo_groups.append((group.group_name, desc, _where()))
            return group

        self._undo = [(backward, "apply", apply), (dist, "new_group", new_group)]
        backward.apply = apply_marking
        dist.new_group = noted_new_group

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)]
        if func.namespace in COLLECTIVES:
            self._collective(func, args, tensors)
        elif _is_dtensor_op(types):  # its own collectives run below: seen with the mode again
            if self._inside:
                return NotImplemented
            self._inside += 1
            try:
                with self:
                    return func(*args, **kwargs)
            finally:
                self._inside -= 1
        out = func(*args, **kwargs)
        if func.namespace not in COLLECTIVES and not func._schema.is_mutable:
            self._follow(func, tensors, out)
        return out

    def _follow(self, func, tensors, out) -> None:
        """A result of marked tensors alone is marked; marked and unmarked ones together (not
        counting 0-d tensors, which CUDA takes from the CPU) would meet on two devices."""
        big = [t for t in tensors if t.dim() > 0]
        marked = [t for t in big if t in self.side]
        if not marked:
            return
        if len(marked) == len(big):
            for t in tree_leaves(out):
                if torch.is_tensor(t):
                    self.side[t] = self.side[marked[0]]
            return
        self.record.events.append(
            Event(str(func), self.step, _where(), side=self.side[marked[0]], mixed=True)
        )

    def _collective(self, func, args, tensors) -> None:
        name = func.overloadpacket.__name__
        group = _group(func, args)
        side = next((self.side[t] for t in tensors if t in self.side), "")
        host = group is not None and group.group_desc.startswith(HOST_GROUP)
        label = group.group_name if group is not None else ""
        event = Event(name, self.step, _where(), label, host, _in_backward(), side)
        if name in P2P:
            event.peer = dist.get_global_rank(group, int(args[2]))
            event.batch = _batch_call()
        self.record.events.append(event)


class _Unplaced(TorchFunctionMode):
    """Marks every tensor a factory makes without `device=` (on a GPU run it would be on the
    CPU); a tensor moved to a named device is unmarked."""

    def __init__(self, recorder: NcclRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not torch.is_tensor(out):
            return out
        if func in _constructors() and kwargs.get("device") is None:
            self.recorder.side[out] = _where()
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and _names_device(args[1:], kwargs):
            self.recorder.side.pop(out, None)
        return out


def _constructors():
    from torch.utils._device import _device_constructors

    return _device_constructors()


def _names_device(args, kwargs) -> bool:
    if "device" in kwargs:
        return True
    return any(isinstance(a, (str, torch.device)) for a in args)


def _is_dtensor_op(types) -> bool:
    from torch.distributed.tensor import DTensor

    return any(issubclass(t, DTensor) for t in types)


def _group(func, args):
    """The group a collective op was given, found by its argument's name: a ProcessGroup
    object (c10d ops' `process_group`) or a group's name (functional collectives' `group_name`,
    after other strings such as the reduce op's "sum")."""
    from torch._C._distributed_c10d import ProcessGroup

    for argument, value in zip(func._schema.arguments, args, strict=False):
        if argument.name not in ("process_group", "group_name"):
            continue
        if isinstance(value, str):
            return dist.distributed_c10d._resolve_process_group(value)
        if isinstance(value, torch.ScriptObject):
            return ProcessGroup.unbox(value)
        return value if isinstance(value, ProcessGroup) else None
    return None


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


def _batch_call() -> int | None:
    """The `dist.batch_isend_irecv` call on the stack (its frame's id), None when the op was
    issued on its own (gloo issues a batch's ops one by one, so only the stack tells)."""
    batch = dist.distributed_c10d.batch_isend_irecv.__code__
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is batch:
            return id(frame)
        frame = frame.f_back
    return None


def _where() -> str:
    return caller(__file__)


# ---- the rules


def device_violations(record: Record) -> list[str]:
    """Rule 2: a tensor made without a device handed to a collective of a group that would be
    NCCL (every group but the CPU-side gloo groups), or mixed with device tensors."""
    found = []
    for e in record.events:
        if e.mixed:
            found.append(
                f"step {e.step}: {e.op} mixes a tensor made without device= at {e.side} with "
                f"tensors on the device ({e.at}): on a GPU they are on two devices"
            )
        elif e.side and not e.host:
            phase = "backward" if e.backward else "forward"
            found.append(
                f"step {e.step}: {e.op.rstrip('_')} on group {e.group} ({phase}, {e.at}) is "
                f"handed a tensor made without device= at {e.side}: on a GPU it is a CPU "
                "tensor, which NCCL refuses"
            )
    return found


def p2p_violations(records: dict[int, Record]) -> list[str]:
    """Rule 1, over every rank's record: NCCL runs a pair's point-to-point ops in issue order,
    a send only once the peer's matching receive is posted; a pair whose first ops toward each
    other are both unbatched sends (or both receives) waits forever on blocks above NCCL's
    buffers."""
    found = []
    ranks = sorted(records)
    for a in ranks:
        for b in ranks:
            if b <= a:
                continue
            units_a, units_b = _units(records[a], b), _units(records[b], a)
            for (ops_a, first), (ops_b, _) in zip(units_a, units_b, strict=False):
                if len(ops_a) == 1 and ops_a == ops_b:
                    found.append(
                        f"ranks {a} and {b} both issue a bare {first.op.rstrip('_')} to the "
                        f"other first (step {first.step}, {first.at}): NCCL waits forever on "
                        "messages above its buffers; issue the pair in one "
                        "dist.batch_isend_irecv"
                    )
                    break
            if len(units_a) != len(units_b):
                found.append(
                    f"ranks {a} and {b}: {len(units_a)} and {len(units_b)} point-to-point "
                    "exchanges with each other: unmatched"
                )
    return found


def _units(record: Record, peer: int) -> list[tuple[set[str], Event]]:
    """This rank's point-to-point ops with `peer` in issue order, one unit per op issued alone
    and one per batch_isend_irecv call: (its op names, its first event)."""
    units: list[tuple[set[str], Event]] = []
    last = None
    for e in record.events:
        if e.peer != peer:
            continue
        if e.batch is not None and e.batch == last:
            units[-1][0].add(e.op)
        else:
            units.append(({e.op}, e))
        last = e.batch
    return units


def group_violations(record: Record) -> list[str]:
    """Rule 4: gloo groups created other than by framework.world.host_group (which binds them
    to an explicit interface in a multi-node CUDA job)."""
    return [
        f"a gloo group ({name}) created at {at} outside framework.world.host_group: in a "
        "multi-node CUDA job it binds to whatever the host name resolves to"
        for name, desc, at in record.gloo_groups
        if not desc.startswith(HOST_GROUP)
    ]


def shared_devices(members: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Rule 3: for each NCCL group (by name) the (machine, GPU index) of each member, in member
    order; a GPU that two members of one group would take, named."""
    found = []
    for group, places in members.items():
        seen: dict[tuple[str, int], int] = {}
        for member, place in enumerate(places):
            if place in seen:
                found.append(
                    f"{group}: members {seen[place]} and {member} would both run on GPU "
                    f"{place[1]} of {place[0]} (NCCL refuses two ranks of one group on one GPU)"
                )
            else:
                seen[place] = member
    return found


def violations(records: dict[int, Record]) -> list[str]:
    """Every rule this module checks on recorded ranks (1, 2 and 4), one line each."""
    found = p2p_violations(records)
    for rank, record in sorted(records.items()):
        found += [f"rank {rank}: {line}" for line in device_violations(record)]
        found += [f"rank {rank}: {line}" for line in group_violations(record)]
    return found
