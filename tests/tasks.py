"""Tasks used by the tests: a digits task that fails on purpose, and a plain LightningModule."""

from __future__ import annotations

import json
import os
import signal
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from recipes.digits.task import DigitsTask
from recipes.gpt.data import TextDataModule


class FailingDigitsTask(DigitsTask):
    """Raises on `fail_rank` at `fail_step`; the other ranks carry on into the next collective."""

    def __init__(self, fail_rank: int = 1, fail_step: int = 3, hidden: int = 32) -> None:
        super().__init__(hidden=hidden)
        self.fail_rank = fail_rank
        self.fail_step = fail_step

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_step and self.global_rank == self.fail_rank:
            raise RuntimeError(f"deliberate failure at step {self.fail_step}")
        if self.global_step > self.fail_step:
            time.sleep(0.05)
        return super().training_step(batch, batch_idx)


class PlainDigits(pl.LightningModule):
    """A LightningModule that knows nothing of the framework: its own configure_optimizers."""

    def __init__(self, hidden: int = 32, lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class SlowDigitsTask(DigitsTask):
    """DigitsTask whose steps take at least `step_sleep` seconds, so a test can kill it mid-run."""

    def __init__(self, hidden: int = 64, dropout: float = 0.1, step_sleep: float = 0.1) -> None:
        super().__init__(hidden=hidden, dropout=dropout)
        self.step_sleep = step_sleep

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_sleep)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        # Validation that draws from the global RNG (as sampling or random crops do): a run
        # resumed at a validated step equals the uninterrupted one only if validation puts the
        # RNG back as it found it (tests/distributed/test_resume.py).
        torch.rand(1)
        return super().validation_step(batch, batch_idx)


class SlowLossDigits(DigitsTask):
    """DigitsTask whose loss takes `loss_sleep` seconds: under pipeline parallel the loss runs on
    the last stage once per microbatch (not training_step), so a test can kill it mid-run."""

    def __init__(self, hidden: int = 64, dropout: float = 0.1, loss_sleep: float = 0.02) -> None:
        super().__init__(hidden=hidden, dropout=dropout)
        self.loss_sleep = loss_sleep

    def loss(self, logits, y):
        time.sleep(self.loss_sleep)
        return super().loss(logits, y)


class KillDuringSave(pl.Callback):
    """SIGKILLs the whole job while the checkpoint of `step` is being written (once: `marker`)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step = step
        self.marker = marker

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_step == self.step and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            # the launcher's process group: `fw` and forked workers (spawned ones die with `fw`)
            os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)


class KillAfterSave(pl.Callback):
    """SIGKILLs the whole job at the end of `step`, after that step's checkpoint was started
    (with async saves: still being written or not yet committed), once (`marker`)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step = step
        self.marker = marker

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)


class KillAfterCommitDigits(SlowDigitsTask):
    """SlowDigitsTask that SIGKILLs the whole job at the first step boundary where a committed
    checkpoint of step `after` or later is in `ckpts` (once: `marker`). A task's hooks run after
    every callback's, so the kill comes right after the commit, before anything else is logged."""

    def __init__(
        self,
        hidden: int = 64,
        dropout: float = 0.1,
        step_sleep: float = 0.1,
        after: int = 1,
        ckpts: str = "",
        marker: str = "",
    ) -> None:
        super().__init__(hidden=hidden, dropout=dropout, step_sleep=step_sleep)
        self.after, self.ckpts, self.marker = after, ckpts, marker

    def _kill_once_committed(self) -> None:
        if self.global_rank != 0 or os.path.exists(self.marker) or not os.path.isdir(self.ckpts):
            return
        committed = [n for n in os.listdir(self.ckpts) if n.startswith("step") and "." not in n]
        if any(int(n[4:]) >= self.after for n in committed):
            open(self.marker, "w").close()
            os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._kill_once_committed()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._kill_once_committed()


class IndexedDigits(pl.LightningDataModule):
    """Digits whose batches also carry each sample's index, to check which samples were seen."""

    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage=None) -> None:
        from recipes.digits.data import DigitsDataModule

        inner = DigitsDataModule(batch_size=self.batch_size)
        inner.setup()
        x, y = inner.train_set.tensors
        self.train_set = torch.utils.data.TensorDataset(x, y, torch.arange(len(x)))

    def train_dataloader(self):
        from framework.data import make_loader

        return make_loader(self.train_set, self.batch_size, shuffle=True)


