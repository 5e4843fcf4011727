"""What every Lightning strategy built by a framework strategy plugin has in common.

A plugin's `build(cfg, world, inputs)` (see `framework.plugins.StrategyPlugin`) receives
`StrategyInputs` from the worker and returns a Lightning `Strategy`. Mixing `StrategyBase` in
front of the Lightning class gives that strategy what the worker and the callbacks rely on:

- `inputs` kept on the strategy (its `__init__` takes `inputs=` before Lightning's arguments);
- resuming from a checkpoint written in another layout or process count (`inputs.move_from`):
  the checkpoint is read as one full state (`framework.checkpoint.portable`) and handed to the strategy's
  own `load_portable(state)`, which copies it into its sharding;
- the once-per-optimizer-step work after the last backward of a step (`before_optimizer_step`:
  mixture-of-experts load balancing, and each strategy's own gradient work);
- data loaders in one global order (framework.data.order): every loader Lightning prepares gets
  a `GlobalOrderSampler` bound to this rank's (rank, size) among the ranks that read different
  data (unless `task.data_order=keep`);
- `step_loss()`: the loss of the step about to be applied, for callbacks that judge it first;
- `save_async(trainer, filepath)`: the checkpoint callback's one question for a background write
  (`callbacks.checkpoint.async_save`); None by default, the strategies with DCP layouts answer it.

The strategy itself applies `inputs.transforms` (activation checkpointing, compile) to the task's
blocks at the right point of its setup: after tensor parallelism, before data-parallel wrapping.
`Replicated` adds what every strategy that keeps the whole model on each process shares (ddp,
diloco). Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from concurrent.futures import Future

    from framework.checkpoint import portable
    from framework.parallel.transforms import ModelTransforms


@dataclass(frozen=True)
class StrategyInputs:
    """What the worker hands a strategy plugin's `build`, besides its config and the world."""

    transforms: ModelTransforms  # activation checkpointing / compile for the task's blocks
    data_parallel: tuple[int, int] = (0, 1)  # (rank, size) among ranks reading different data
    move_from: Path | None = None  # resume checkpoint written by another layout or world size
    data_order: str = "global"  # task.data_order: global (framework.data.order) or keep


