"""The torchft step of `strategy.fault_tolerance=torchft` (imports torchft: workers only), mixed in
front of the Lightning strategy that syncs a group inside (framework/strategies/ddp/
replica_groups.py: none or DDP; framework/strategies/parallel/ft.py: FSDP2).

This process is one replica group, or one of its processes (framework/replica_groups). Each
process has a torchft `Manager` (the group's rank 0 serves the group's: its processes share the
quorum), which owns the step, in the order torchft's own DDP and optimizer wrappers give it:

- a quorum of the live groups is asked of the lighthouse before each optimizer step's first
  batch reaches the task (before any callback logs for it), and waited for: a group that joins
  behind the others is healed then (below), so that it trains, and logs, that batch at the
  step and with the weights and learning rate of the others;
- after the backward (and DDP's average, or FSDP2's reduce-scatter, inside a group of several
  processes) and, under `16-mixed`, after the loss scaler's `unscale_` (groups' scales may
  differ: a healed group's starts where its peer's was), the gradients (under FSDP2: this
  process's shards of them), flattened into one buffer per dtype, are averaged over the groups
  of the quorum by the Manager's all-reduce, each process with the processes of the same rank
  in the other groups (on torchft's own process group, which it rebuilds whenever the quorum
  changes), before any callback or clipping looks at them; an overflow in any group's
  gradients makes every group's scaler skip the step;
- the optimizer steps only when the step's all-reduce went through (`should_commit`): a step
  during which a group died is dropped, and the survivors go on with their next batch, no
  process restarted, no checkpoint read (a group that committed it while another did not is
  ahead by one step: the other heals from it at the next quorum);
- a group that (re)joins behind the others is sent the model, optimizer, scheduler and loss
  scaler states and the step by a live peer (the Manager's state_dict callbacks, over HTTP:
  framework/replica_groups/heal.py, which reads them as data only), and steps with them from
  there.

Lightning's step counter follows the Manager's committed step, so that every group logs the
same step numbers, each once, and stops at the same `trainer.max_steps`. A dropped step's batch
is not trained; a rejoined group reads its shard of the data from the start of the epoch.

The quorum is waited for (torchft's `use_async_quorum=False`) rather than overlapped with the
forward pass: only then is a joining group's step known, and its state loaded, before the
callbacks of its first batch log (an overlapped quorum logged that batch's learning rate at
step 0, before the heal).
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from framework.replica_groups import claim_gpu, lighthouse_url
from framework.world import address_of

log = logging.getLogger("framework.torchft")


class _Dropped(Exception):
    """The quorum did not commit this step: the optimizer must not step."""


class ReplicaSteps:
    """The torchft step of one process of a replica group, mixed in front of the Lightning
    strategy that syncs the group inside (none for a group of one process, DDP for several)."""

    def __init__(self, cfg: Any, *args: Any, **kwargs: Any) -> None:
        self.cfg = cfg
        self.manager: Any = None
        self._store: Any = None
        self._groups = 0  # replica groups in the last quorum, for the log
        self._quorum = False  # asked for the optimizer step under way
        self._undo: list[tuple[Any, dict]] = []  # schedulers as before a dropped step
        self._gpu_claim: Any = None  # on CUDA: this machine's claim on the GPU (claim_gpu)
        super().__init__(*args, **kwargs)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            if not self.lightning_module.automatic_optimization:
                raise RuntimeError(
                    "strategy.fault_tolerance=torchft steps the optimizer itself: a task with "
                    "automatic_optimization=False cannot run under it"
                )
            self.manager = self._start_manager()

    def _start_manager(self) -> Any:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        from framework.replica_groups.heal import HealTransport

        cfg = self.cfg
        timeout = timedelta(seconds=cfg.fault_timeout_s)
        host, port = self._group_store()
        cuda = self.root_device.type == "cuda"
        if cuda:  # another group's process on this GPU is refused now, not at every step
            uuid = torch.cuda.get_device_properties(self.root_device).uuid
            where = (
                f"replica group {cfg.replica_group}'s rank {self.global_rank} (pid {os.getpid()})"
            )
            self._gpu_claim = claim_gpu(str(uuid), where)
        pg = ProcessGroupNCCL(timeout=timeout) if cuda else ProcessGroupGloo(timeout=timeout)
        manager = Manager(
            pg=pg,
            load_state_dict=self._load_state,
            state_dict=self._state,
            # a heal reads only data, and serves on the address other groups reach this one at
            checkpoint_transport=HealTransport(timeout, address_of(socket.gethostname())),
            min_replica_size=cfg.min_replicas,
            use_async_quorum=False,  # the step and a heal known before the batch's callbacks
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=self.global_rank,  # within the group: its processes share the quorum
            world_size=self.world_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=lighthouse_url(cfg.lighthouse),
            replica_id=f"fw_group{cfg.replica_group}",
            hostname=host,
        )
        log.info(
            "torchft: replica group %d of %d joins the lighthouse at %s",
            cfg.replica_group,
            cfg.replica_groups,
            cfg.lighthouse,
        )
        return manager

    def _group_store(self) -> tuple[str, int]:
        """The address of a store the group's rank 0 serves: its processes find its Manager
        server there, and torchft's process groups meet in the quorum leader's."""
        from torch.distributed import TCPStore

        address = [None]
        if self.global_rank == 0:
            host = socket.gethostname()  # where the other groups reach this one
            self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
            address = [(host, self._store.port)]
        if self.world_size > 1:
            torch.distributed.broadcast_object_list(address, src=0)
        return address[0]

    def on_train_start(self) -> None:
        super().on_train_start()
        if self.manager is not None:  # a resumed run's step is the Manager's step
            step = self.lightning_module.trainer.global_step
            self.manager.load_state_dict({"step": step, "batches_committed": 0})

    # ---- the step, as torchft's Manager orders it
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        manager = self.manager
        if manager is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        plugin = self.precision_plugin
        after_closure = plugin._after_closure

        # the average and the commit vote between the backward and the callbacks' and clipping's
        # look at the gradients, after the loss scaler's unscale_ (16-mixed): the only point
        # Lightning's precision plugins have there is their `_after_closure`, for this step
        def average_then_after_closure(module: Any, stepped: Any) -> None:
            self._average_gradients()
            scaler = loss_scaler(plugin)
            if scaler is not None:
                agree_on_overflow(scaler, stepped, self.lightning_module)
            if not manager.should_commit():  # before the optimizer touches anything
                raise _Dropped
            after_closure(module, stepped)

        plugin._after_closure = average_then_after_closure
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        except _Dropped:  # Lightning steps the schedulers after the batch all the same
            scaler = loss_scaler(plugin)
            if scaler is not None:  # unscaled but not stepped: ready for the next, scale kept
                scaler.update(new_scale=scaler.get_scale())
            trainer = self.lightning_module.trainer
            self._undo = [
                (c.scheduler, c.scheduler.state_dict())
                for c in trainer.lr_scheduler_configs
                if c.interval == "step"
            ]
            log.warning(
                "torchft: step %d not committed (a replica group failed during it): the "
                "optimizer did not step, the next batch trains it",
                manager.current_step(),
            )
            return None
        finally:
            plugin.__dict__.pop("_after_closure", None)
            self._quorum = False
            self._follow_manager(manager.current_step())

    def _average_gradients(self) -> None:
        """The mean of the gradients over the quorum's groups, in one all-reduce per dtype. A
        parameter with no gradient counts as zeros (as DDP's), so every group sends the same
        sizes. A sharded gradient (a DTensor) sends this process's shard: the process of the
        same rank in every group holds the same one."""
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            grad = local(p.grad)
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.manager.allreduce(flat).wait()  # an error is recorded: should_commit says no
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        groups = self.manager.num_participants()
        if groups != self._groups:
            log.info(
                "torchft: %d replica group(s) step together from step %d",
                groups,
                self.manager.current_step(),
            )
            self._groups = groups
        self.lightning_module.log(
            "torchft/replica_groups", float(groups), on_step=True, on_epoch=False
        )

    def _follow_manager(self, committed: int) -> None:
        """Lightning's optimizer step counter set to the Manager's, `committed` steps done,
        before Lightning adds one: the global step ends at `committed`, also after a dropped
        step."""
        loop = self.lightning_module.trainer.fit_loop.epoch_loop
        steps = loop.automatic_optimization.optim_progress.optimizer.step.total
        steps.ready, steps.completed = committed, committed - 1

    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        trainer = self.lightning_module.trainer
        if self.manager is not None and trainer.training and not self._quorum:
            self._start_step()
        return super().batch_to_device(batch, device, dataloader_idx)

    def _start_step(self) -> None:
        """The quorum of the optimizer step this batch begins (a heal applied), and Lightning's
        step counters at the Manager's step, before any callback logs for the batch: a joining
        group's first batch logs at the step it trains, and a dropped step is trained again by
        the next batch, at its index and learning rate, and logged again in its row."""
        for scheduler, saved in self._undo:  # the dropped step's schedule step taken back
            scheduler.load_state_dict(saved)
            lrs = scheduler.get_last_lr()
            for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
        self._undo = []
        self.manager.start_quorum()  # after: a heal brings the peer's schedule
        self._quorum = True
        step = self.manager.current_step()
        loop = self.lightning_module.trainer.fit_loop.epoch_loop
        steps = loop.automatic_optimization.optim_progress.optimizer.step.total
        steps.ready = steps.completed = step
        loop._batches_that_stepped = step

    # ---- healing: what a live group sends one that joins behind it
    def _state(self) -> dict[str, Any]:
        """Sharded tensors as this process's shards: the peer of the same rank holds the same."""
        trainer = self.lightning_module.trainer
        return {
            "model": locals_of(self.lightning_module.state_dict()),
            "optimizers": [locals_of(o.state_dict()) for o in self.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            # 16-mixed: the loss scale and its growth tracker, as the live groups have moved them
            "scaler": self.precision_plugin.state_dict(),
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        trainer = self.lightning_module.trainer
        with torch.no_grad():  # into the tensors (or the shards) in place
            own = self.lightning_module.state_dict()
            for name, tensor in state["model"].items():
                local(own[name]).copy_(tensor)
        for optimizer, saved in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
            reshard_state(optimizer)
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        if state.get("scaler"):
            self.precision_plugin.load_state_dict(state["scaler"])
        log.info(
            "torchft: replica group %d healed from a live peer at step %d (model, optimizer, "
            "scheduler and loss scaler state received; no checkpoint read)",
            self.cfg.replica_group,
            self.manager.current_step(),
        )

    def teardown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        self._store = None
        if self._gpu_claim is not None:
            self._gpu_claim.close()
            self._gpu_claim = None
        super().teardown()


def loss_scaler(plugin: Any) -> Any:
    """The precision plugin's gradient scaler (16-mixed), None without an enabled one."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def agree_on_overflow(scaler: Any, optimizer: Any, module: Any) -> None:
    """After the average every group holds the same gradients, so an overflow in any group's
    is in everyone's (inf or nan); each scaler found only its own group's at `unscale_`. Found
    again here, every group's scaler skips the step and lowers its scale alike (torch's
    GradScaler keeps what `unscale_` found per optimizer, where `step` and `update` read it)."""
    grads = [local(p.grad).detach() for p in module.parameters() if p.grad is not None]
    norms = torch._foreach_norm(grads) if grads else []
    if all(bool(torch.isfinite(n)) for n in norms):
        return
    found = scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device", {})
    for flag in found.values():
        flag.fill_(1.0)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: its shard of a DTensor (the storage itself), else the
    tensor."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def locals_of(state: Any) -> Any:
    """`state` with every DTensor replaced by this process's shard (detached)."""
    return tree_map(lambda v: local(v).detach() if isinstance(v, torch.Tensor) else v, state)


def reshard_state(optimizer: Any) -> None:
    """An optimizer state loaded from shards made DTensors again, each like its parameter
    (a state tensor of the shard's shape; scalars such as Adam's step stay as they are)."""
    for param, state in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in state.items():
            if (
                isinstance(value, torch.Tensor)
                and not isinstance(value, DTensor)
                and value.dim() > 0
                and value.shape == param._local_tensor.shape
            ):
                state[key] = DTensor.from_local(
                    value,
                    param.device_mesh,
                    param.placements,
                    shape=param.shape,
                    stride=param.stride(),
                    run_check=False,
                )
