"""A slow network link between the training processes, simulated inside each process (added to
`fw train` from the command line by `benchmarks/async.py`; never part of the framework).

Before a message crosses the link, the process that sends it sleeps `latency + bytes / bandwidth`,
then the real (gloo, loopback) collective runs. Both processes sleep the same time before the same
collective, so they stay in step. An all-reduce of a b-byte payload between 2 processes is one
message of b bytes (a ring all-reduce sends 2b(N-1)/N = b bytes per process for N = 2, over a
full-duplex link) and one latency.

This machine cannot shape the loopback instead (`tc qdisc add dev lo root netem ...` answers
"Specified qdisc kind is unknown": the kernel has no netem), so the delay is added in the path
that synchronises the model (`SYNC_PATHS`): ddp's gradient buckets, through a DDP communication
hook; diloco's pseudo-gradient all-reduce, by wrapping `Rounds.sync`; hogwild has none (its
workers share the parameters in memory). With `scope="all"`, every torch.distributed collective
issued during a training batch is delayed too (e.g. the gpt recipe's `sync_dist` all-reduce of the
training loss at every step).
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

# The torch.distributed functions delayed while the link is open, and which argument each sends.
SENT_ARGUMENT = {
    "all_reduce": 0,
    "broadcast": 0,
    "send": 0,
    "isend": 0,
    "all_gather_into_tensor": 1,
    "reduce_scatter_tensor": 1,
    "all_to_all_single": 1,
}


class SlowLink(pl.Callback):
    """Delays the collectives that synchronise the model as a link of `latency_ms` and `mbit`
    Mbit/s would; writes the messages, bytes and seconds it added to `path` ("RANK": the rank)."""

    def __init__(self, path: str, latency_ms: float, mbit: float, scope: str = "sync") -> None:
        if scope not in ("sync", "all"):
            raise ValueError(f"SlowLink scope={scope!r}: expected 'sync' or 'all'")
        self.path = Path(path)
        self.latency_s = latency_ms / 1e3
        self.bytes_per_s = mbit * 1e6 / 8
        self.scope = scope
        self.open = 0  # > 0: the patched torch.distributed functions cross the link
        self.messages = 0
        self.bytes = 0
        self.delay_s = 0.0
        self.steps = 0
        self.originals: dict[str, Callable] = {}

    # ---- the link
    def cross(self, payload: int) -> None:
        """One message of `payload` bytes: sleep as long as the link would take to carry it."""
        seconds = self.latency_s + payload / self.bytes_per_s
        time.sleep(seconds)
        self.messages += 1
        self.bytes += payload
        self.delay_s += seconds

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1

    def patch_collectives(self) -> None:
        for name, index in SENT_ARGUMENT.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self.originals[name] = original
            setattr(dist, name, self.delayed(original, index))

    def delayed(self, original: Callable, index: int) -> Callable:
        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            sent = args[index] if len(args) > index else None
            if self.open and isinstance(sent, torch.Tensor):
                self.cross(sent.numel() * sent.element_size())
            return original(*args, **kwargs)

        return collective

    # ---- Lightning hooks
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the strategy's setup: the DDP wrapper and diloco's rounds exist
        self.patch_collectives()
        for applies, install in SYNC_PATHS:
            if applies(trainer.strategy):
                install(self, trainer.strategy)
                return
        raise RuntimeError(
            f"SlowLink: no known sync path for {type(trainer.strategy).__name__}; "
            "add one to benchmarks.slow_link.SYNC_PATHS"
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.scope == "all":
            self.open += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.scope == "all":
            self.open -= 1
        self.steps += 1

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)
        record = {
            "messages": self.messages,
            "bytes": self.bytes,
            "delay_s": self.delay_s,
            "steps": self.steps,
            "latency_ms": self.latency_s * 1e3,
            "mbit": self.bytes_per_s * 8 / 1e6,
            "scope": self.scope,
        }
        name = self.path.name.replace("RANK", str(trainer.global_rank))
        self.path.with_name(name).write_text(json.dumps(record))


# ---- where each strategy synchronises the model
def is_ddp(strategy: Any) -> bool:
    return isinstance(getattr(strategy, "model", None), DistributedDataParallel)


def delay_ddp(link: SlowLink, strategy: Any) -> None:
    """A communication hook: each gradient bucket crosses the link, then is averaged. The hook
    runs when its bucket is ready, in backward; here all gradients fit in one bucket."""
    all_reduce = link.originals.get("all_reduce", dist.all_reduce)

    def hook(state, bucket):  # unannotated: DDP checks the annotations' objects, not strings
        tensor = bucket.buffer()
        link.cross(tensor.numel() * tensor.element_size())
        tensor.div_(dist.get_world_size())
        work = all_reduce(tensor, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    strategy.model.register_comm_hook(None, hook)


def is_diloco(strategy: Any) -> bool:
    return getattr(strategy, "rounds", None) is not None


def delay_diloco(link: SlowLink, strategy: Any) -> None:
    """The link is open while a round ends: its all-reduces (pseudo-gradient, buffers) cross it."""
    rounds = strategy.rounds
    sync = rounds.sync

    @functools.wraps(sync)
    def delayed_sync(*args: Any, **kwargs: Any) -> Any:
        with link.opened():
            return sync(*args, **kwargs)

    rounds.sync = delayed_sync


def is_hogwild(strategy: Any) -> bool:
    return type(strategy).__module__.startswith("framework.strategies.hogwild")


def nothing_crosses(link: SlowLink, strategy: Any) -> None:
    """hogwild's workers write into parameters shared in one machine's memory: no message
    carries the model, so there is nothing to delay (nor could it run across a link)."""


# (does it apply to this Lightning strategy?, install the delay): the first that applies is used
SYNC_PATHS: list[tuple[Callable[[Any], bool], Callable[[SlowLink, Any], None]]] = [
    (is_ddp, delay_ddp),
    (is_diloco, delay_diloco),
    (is_hogwild, nothing_crosses),
]
