"""What every Lightning strategy built by a framework strategy plugin has in common.

A plugin's `build(cfg, world, inputs)` (see `framework.plugins.StrategyPlugin`) receives
`StrategyInputs` from the worker and returns a Lightning `Strategy`. Mixing `StrategyBase` in
front of the Lightning class gives that strategy what the worker and the callbacks rely on:

- `inputs` kept on the strategy (its `__init__` takes `inputs=` before Lightning's arguments);
- resuming from a checkpoint of any layout and process count: the checkpoint is opened by the
  framework's type-restricted reader of its format (framework/checkpoint/formats), and the
  strategy's own `restore(source)` reads the parts of it this rank holds into its model and
  optimizers (framework/checkpoint/load.py; ZeRO partitions in the DeepSpeed strategy): no rank
  reads or holds the whole state, and no checkpoint file is ever unpickled without restriction;
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

    from framework.checkpoint.portable import Source
    from framework.parallel.transforms import ModelTransforms


@dataclass(frozen=True)
class StrategyInputs:
    """What the worker hands a strategy plugin's `build`, besides its config and the world."""

    transforms: ModelTransforms  # activation checkpointing / compile for the task's blocks
    data_parallel: tuple[int, int] = (0, 1)  # (rank, size) among ranks reading different data
    data_order: str = "global"  # task.data_order: global (framework.data.order) or keep
    trust_checkpoint: bool = False  # run.trust_checkpoint: its pickles may name more than data


class StrategyBase:
    """Mixin for the Lightning strategies the plugins build: inputs, moves, sampler binding."""

    inputs: StrategyInputs

    def __init__(self, *args: Any, inputs: StrategyInputs, **kwargs: Any) -> None:
        self.inputs = inputs
        super().__init__(*args, **kwargs)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        """Lightning's checkpoint without its model and optimizer states (loops, callbacks,
        schedulers), after `restore` has read this rank's part of those from the checkpoint
        directory holding `checkpoint_path`, whatever layout wrote it."""
        from framework.checkpoint import formats

        self.checkpoint_dir = Path(checkpoint_path).parent  # a strategy's own files beside it
        source = formats.open_checkpoint(self.checkpoint_dir, self.inputs.trust_checkpoint)
        try:
            rest = source.rest()
            self.restore(source)
        except BaseException:
            source.close()
            raise
        # Lightning asks for these keys before it restores optimizers and schedulers
        rest.setdefault("optimizer_states", [])
        rest.setdefault("lr_schedulers", [])
        return rest

    def restore(self, source: Source) -> None:
        """Read this rank's part of the model (and of the optimizers, once they exist) from
        `source`, and close it when done (framework/checkpoint/load.py), in phases measured
        with `framework.checkpoint.load.measured(source, *self.report_to(), phase)`."""
        raise NotImplementedError(f"{type(self).__name__} cannot read a checkpoint")

    def report_to(self) -> tuple[Any, int]:
        """(run directory, rank) where the reading of a checkpoint is reported."""
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        run_dir = trainer.default_root_dir if trainer is not None else None
        return run_dir, self.global_rank  # type: ignore[attr-defined]

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
    """Every process holds the whole model and optimizer (ddp, diloco, hogwild): transforms
    applied before Lightning moves and wraps the task; a checkpoint read into the model before
    setup (as Lightning restores a ddp checkpoint), into the optimizers, by parameter name, once
    they exist."""

    def setup(self, trainer: Any) -> None:
        task = self.lightning_module  # type: ignore[attr-defined]
        load_pretrained_whole(task, trainer.default_root_dir, self.global_rank)  # type: ignore[attr-defined]
        self.inputs.transforms.apply(task)
        super().setup(trainer)  # type: ignore[misc]

    def restore(self, source: Source) -> None:
        from framework.checkpoint.load import load_model, measured

        with measured(source, *self.report_to(), "model") as figures:
            figures["held"] = load_model(self.lightning_module, source)  # type: ignore[attr-defined]
        self.__dict__["_source"] = source  # the optimizers exist once the strategy is set up

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing: `restore` has read the model."""

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        from framework.checkpoint.load import load_optimizers, measured

        source = self.__dict__.pop("_source", None)
        if source is None:
            return
        try:
            with measured(source, *self.report_to(), "optimizers") as figures:
                names = self.parameter_names()
                figures["held"] = load_optimizers(self.optimizers, source, names)  # type: ignore[attr-defined]
        finally:
            source.close()


def load_pretrained_whole(task: Any, run_dir: Any, rank: int) -> None:
    """A model built on meta with pretrained weights to read (framework.nn.meta), under a
    strategy whose ranks keep it whole: each tensor read once, straight into its parameter (its
    model family's reader, framework/parallel/model.py), before the strategy moves or wraps it."""
    import torch

    from framework.nn.meta import on_meta
    from framework.parallel.model import adapter_for

    if on_meta(task):
        adapter_for(task).load_pretrained(task, torch.device("cpu"), run_dir, rank)


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
