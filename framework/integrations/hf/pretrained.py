"""Pretrained transformers weights (a local directory of safetensors files) into any layout,
each process reading only its own slices.

A task that starts from a pretrained directory builds its model with the parameters on the meta
device (`parameters_on_meta`: no memory, no weights; buffers are built as usual). Once the
strategy has split the model (tensor plans, FSDP shards, pipeline stages keeping their layers),
`load_pretrained` gives each parameter still on meta its storage on the rank's device and reads
into it exactly the part this rank holds: a DTensor's local shard (its offset and shape in the
whole tensor, as torch's checkpointing computes them), a plain tensor whole. A strategy that keeps
the whole model on every process (ddp, DeepSpeed) loads the same way into plain tensors.

The files are read with plain positional reads (framework/integrations/hf/safetensors_io.py), not through
a memory map: pages of a mapped file count in the process's resident memory, so a rank reading
a column slice would have touched, and held, the whole tensor. Nothing here touches the network.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from framework.checkpoint.load import reads_into
from framework.checkpoint.portable import TensorSpec
from framework.errors import ConfigError
from framework.integrations.hf.safetensors_io import (
    INDEX,
    read_box,
    read_header,
    read_stacked_box,
    weight_map,
)
from framework.memory import bytes_read, peak_rss, reset_peak_rss
from framework.nn.meta import materialize, on_meta

log = logging.getLogger("framework.hf")


def check_directory(key: str, value: str | None) -> None:
    """A pretrained model is a local directory with config.json and safetensors weights; a Hub
    id (or any other name that is not such a directory) is refused: nothing is downloaded."""
    if value is None:
        return
    path = Path(str(value)).expanduser()
    if not path.is_dir():
        hub = "/" in str(value) and not path.is_absolute() and not str(value).startswith(".")
        what = "looks like a Hugging Face Hub id" if hub else "is not a directory"
        raise ConfigError(
            key,
            value,
            f"{what}; no network: give a local directory",
            hint="Download it elsewhere (e.g. `hf download NAME --local-dir DIR`) and give DIR.",
        )
    if not (path / "config.json").is_file():
        raise ConfigError(key, value, "holds no config.json; no network: give a local directory")
    if not (path / INDEX).is_file() and not any(path.glob("*.safetensors")):
        raise ConfigError(
            key,
            value,
            "holds no *.safetensors weights (other formats, e.g. pytorch_model.bin, are not "
            "read); no network: give a local directory",
            hint="Convert the weights with save_pretrained(DIR) (safetensors by default).",
        )


def check_readable(key: str, value: str) -> None:
    """The directory's weights are read under the model's own parameter names, or through the
    conversions transformers declares for the family (`conversions`): a family whose files need
    another conversion is refused here rather than failing in every worker."""
    model_type = json.loads((Path(value).expanduser() / "config.json").read_text()).get(
        "model_type"
    )
    try:
        conversions(model_type)
    except ValueError as err:
        raise ConfigError(
            key,
            value,
            f"holds a '{model_type}' checkpoint, whose weights transformers converts while "
            f"loading in a way not read slice by slice yet ({err})",
            hint="Start such a family from a random init (task.model.arch, task.model.config), "
            "or use a family whose files hold its parameters as they are (llama, qwen2, "
            "qwen3_moe, mixtral, ...).",
        ) from None


@dataclass(frozen=True)
class Conversions:
    """How a family's files name what its model holds, as transformers declares it
    (`conversion_mapping`), reversed: `renames` (model substring -> file substring), and
    `stacked` (model name suffix -> the file name patterns, '*' the expert index, whose tensors,
    stacked over the experts and then concatenated along dim 1, make the model's tensor: the
    per-expert weights that MoE models fuse into one (E, ...) tensor)."""

    renames: tuple[tuple[str, str], ...] = ()
    stacked: tuple[tuple[str, tuple[str, ...]], ...] = ()


def conversions(model_type: str | None) -> Conversions:
    """The family's conversions; ValueError for one this reader does not apply (anything but
    plain renames, and per-expert tensors stacked on dim 0 then concatenated on dim 1)."""
    if not model_type:
        return Conversions()
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    renames, stacked = [], []
    for c in get_checkpoint_conversion_mapping(model_type) or []:
        sources, targets = list(c.source_patterns), list(c.target_patterns)
        ops = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(c, "operations", [])]
        if type(c).__name__ == "WeightRenaming" and len(sources) == len(targets) == 1:
            if not all(ch.isalnum() or ch in "._" for ch in sources[0] + targets[0]):
                raise ValueError(f"a renaming by pattern {sources[0]!r}")
            renames.append((targets[0], sources[0]))
        elif (
            len(targets) == 1
            and all(p.count("*") == 1 for p in sources)
            and (
                ops == [("MergeModulelist", 0)] * (len(sources) == 1)
                or ops == [("MergeModulelist", 0), ("Concatenate", 1)]
            )
        ):
            stacked.append((targets[0], tuple(sources)))
        else:
            raise ValueError(f"{sources} -> {targets} by {[op for op, _ in ops]}")
    return Conversions(tuple(renames), tuple(stacked))


def file_keys(name: str, shape, files: dict[str, str], conv: Conversions) -> str | list | None:
    """The file tensors that hold model tensor `name`: one name when stored as it is (maybe
    renamed), else per part (concatenated on dim 1) the per-expert names (stacked on dim 0);
    None if the files hold none."""
    if name in files:
        return name
    renamed = name
    for model_part, file_part in conv.renames:
        renamed = renamed.replace(model_part, file_part)
    if renamed in files:
        return renamed
    for suffix, patterns in conv.stacked:
        if renamed.endswith(suffix) and shape:
            prefix = renamed[: -len(suffix)]
            parts = [[prefix + p.replace("*", str(e)) for e in range(shape[0])] for p in patterns]
            if all(k in files for part in parts for k in part):
                return parts
    return None


@dataclass
class LoadReport:
    """What one rank read: bytes from the files, bytes it holds, memory and time taken."""

    directory: str
    tensors: int = 0
    bytes_read: int = 0
    local_bytes: int = 0  # this rank's parameters and buffers read (its final shard)
    file_bytes: int = 0  # the weights in the directory's files (the whole model)
    peak_rss_delta: int = 0  # peak resident memory while loading, above where it started
    io_read: int = 0  # bytes the process read through system calls while loading (the kernel's)
    seconds: float = 0.0
    files_opened: list[str] = field(default_factory=list)


class PretrainedSource:
    """A pretrained directory's safetensors as a checkpoint Source (framework/checkpoint/
    portable.py) of one model (`prefix`: its path in the task, named as the task names it): a
    box of any tensor is read from the files by position, through the family's conversions
    (renamed tensors, per-expert tensors stacked)."""

    def __init__(self, model: nn.Module, directory: Path, prefix: str = "") -> None:
        self.directory, self.prefix = directory, f"{prefix}." if prefix else ""
        self.files = weight_map(directory)
        tied = getattr(model, "_tied_weights_keys", None)
        tied = tied if isinstance(tied, dict) else {}
        conv = conversions(getattr(getattr(model, "config", None), "model_type", None))
        self.keys: dict[str, Any] = {}
        self.specs: dict[str, Any] = {}
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
            keys = file_keys(name, tensor.shape, self.files, conv) or file_keys(
                tied.get(name, name), tensor.shape, self.files, conv
            )
            if not keys:
                if isinstance(tensor, nn.Parameter):
                    raise RuntimeError(f"{directory} holds no weight for parameter {name}")
                continue  # a buffer computed by the model (not saved)
            self.keys[self.prefix + name] = keys
            self.specs[self.prefix + name] = TensorSpec(tuple(tensor.shape), tensor.dtype)
        self.opened: dict[str, tuple] = {}
        self.bytes_read = 0

    def model(self) -> dict[str, TensorSpec]:
        return dict(self.specs)

    def optimizers(self) -> list:
        return []

    def rest(self) -> dict[str, Any]:
        return {}

    def entry(self, key: str) -> tuple:
        """(open file, data offset, header entry) of file tensor `key`."""
        file = self.files[key]
        if file not in self.opened:
            fh = open(self.directory / file, "rb")  # noqa: SIM115 - kept open until close()
            self.opened[file] = (fh, *read_header(fh))
        fh, header, base = self.opened[file]
        return fh, base, header[key]

    def read(self, requests: list) -> None:
        for request in requests:
            name = request.key[1]
            keys, spec = self.keys[name], self.specs[name]
            starts = list(request.offset) or [0] * len(spec.shape)
            if isinstance(keys, str):
                fh, base, info = self.entry(keys)
                self.bytes_read += read_box(fh, base, info, keys, starts, request.out)
            else:
                self.bytes_read += read_stacked_box(
                    self.entry, keys, spec.shape, starts, list(request.out.shape), request.out
                )

    def close(self) -> None:
        for fh, *_ in self.opened.values():
            fh.close()
        self.opened.clear()


def pending(task: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, model) of the task's transformers models built from a pretrained directory whose
    parameters are still on meta (a whole task built on meta, as `fw check` builds it, holds
    models made from a config: they have no directory and are left alone)."""
    from framework.integrations.hf.plans import models

    return [
        (path, model)
        for path, model in models(task)
        if on_meta(model) and model.name_or_path and Path(model.name_or_path).is_dir()
    ]


