"""`fw export RUN_DIR_OR_CHECKPOINT OUT --format hf`: a directory `from_pretrained` loads,
written in bounded memory from data only.

What the model is comes from the checkpoint's record, not from code: every checkpoint's meta.json
holds, for each transformers model of the task (`models.transformers`, written by the model
family's adapter), its path in the task (e.g. `lm`), its class name and its config. The export
builds that class (a transformers class, found in transformers' own namespace: nothing the run
directory names is imported) on the meta device from that config, which says which weights are
tied (written once, under the name `from_pretrained` expects). The weights are then read one at a
time from the checkpoint (any layout, type-restricted: framework/checkpoint/formats) and written
into safetensors shards of at most `--max-shard-size`, each shard written and let go before the
next (an index names the shards past one), beside config.json and generation_config.json. The
tokenizer copied beside them is the one the run recorded inside its run directory (`tokenizer/`,
which the hf_lm recipe fills when training starts); no file outside the run directory is copied.

A checkpoint written before the record existed is exported with `--trust` only: the task class
its config names is then imported and built on the meta device to find the model.

The directory is atomic: written under a hidden temporary sibling (`.OUT.<pid>.<random>.tmp`),
fsynced, then renamed to OUT. A killed export leaves only that hidden directory, never OUT; the
next export to OUT removes those left by processes that no longer run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from framework import files
from framework.checkpoint import disk
from framework.checkpoint.portable import Source, model_key, whole
from framework.errors import ConfigError

log = logging.getLogger("framework.checkpoint.export")

DEFAULT_SHARD_SIZE = "5GB"
TOKENIZER_DIR = "tokenizer"  # in the run directory: the tokenizer files the run trained with
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def shard_size(text: str) -> int:
    """Bytes of `--max-shard-size` ('5GB', '500MB', '2e9'; GB read as 2**30, as everywhere
    in fw)."""
    from framework.perf import parse_memory

    if not re.match(r"\s*\d", str(text)):  # parse_memory also reads GPU names
        raise ConfigError("--max-shard-size", text, "is not a size", ["5GB", "500MB", "2e9"])
    return parse_memory("--max-shard-size", text)


def check_options(max_shard_size: str | None) -> None:
    """`--max-shard-size` is a size (refused before anything is read)."""
    shard_size(max_shard_size or DEFAULT_SHARD_SIZE)


def write(
    ckpt: Path,
    out: Path,
    source: Source,
    max_shard_size: str | None,
    force: bool = False,
    trust: bool = False,
) -> Path:
    """`fw export --format hf` (framework.checkpoint.export's format table)."""
    limit = shard_size(max_shard_size or DEFAULT_SHARD_SIZE)
    path, model = recorded_model(ckpt, trust)
    tokenizer = ckpt.parent.parent / TOKENIZER_DIR
    write_dir_atomic(out, lambda tmp: save(model, path, source, tmp, limit, tokenizer), force)
    log.info("Exported %s (the task's %s) from %s to %s", type(model).__name__, path, ckpt, out)
    return out


def recorded_model(ckpt: Path, trust: bool) -> tuple[str, Any]:
    """(path in the task, model built on the meta device) from the checkpoint's record."""
    meta = disk.read_meta(ckpt)
    found = (meta.get("models") or {}).get("transformers")
    if found is None:
        if trust:
            return task_model(meta, ckpt)
        raise ConfigError(
            "source",
            str(ckpt),
            "the checkpoint records no transformers model (a task without one, or a "
            "checkpoint written before such records)",
            ["pt"],
            hint="Export it as a plain state dict (the default, --format pt); a checkpoint of "
            "your own from an earlier version exports with --trust, which imports its task class.",
        )
    if len(found) != 1:
        raise ConfigError(
            "--format",
            "hf",
            f"the task holds {len(found)} transformers models "
            f"({', '.join(r['path'] or '<task>' for r in found)})",
            ["pt"],
            hint="--format hf writes the one transformers PreTrainedModel a task holds; "
            "export other tasks as a plain state dict (the default, --format pt).",
        )
    return found[0]["path"], build(found[0])


def build(found: dict[str, Any]) -> Any:
    """The recorded transformers class, from transformers' own namespace, on the meta device."""
    import torch

    transformers = import_transformers()
    cls = getattr(transformers, str(found["class"]), None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ConfigError(
            "source", found["class"], "is not a transformers model class this version knows"
        )
    config = dict(found["config"])
    config_class = transformers.CONFIG_MAPPING[config.pop("model_type")]
    with torch.device("meta"):
        return cls(config_class.from_dict(config))


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "--format", "hf", "needs transformers", hint="Install the `hf` extra."
        ) from None
    return transformers


def task_model(meta: dict[str, Any], ckpt: Path) -> tuple[str, Any]:
    """`--trust` for a checkpoint without a record: its task class imported and built on meta."""
    import torch
    from omegaconf import OmegaConf

    from framework.instantiate import build_task
    from framework.integrations.hf.plans import models

    import_transformers()
    config = meta.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("task"), dict):
        raise ConfigError("source", str(ckpt), "the checkpoint records no task config")
    task_cfg = OmegaConf.create(config["task"])
    try:
        with torch.device("meta"):
            task = build_task(task_cfg)
    except Exception as err:
        raise ConfigError(
            "task", task_cfg.get("_target_"), f"could not be rebuilt: {err}"
        ) from None
    found = models(task)
    if len(found) != 1:
        raise ConfigError(
            "--format", "hf", f"the task holds {len(found)} transformers models", ["pt"]
        )
    return found[0]