class StrategyBase:
    """Mixin for the Lightning strategies the plugins build: inputs, moves, sampler binding."""

    inputs: StrategyInputs

    def __init__(self, *args: Any, inputs: StrategyInputs, **kwargs: Any) -> None:
        self.inputs = inputs
        super().__init__(*args, **kwargs)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        if self.inputs.move_from is None:
            return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]
        from framework.checkpoint import portable

        state = portable.read(self.inputs.move_from)
        self.load_portable(state)
        return state.rest

    def load_portable(self, state: portable.Portable) -> None:
        """Copy a full, name-keyed state into this strategy's model and optimizers."""
        raise NotImplementedError(f"{type(self).__name__} cannot take in another layout")

    def save_async(self, trainer: Any, filepath: Path) -> Future | None:
        """Write the checkpoint of `trainer` at `filepath` in the background: returns once the
        state is copied (training may go on changing it), with the Future of the write (its
        `result()` raises a failed write). None (the default): this strategy writes in the
        foreground only, nothing was written, and the caller saves with
        `trainer.save_checkpoint`. Called on every rank, at the same step."""
        return None

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """What `self.log(..., sync_dist=True)` reduces with: Lightning's reduction without the
        barrier it issues before each all-reduce (`all_reduce_value`)."""
        import torch

        if not isinstance(tensor, torch.Tensor) or not distributed():
            return super().reduce(tensor, *args, **kwargs)  # type: ignore[misc]
        return all_reduce_value(tensor, *args, **kwargs)

    def parameter_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.lightning_module.named_parameters()}  # type: ignore[attr-defined]

    def data_group(self) -> Any:
        """The process group of the ranks that read different data (None: all processes)."""
        return None

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def closure_then_prepare(*args: Any, **kw: Any) -> Any:
            result = closure(*args, **kw)
            self.__dict__["_step_loss"] = result.detach() if result is not None else None
            self.before_optimizer_step()
            return result

        return super().optimizer_step(optimizer, closure_then_prepare, model, **kwargs)  # type: ignore[misc]

    def step_loss(self) -> Any:
        """The loss of the step the optimizer is about to apply, as the training step's closure
        returned it (detached; with gradient accumulation the last micro-batch's, divided by
        the accumulation), for callbacks that judge a step before it is applied
        (`callbacks.loss_guard`, in `on_before_optimizer_step`). None before the first step or
        when the training step returned no loss; under pipeline parallel every stage has it."""
        return self.__dict__.get("_step_loss")

    def before_optimizer_step(self) -> None:
        """Once per optimizer step, after the last backward of the step: the mixture-of-experts
        routers move their expert bias towards equal load (counts summed over the data ranks).
        The layers are found at the first step (after every swap and pipeline cut) and kept: a
        walk of the module tree at every step costs a model without experts 50 us."""
        task = self.lightning_module  # type: ignore[attr-defined]
        found = self.__dict__.get("_moe_layers")
        if found is None or found[0] is not task:
            from framework.parallel.experts import moe_layers

            found = self.__dict__["_moe_layers"] = (task, moe_layers(task))
        if found[1]:
            from framework.parallel.experts import balance

            balance(found[1], self.data_group())  # type: ignore[attr-defined]

    def process_dataloader(self, dataloader: Any) -> Any:
        if self.inputs.data_order == "global":
            from framework.data.order import in_global_order

            warned = self.__dict__.setdefault("_data_warned", set())
            dataloader = in_global_order(dataloader, *self.inputs.data_parallel, warned)
        return super().process_dataloader(dataloader)  # type: ignore[misc]


class Replicated(StrategyBase):
    """Every process holds the whole model and optimizer (ddp, diloco): transforms applied before
    Lightning moves and wraps the task; a checkpoint from another layout taken in, the model
    state before setup (as Lightning loads a ddp checkpoint), the optimizer state, keyed by
    parameter name, once the optimizer exists."""

    def setup(self, trainer: Any) -> None:
        self.inputs.transforms.apply(self.lightning_module)  # type: ignore[attr-defined]
        super().setup(trainer)  # type: ignore[misc]

    def load_portable(self, state: portable.Portable) -> None:
        state.rest["state_dict"] = state.model
        # keyed by name until the optimizer exists
        state.rest["optimizer_states"] = state.optimizers

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self.inputs.move_from is None:
            return super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
        from framework.checkpoint import portable

        names = self.parameter_names()
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):  # type: ignore[attr-defined]
            optimizer.load_state_dict(portable.indexed_state(optimizer, saved, names))


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_value(tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    """Reduce `tensor` in place over `group` (None: every process) as Lightning's `_sync_ddp`
    does ('mean'/'avg', 'sum', 'max', 'min' or a ReduceOp; None is a sum), without the barrier
    it issues first: the all-reduce already waits for every rank, and on NCCL the barrier also
    blocks the host until the GPU has run everything queued, at every step a task logs with
    `sync_dist`."""
    import torch
    import torch.distributed as dist

    group = dist.group.WORLD if group is None else group
    op, divide = reduce_op, False
    if op is None:
        op = dist.ReduceOp.SUM
    elif isinstance(op, str):
        name = op.lower()
        if name in ("mean", "avg"):  # gloo has no AVG: a sum, divided here
            op, divide = dist.ReduceOp.SUM, True
        else:
            op = getattr(dist.ReduceOp, name.upper())
    dist.all_reduce(tensor, op=op, group=group)
    if not divide:
        return tensor
    size = dist.get_world_size(group)
    if not torch.is_floating_point(tensor):
        return tensor.copy_(tensor / size)
    return tensor.div_(size)