def sources(task: nn.Module) -> list[PretrainedSource]:
    """A Source per transformers model of the task still on meta, named as the task names it."""
    return [PretrainedSource(m, Path(m.name_or_path), path) for path, m in pending(task)]


@torch.no_grad()
def load_pretrained(
    task: nn.Module, device: torch.device, run_dir: str | Path | None = None, rank: int = 0
) -> list[LoadReport]:
    """Every transformers model in `task` whose parameters are on meta: storage on `device`,
    then its weights from its directory (`model.name_or_path`), this rank's slices only. The
    reports (one per model) are written to run_dir/pretrained/rank<R>.json and logged."""
    found = pending(task)
    if not found:
        return []
    materialize(task, torch.device(device))
    reports = [read_into(model, Path(model.name_or_path)) for _, model in found]
    if run_dir is not None:
        write_reports(reports, Path(run_dir), rank)
    return reports


@torch.no_grad()
def read_into(model: nn.Module, directory: Path) -> LoadReport:
    """Fill `model`'s parameters and persistent buffers (the part of each this rank holds: a
    DTensor's local shard, else whole) from the safetensors in `directory`."""
    start, rss0, read0 = time.perf_counter(), reset_peak_rss(), bytes_read()
    report = LoadReport(str(directory))
    source = PretrainedSource(model, directory)
    try:
        reads = []
        tensors = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
        for name in source.specs:
            found = reads_into(tensors[name], ("model", name))
            reads += found
            report.local_bytes += sum(r.out.numel() * r.out.element_size() for r in found)
            report.tensors += 1
        source.read(reads)
        report.files_opened = sorted(source.opened)
        report.bytes_read = source.bytes_read
    finally:
        source.close()
    files = set(source.files.values())
    report.file_bytes = sum((directory / f).stat().st_size for f in files)
    report.peak_rss_delta = max(0, peak_rss() - rss0)
    report.io_read = bytes_read() - read0
    report.seconds = time.perf_counter() - start
    return report


def write_reports(reports: list[LoadReport], run_dir: Path, rank: int) -> None:
    """Each rank's reports as run_dir/pretrained/rank<R>.json, and one log line per model."""
    if not reports:
        return
    out = Path(run_dir) / "pretrained"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps([asdict(r) for r in reports], indent=1))
    for r in reports:
        log.info(
            "Rank %d read %.1f MB of %s's %.1f MB (holds %.1f MB) in %.1f s; peak memory +%.1f MB",
            rank,
            r.bytes_read / 1e6,
            r.directory,
            r.file_bytes / 1e6,
            r.local_bytes / 1e6,
            r.seconds,
            r.peak_rss_delta / 1e6,
        )
