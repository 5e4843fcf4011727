"""What costs the host time per call on a simulated rank, counted (fw plan's host term,
framework/preflight/perf.py): a dispatch mode over a step of `fw check`'s simulation
(preflight/simulate.py) or of `fw calibrate`'s probes, and the FSDP2 units of a model. Its own
module: the simulation and the model both use it, and the model reads the simulation."""

from __future__ import annotations

COLLECTIVES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}  # op namespaces
NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}  # in them, sending nothing
# a model whose step depends on its data is counted on real tensors up to this many parameters
REAL_COUNT_PARAMS = 5e7


def host_counting():
    """A dispatch mode that counts, on a simulated rank, what costs the host time per call:
    `ops` on plain tensors, `dtensor_ops` (an operation with a DTensor argument: DTensor's own
    dispatch, sharding propagation and the local operation) and `collectives` issued (process
    group calls and functional collectives, their waits and autograd wrappers aside), of which
    `functional` are functional collectives (DTensor's) and `reductions` are reduce-scatters (a pipeline's FSDP2 stage reduces its gradients once per
    step, after the last microbatch, not in each). Operations a DTensor runs on its local
    shards inside its dispatch are not counted again (its one call is), but the collectives
    it issues there are (loss parallel's over the vocabulary-split logits: three a step)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostCounting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = self.dtensor_ops = self.collectives = self.reductions = 0
            self.functional = 0  # of the collectives, functional ones (DTensor's)
            self.inside = 0  # DTensor dispatches under way

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in COLLECTIVES:
                name = func._overloadpacket.__name__
                sent = name not in NOT_COLLECTIVES
                self.collectives += sent
                self.functional += sent and func.namespace != "c10d"
                self.reductions += "reduce_scatter" in name
            elif any(issubclass(t, DTensor) for t in types):
                if self.inside:  # seen once already: DTensor's own dispatch, this mode on
                    return NotImplemented
                self.dtensor_ops += 1
                self.inside += 1
                try:
                    with self:  # the mode again, to see the collectives DTensor issues
                        return func(*args, **(kwargs or {}))
                finally:
                    self.inside -= 1
            elif not self.inside:
                self.ops += 1
            return func(*args, **(kwargs or {}))

        def counts(self) -> dict[str, int]:
            return {"ops": self.ops, "dtensor_ops": self.dtensor_ops,
                    "collectives": self.collectives, "reductions": self.reductions,
                    "functional": self.functional}  # fmt: skip

    return HostCounting()


def real_calls(run, contexts) -> dict[str, int]:
    """`host_counting`'s counts of `run` (forward and backward) on real tensors, under
    `contexts` (the step's autocast, the fake group's all-to-all made consistent): for a step whose shapes depend on its data (routed
    experts: tokens per expert), which fake tensors cannot run. On the fake process group every
    collective returns at once, whatever it was sent: its count is the real step's."""
    import contextlib

    counter = host_counting()
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        with counter:
            run()
    return counter.counts()


def fsdp_units(module) -> int:
    """FSDP2 units in `module` (each gathers, frees and reduces its parameters per step, in
    hooks around its forward and backward)."""
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in module.modules())