class RecordingDigitsTask(DigitsTask):
    """Appends the sample indices of every completed step to `<out>/seen-rank<R>.txt`."""

    def __init__(self, out: str, hidden: int = 16) -> None:
        super().__init__(hidden=hidden)
        self.out = out

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self._idx = idx
        return super().training_step((x, y), batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        path = os.path.join(self.out, f"seen-rank{self.global_rank}.txt")
        with open(path, "a") as fh:
            fh.write(" ".join(str(i) for i in self._idx.tolist()) + "\n")


class TokenDigits(PlainDigits):
    """A task that takes a secret (an API token) and saves its hyperparameters, as most
    Lightning modules do; it fails if it is handed the redacted value instead of the real one."""

    def __init__(self, hidden: int = 32, lr: float = 0.01, api_token: str = "") -> None:
        super().__init__(hidden=hidden, lr=lr)
        self.save_hyperparameters()
        if api_token == "***":
            raise ValueError("the task was given the redacted token, not the real one")


class ShardCounter(pl.Callback):
    """Writes, per rank, how many elements of parameters, gradients and optimizer state it holds.

    Read from the tensors at the second step: gradients just before the optimizer step (DeepSpeed
    keeps this rank's reduced partition in `averaged_gradients` and frees it after the step),
    parameters and optimizer state after it. A ZeRO-3 parameter's local part is its `ds_tensor`,
    an FSDP2 one's its DTensor's local shard; the optimizer state is that of the torch optimizer
    (wrapped by DeepSpeed), which only ever sees this rank's partition.
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self.grads = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step != 1:
            return
        averaged = getattr(optimizer, "averaged_gradients", None)
        if averaged is not None:
            self.grads = sum(t.numel() for ts in averaged.values() for t in ts)
        else:
            self.grads = sum(_local(p.grad) for p in pl_module.parameters() if p.grad is not None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != 2:
            return
        import json

        params = list(pl_module.parameters())
        local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else _local(p) for p in params)
        optimizer = trainer.optimizers[0]
        inner = getattr(optimizer, "optimizer", optimizer)
        tensors = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
        state = sum(_local(t) for t in tensors if t.dim() > 0)
        full = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params)
        counts = {"full": full, "params": local, "grads": self.grads, "optimizer": state}
        with open(os.path.join(self.out, f"shards-rank{trainer.global_rank}.json"), "w") as fh:
            json.dump(counts, fh)


def _local(t) -> int:
    """Elements of a tensor held by this process (a DTensor's local shard)."""
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


class TransformProbe(pl.Callback):
    """Writes, per rank, what the model transforms did at the second step: how many times the
    first block's first norm ran in that step (2 with activation checkpointing: forward and the
    recompute in backward), how many graphs torch.compile built, and which classes FSDP2 made
    sharding units (its module classes are named FSDP<class>)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.calls = 0
        self.counting = False

    def setup(self, trainer, pl_module, stage) -> None:
        # before the strategy compiles or wraps the blocks, so the hook is part of them; run
        # eagerly (not traced), so compiled code does not specialise on the counter
        block = next(m for m in pl_module.modules() if type(m).__name__ == "TransformerBlock")
        block.ln1.register_forward_pre_hook(torch._dynamo.disable(self._count))

    def _count(self, module, args) -> None:
        if self.counting:
            self.calls += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.counting = trainer.global_step == 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.counting:
            return
        self.counting = False
        import json

        from torch._dynamo.utils import counters

        units = sorted(
            type(m).__name__.removeprefix("FSDP")
            for m in pl_module.modules()
            if type(m).__name__.startswith("FSDP")
        )
        probe = {
            "norm_calls": self.calls,
            "graphs": counters["stats"]["unique_graphs"],
            "fsdp_units": units,
        }
        with open(os.path.join(self.out, f"probe-rank{trainer.global_rank}.json"), "w") as fh:
            json.dump(probe, fh)


class PlainDigitsData(pl.LightningDataModule):
    """A data module written the way Lightning's docs teach: its own DataLoader(shuffle=True),
    nothing from the framework."""

    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
        self.batch_size = batch_size

    def setup(self, stage=None) -> None:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32) / 16.0
        self.train_set = torch.utils.data.TensorDataset(x, torch.tensor(y))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class SlowLoadingDigits(pl.LightningDataModule):
    """Digits whose every sample takes `sample_sleep` seconds to load: a loader that starves the
    step."""

    def __init__(self, batch_size: int = 32, sample_sleep: float = 0.002) -> None:
        super().__init__()
        self.batch_size, self.sample_sleep = batch_size, sample_sleep

    def setup(self, stage=None) -> None:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        sleep = self.sample_sleep

        class Slow(torch.utils.data.TensorDataset):
            def __getitem__(self, i):
                time.sleep(sleep)
                return super().__getitem__(i)

        self.train_set = Slow(torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y))

    def train_dataloader(self):
        from framework.data import make_loader

        return make_loader(self.train_set, self.batch_size, shuffle=True)


class SlowPlainDigits(PlainDigits):
    """PlainDigits whose steps take `step_sleep` seconds, so a test can kill it mid-run."""

    def __init__(self, hidden: int = 32, lr: float = 0.01, step_sleep: float = 0.05) -> None:
        super().__init__(hidden=hidden, lr=lr)
        self.step_sleep = step_sleep

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_sleep)
        return super().training_step(batch, batch_idx)


class PlainTwoLayer(pl.LightningModule):
    """A plain module whose layers are attributes called in forward: no shape the framework can
    split automatically, and no plan."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LocalShapes(pl.Callback):
    """Writes each rank's local shape of every parameter (a DTensor's shard) at the end."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        import json

        shapes = {
            n: list(p.to_local().shape if hasattr(p, "to_local") else p.shape)
            for n, p in pl_module.named_parameters()
        }
        with open(os.path.join(self.out, f"shapes-rank{trainer.global_rank}.json"), "w") as fh:
            json.dump(shapes, fh)


class EngineInputs(pl.Callback):
    """Writes, per rank, what DeepSpeed's engine is handed as its model (DeepSpeed's own entry,
    `DeepSpeedEngine._configure_distributed_model`, wrapped when the job sets up): the bytes of
    parameter data the rank holds whole at that moment, which the engine would cast to low
    precision and move to the device whole, and whether every parameter is a ZeRO-3 partition
    already (then DeepSpeed does neither)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def setup(self, trainer, pl_module, stage) -> None:
        import json

        from deepspeed.runtime.engine import DeepSpeedEngine

        configure = DeepSpeedEngine._configure_distributed_model
        path = os.path.join(self.out, f"engine-rank{trainer.global_rank}.json")

        def recorded(engine, model):
            params = list(model.parameters())
            with open(path, "w") as fh:
                json.dump(
                    {
                        "whole_bytes": sum(p.data.numel() * p.data.element_size() for p in params),
                        "partitioned": all(hasattr(p, "ds_id") for p in params),
                    },
                    fh,
                )
            return configure(engine, model)

        DeepSpeedEngine._configure_distributed_model = recorded


class EvenFirstSampler(torch.utils.data.Sampler):
    """A custom sampler: even indices, then odd ones."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter([*range(0, self.n, 2), *range(1, self.n, 2)])

    def __len__(self) -> int:
        return self.n


class CustomSamplerDigits(PlainDigitsData):
    """PlainDigitsData with a custom sampler (its position cannot be saved)."""

    def train_dataloader(self):
        sampler = EvenFirstSampler(len(self.train_set))
        return torch.utils.data.DataLoader(
            self.train_set, batch_size=self.batch_size, sampler=sampler
        )


class ExpertGradNorms(pl.Callback):
    """Writes the norm of every expert weight's whole gradient at step 1, just before the
    optimizer step (after the strategy's gradient work), to `out`/expert-grads.json (rank 0)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step != 1:
            return
        import json

        norms = {}
        for name, p in pl_module.named_parameters():
            if ".experts.w" in name and p.grad is not None:
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                norms[name] = float(grad.norm())
        if trainer.global_rank == 0:
            with open(os.path.join(self.out, "expert-grads.json"), "w") as fh:
                json.dump(norms, fh)


class StepGrads(pl.Callback):
    """Saves the whole gradient of every parameter whose name contains `match` at step 1, just
    before the optimizer step (after the strategy's gradient work), to
    <run dir>/grads-rank{r}.pt: each rank the parameters it holds (its stage's, under a
    pipeline)."""

    def __init__(self, match: str = ".attn.") -> None:
        self.match = match

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step != 1:
            return
        grads = {}
        for name, p in pl_module.named_parameters():
            if self.match in name and p.grad is not None:
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name] = grad.detach().cpu()
        out = os.path.join(trainer.default_root_dir, f"grads-rank{trainer.global_rank}.pt")
        torch.save(grads, out)


class SequenceShare(pl.Callback):
    """Writes <run dir>/sequence-rank{r}.json at the first training step: the position ids this
    rank's model embeds (every distinct row handed to the gpt recipe's position embedding `pos`
    or to a transformers model's rotary embedding) and, per block (a module whose class name
    ends in TransformerBlock or DecoderLayer), how many positions of each sequence it hands on
    (its output's dimension 1). Under context parallel: this rank's chunks only, not the whole
    sequence. Hooked for that step alone (a pipeline's timing of layers at setup and the
    sanity validation run before it)."""

    def __init__(self) -> None:
        self.handles: list = []
        self.seen: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != 0 or self.handles:
            return
        self.seen = {"positions": [], "blocks": {}}
        for name, module in pl_module.named_modules():
            kind = type(module).__name__
            if kind.endswith(("TransformerBlock", "DecoderLayer")):
                self.handles.append(module.register_forward_hook(self._block(name)))
            elif name.rsplit(".", 1)[-1] == "pos" or kind.endswith("RotaryEmbedding"):
                hook = module.register_forward_pre_hook(self._positions, with_kwargs=True)
                self.handles.append(hook)

    def _block(self, name: str):
        def hook(module, args, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            self.seen["blocks"].setdefault(name, hidden.shape[1])

        return hook

    def _positions(self, module, args, kwargs) -> None:
        # nn.Embedding(positions); a rotary embedding's (x, position_ids)
        ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        ids = args[0] if ids is None else ids
        for row in ids.reshape(-1, ids.shape[-1]).tolist():
            if row not in self.seen["positions"]:
                self.seen["positions"].append(row)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.handles:
            return
        for handle in self.handles:
            handle.remove()
        self.handles = []
        out = os.path.join(trainer.default_root_dir, f"sequence-rank{trainer.global_rank}.json")
        with open(out, "w") as fh:
            json.dump(self.seen, fh)


class SharedMemoryModes(pl.Callback):
    """Writes <run dir>/shm-rank{r}.json at the start of training: the name and permission bits
    of every file of strategy=hogwild's shared memory this process maps (its name is removed
    once mapped; the kernel still shows the file through /proc/self/map_files)."""

    def on_train_start(self, trainer, pl_module) -> None:
        found = {}
        with open("/proc/self/maps") as fh:
            for line in fh:
                if "/fw-hogwild-" in line:
                    span, name = line.split()[0], line.split(None, 5)[5].strip()
                    mode = os.stat(f"/proc/self/map_files/{span}").st_mode & 0o7777
                    found[name] = oct(mode)
        out = os.path.join(trainer.default_root_dir, f"shm-rank{trainer.global_rank}.json")
        with open(out, "w") as fh:
            json.dump(found, fh)


def assert_sequence_share(run, ranks: int, length: int, cp: int) -> None:
    """Every rank of a run with `SequenceShare` held 2 of the 2 x cp equal chunks of each
    sequence of `length`, chunks r and 2cp-1-r, in every block it ran and in the positions it
    embedded (where it embedded any: a pipeline's first stage), and each r was held by
    ranks / cp ranks (the cp ranks of a group split the sequence between them)."""
    n = length // (2 * cp)
    chunks = {
        r: [*range(r * n, (r + 1) * n), *range((2 * cp - 1 - r) * n, (2 * cp - r) * n)]
        for r in range(cp)
    }
    held, embedded = [], 0
    for rank in range(ranks):
        with open(os.path.join(run, f"sequence-rank{rank}.json")) as fh:
            seen = json.load(fh)
        assert seen["blocks"] and set(seen["blocks"].values()) == {2 * n}, (rank, seen)
        if seen["positions"]:
            embedded += 1
            assert len(seen["positions"]) == 1, (rank, seen["positions"])
            mine = [r for r, c in chunks.items() if c == seen["positions"][0]]
            assert mine, f"rank {rank} embedded positions {seen['positions'][0]}, not 2 chunks"
            held += mine
    assert embedded, "no rank embedded positions"
    assert sorted(held) == sorted(list(range(cp)) * (embedded // cp)), held


class PromptMaskedText(TextDataModule):
    """The gpt recipe's data with the first quarter of every target block ignored (-100), like
    a prompt not trained on: under context parallel the chunks then hold different numbers of
    targets (cp = 2: rank 0 half as many as rank 1), every sequence the same number."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        self.train_set, self.val_set = PromptMasked(self.train_set), PromptMasked(self.val_set)


class PromptMasked(torch.utils.data.Dataset):
    def __init__(self, blocks) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int):
        x, y = self.blocks[i]
        y = y.clone()
        y[: len(y) // 4] = -100
        return x, y


class HangingDigitsTask(DigitsTask):
    """Rank `hang_rank` blocks at `hang_step` (the others then wait in the next collective);
    every rank writes its pid to `out/pid-rank{r}` and the restart counters it sees to
    `out/start{N}-rank{r}.json`, and the hanging rank the time it stopped to `out/hung`."""

    def __init__(self, out: str, hang_rank: int = 1, hang_step: int = 3, hidden: int = 32) -> None:
        super().__init__(hidden=hidden)
        self.out, self.hang_rank, self.hang_step = out, hang_rank, hang_step

    def on_train_start(self) -> None:
        with open(os.path.join(self.out, f"pid-rank{self.global_rank}"), "w") as fh:
            fh.write(str(os.getpid()))
        # which start of the job this is, as the worker's code sees it
        seen = {k: os.environ.get(k) for k in ("FW_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")}
        name = f"start{seen['FW_RESTART_COUNT']}-rank{self.global_rank}.json"
        with open(os.path.join(self.out, name), "w") as fh:
            json.dump(seen, fh)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.hang_step and self.global_rank == self.hang_rank:
            with open(os.path.join(self.out, "hung"), "w") as fh:
                fh.write(str(time.time()))
            time.sleep(3600)
        return super().training_step(batch, batch_idx)


class SlowSaveDigitsTask(DigitsTask):
    """Every checkpoint save takes `save_sleep` seconds more (inside the save, on every rank)."""

    def __init__(self, save_sleep: float = 5.0, hidden: int = 32) -> None:
        super().__init__(hidden=hidden)
        self.save_sleep = save_sleep

    def on_save_checkpoint(self, checkpoint) -> None:
        time.sleep(self.save_sleep)


class StragglerDigitsTask(DigitsTask):
    """Rank `slow_rank` computes (busy-waits) `step_sleep` CPU seconds more in every training
    step. CPU time, not wall time: on a busy machine a wall-clock busy-wait gets a share of a core
    only, and the CPU time is what the stragglers callback measures on the CPU."""

    def __init__(self, slow_rank: int = 1, step_sleep: float = 0.05, hidden: int = 32) -> None:
        super().__init__(hidden=hidden)
        self.slow_rank, self.step_sleep = slow_rank, step_sleep

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.slow_rank:
            end = time.thread_time() + self.step_sleep
            while time.thread_time() < end:
                pass
        return super().training_step(batch, batch_idx)


class ParametersAtTrainEnd(pl.Callback):
    """Every rank writes the parameters as it sees them when training ends to
    `out`/params-rank{r}.pt."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        seen = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        torch.save(seen, os.path.join(self.out, f"params-rank{trainer.global_rank}.pt"))


class StepCollectives(pl.Callback):
    """Counts the collectives called through torch.distributed on each rank in training steps
    `first`..`last` and before each of them (blocking or not, by name), and each step's local
    loss; writes them to <run dir>/collectives-rank<R>.json at the end of training."""

    NAMES = ("barrier", "broadcast", "all_reduce", "all_gather", "all_gather_object")

    def __init__(self, first: int = 2, last: int = 6) -> None:
        self.first, self.last = first, last
        self.counting = False
        self.counts: dict[str, int] = {}
        self.losses: dict[int, float] = {}
        dist = torch.distributed
        for name in self.NAMES:
            original = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                if self.counting:
                    key = f"{_name} (async)" if kwargs.get("async_op") else _name
                    self.counts[key] = self.counts.get(key, 0) + 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counting = self.first <= trainer.global_step <= self.last

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.counting:
            self.losses[trainer.global_step] = float(outputs["loss"])
        # on from here: what Lightning runs between two steps counts for the next one
        self.counting = self.first <= trainer.global_step <= self.last

    def on_train_end(self, trainer, pl_module):
        out = {"steps": self.last - self.first + 1, "counts": self.counts, "losses": self.losses}
        path = f"{trainer.default_root_dir}/collectives-rank{trainer.global_rank}.json"
        with open(path, "w") as f:
            json.dump(out, f)


class RecordNcclRules(pl.Callback):
    """Records what every rank asks of the communication library during the training step
    `step` (framework.parallel.nccl_rules: collectives, point-to-point ops, tensors made without
    a device, gloo groups) and writes, on rank 0, <run dir>/nccl-rules.json: the ops seen and
    the violations of NCCL's rules found over all ranks."""

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self.recorder = None
        self.recorded = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self.recorder is None:
            from framework.parallel.nccl_rules import NcclRecorder

            self.recorder = NcclRecorder()
            self.recorder.step = self.step
            self.recorder.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.recorder is not None and self.recorded is None:
            self.recorder.__exit__(None, None, None)
            self.recorded = self.recorder.record

    def on_train_end(self, trainer, pl_module) -> None:
        import json

        import torch.distributed as dist

        from framework.parallel.nccl_rules import violations

        records = [None] * trainer.world_size
        dist.all_gather_object(records, self.recorded)
        if trainer.global_rank == 0:
            ops = sorted({e.op for r in records for e in r.events})
            found = violations(dict(enumerate(records)))
            out = os.path.join(trainer.default_root_dir, "nccl-rules.json")
            with open(out, "w") as f:
                json.dump({"ops": ops, "violations": found}, f, indent=1)


class CpuGradScaler(pl.Callback):
    """The training step as a GPU runs `trainer.precision=16-mixed`, on the CPU: Lightning's
    MixedPrecision plugin around `torch.amp.GradScaler("cpu")` replaces the strategy's precision
    plugin at setup (on the CPU Lightning turns 16-mixed into bf16-mixed, which needs no
    scaler). `autocast`: fp16 autocast of the forward (the CPU runs fp16 matmuls), else the
    scaler alone on fp32; `overflow_steps`: an inf planted in a gradient after the backward at
    those global steps, as an fp16 overflow leaves it. Every step's scale before and after is
    written to <run dir>/scales-rank{r}.json at the end, with whether the weights are finite."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        autocast: bool = True,
        overflow_steps: tuple[int, ...] = (),
    ) -> None:
        self.init_scale, self.growth_interval = init_scale, growth_interval
        self.autocast, self.overflow_steps = autocast, set(overflow_steps)
        self.scales: list[tuple[int, float, float]] = []  # (step, scale before, after)
        self.grad_norms: list[float] = []  # at on_before_optimizer_step (unscaled by then)
        self.before = None

    def setup(self, trainer, pl_module, stage) -> None:
        import contextlib

        from lightning.pytorch.plugins.precision import MixedPrecision

        scaler = torch.amp.GradScaler(
            "cpu", init_scale=self.init_scale, growth_interval=self.growth_interval
        )
        plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
        if not self.autocast:
            plugin.forward_context = contextlib.nullcontext
        trainer.strategy.precision_plugin = plugin

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step in self.overflow_steps:
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            grad.view(-1)[0] = float("inf")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad.flatten() for p in pl_module.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.cat(grads).norm()) if grads else float("nan"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before = (trainer.global_step, trainer.precision_plugin.scaler.get_scale())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.scales.append((*self.before, trainer.precision_plugin.scaler.get_scale()))

    def on_train_end(self, trainer, pl_module) -> None:
        finite = all(bool(torch.isfinite(p).all()) for p in pl_module.parameters())
        out = os.path.join(trainer.default_root_dir, f"scales-rank{trainer.global_rank}.json")
        with open(out, "w") as f:
            json.dump(
                {"scales": self.scales, "grad_norms": self.grad_norms, "weights_finite": finite}, f
            )