def tied_names(model: Any) -> set[str]:
    """Names of the weights the model ties to another (written once, under the other name)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", True) and not tied:
        return set()
    return set(tied)


def plan_shards(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Names in order, in shards of at most `limit` bytes (a bigger tensor alone in its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def save(model: Any, path: str, source: Source, tmp: Path, limit: int, tokenizer: Path) -> None:
    """config.json, generation_config.json, the weights in shards read one tensor at a time,
    and the run's tokenizer files."""
    from safetensors.torch import save_file

    prefix = f"{path}." if path else ""
    saved = source.model()
    skip = tied_names(model)
    names = [n for n in model.state_dict() if n not in skip]
    missing = [n for n in names if prefix + n not in saved]
    if missing:
        raise ConfigError(
            "source",
            path or "<task>",
            f"the checkpoint does not match the model: missing {missing[:3]}",
        )
    sizes = {n: saved[prefix + n].nbytes for n in names}
    shards = plan_shards(sizes, limit)
    files_of = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for shard, file in zip(shards, files_of, strict=True):
        tensors = {n: whole(source, model_key(prefix + n), saved[prefix + n]) for n in shard}
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(tmp)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    copy_tokenizer(tokenizer, tmp)


def copy_tokenizer(directory: Path, tmp: Path) -> None:
    """The tokenizer files the run recorded in its run directory (plain files only)."""
    if not directory.is_dir() or directory.is_symlink():
        return
    for name in TOKENIZER_FILES:
        found = directory / name
        if found.is_file() and not found.is_symlink():
            shutil.copyfile(found, tmp / name)


def write_dir_atomic(out: Path, write: Callable[[Path], None], force: bool) -> None:
    """Make directory `out` whole or not at all: `write` fills a new hidden sibling, whose files
    are narrowed to 0640, fsynced, and which is then renamed to `out` (with `force`, over what
    was there)."""
    remove_abandoned(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    os.mkdir(tmp, files.DIR_MODE)  # a fresh random name: fails rather than reuse anything
    try:
        write(tmp)
        for f in sorted(tmp.rglob("*")):
            files.restrict(f, files.DIR_MODE if f.is_dir() else files.FILE_MODE)
            if f.is_file():
                with f.open("rb") as fh:
                    os.fsync(fh.fileno())
        disk.fsync_dir(tmp)
        replace(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    disk.fsync_dir(out.parent)


def replace(tmp: Path, out: Path, force: bool) -> None:
    """Rename `tmp` to `out`; an existing `out` (with `force`) is moved aside first and then
    removed, since a directory cannot be renamed over a non-empty one."""
    if not (out.exists() or out.is_symlink()):
        os.rename(tmp, out)
        return
    if not force:
        raise ConfigError("out", str(out), "already exists", hint="Choose another path or --force.")
    old = tmp.with_suffix(".old")
    os.rename(out, old)
    os.rename(tmp, out)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


def remove_abandoned(out: Path) -> None:
    """Delete the temporary directories of earlier exports to `out` whose process is gone."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(\d+)\.[0-9a-f]{{12}}\.tmp$")
    for p in out.parent.iterdir() if out.parent.is_dir() else ():
        m = pattern.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and not running(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
