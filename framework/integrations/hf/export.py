"""`fw export RUN_DIR_OR_CHECKPOINT OUT --format hf`: a directory `from_pretrained` loads.

The checkpoint is consolidated as for the plain export (any strategy). The task is rebuilt on the
meta device from the config the checkpoint recorded, which finds its transformers model, the
model's path in the task (e.g. `lm.`) and its config, with no weights allocated. The model's
weights (the prefix stripped) are assigned to that meta model, its ties are made as its config
says, and transformers' own `save_pretrained` writes config.json, generation_config.json and
safetensors shards (an index past `--max-shard-size`), so tied weights are written once and the
layout is the one `from_pretrained` expects. The tokenizer the task trained with is copied beside
them: the one `task.data.tokenizer` names (the hf_lm recipe: a directory or a tokenizer.json), else
the tokenizer files of the pretrained directory the model came from (`task.model.pretrained`).

The directory is atomic: written under a hidden temporary sibling (`.OUT.<pid>.<random>.tmp`),
fsynced, then renamed to OUT. A killed export leaves only that hidden directory, never OUT; the
next export to OUT removes those left by processes that no longer run.
"""

from __future__ import annotations

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
from framework.errors import ConfigError

log = logging.getLogger("framework.checkpoint.export")

DEFAULT_SHARD_SIZE = "5GB"
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
    read_state: Callable[[Path], dict],
    max_shard_size: str | None,
    force: bool = False,
) -> Path:
    """`fw export --format hf` (framework.checkpoint.export's format table)."""
    return export_hf(ckpt, out, read_state, max_shard_size or DEFAULT_SHARD_SIZE, force)


def export_hf(
    ckpt: Path,
    out: Path,
    read_state: Callable[[Path], dict],
    max_shard_size: str = DEFAULT_SHARD_SIZE,
    force: bool = False,
) -> Path:
    """Write the transformers model of checkpoint `ckpt` (resolved, checked) as directory `out`;
    `read_state` consolidates the checkpoint into one state dict (framework.checkpoint.export's, passed in
    so that the plain export, which dispatches here, is not imported back)."""
    limit = shard_size(max_shard_size)
    task_cfg = recorded_task(ckpt)
    path, model = transformers_model(task_cfg)
    tokenizer = tokenizer_dir(task_cfg)
    weights = model_weights(read_state(ckpt), path)
    assign(model, weights, path)
    del weights
    write_dir_atomic(out, lambda tmp: save(model, tmp, limit, tokenizer), force)
    log.info("Exported %s (the task's %s) from %s to %s", type(model).__name__, path, ckpt, out)
    return out


def recorded_task(ckpt: Path) -> Any:
    """The task config the run that wrote `ckpt` trained with (recorded in its meta.json)."""
    from omegaconf import OmegaConf

    config = disk.read_meta(ckpt).get("config")
    if not isinstance(config, dict) or not isinstance(config.get("task"), dict):
        raise ConfigError(
            "source",
            str(ckpt),
            "the checkpoint records no task config, so its model cannot be rebuilt",
            hint="Export it as a plain state dict (--format pt).",
        )
    return OmegaConf.create(config["task"])


def transformers_model(task_cfg: Any) -> tuple[str, Any]:
    """(path in the task, model) of the task's one transformers model, built on the meta device."""
    import torch
    from hydra.utils import get_class
    from lightning.pytorch import LightningModule

    from framework.instantiate import build_task
    from framework.integrations.hf.plans import models

    try:
        import transformers  # noqa: F401  (framework.integrations.hf.plans finds models only once imported)
    except ImportError:
        raise ConfigError(
            "--format", "hf", "needs transformers", hint="Install the `hf` extra."
        ) from None
    target = task_cfg.get("_target_")
    try:
        cls = get_class(target)
    except Exception as err:
        raise ConfigError("task._target_", target, f"cannot be imported ({err})") from None
    # the class comes from the checkpoint's own record: only a LightningModule is built from it
    if not (isinstance(cls, type) and issubclass(cls, LightningModule)):
        raise ConfigError("task._target_", target, "is not a LightningModule")
    try:
        with torch.device("meta"):
            task = build_task(task_cfg)
    except Exception as err:
        raise ConfigError("task", target, f"could not be rebuilt: {err}") from None
    found = models(task)
    if len(found) != 1:
        raise ConfigError(
            "--format",
            "hf",
            f"the task {target} holds {len(found)} transformers models"
            + (f" ({', '.join(p or '<task>' for p, _ in found)})" if found else ""),
            ["pt"],
            hint="--format hf writes the one transformers PreTrainedModel a task holds; "
            "export other tasks as a plain state dict (the default, --format pt).",
        )
    return found[0]


def tokenizer_dir(task_cfg: Any) -> Path | None:
    """Where the task's tokenizer is: `task.data.tokenizer` when it names a directory or a file
    (a tokenizer.json), else the pretrained directory of the model (`task.model.pretrained`)."""
    for section, key in (("data", "tokenizer"), ("model", "pretrained")):
        node = task_cfg.get(section)
        value = node.get(key) if hasattr(node, "get") else None
        path = Path(str(value)).expanduser() if value else None
        if path is not None and path.exists():
            return path
    return None


def model_weights(state: dict, path: str) -> dict:
    """The model's entries of the task's state dict, keyed as the model names them."""
    prefix = f"{path}." if path else ""
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


def assign(model: Any, weights: dict, path: str) -> None:
    """Put `weights` into the meta-built `model` (no copy) and tie what its config ties; a
    checkpoint that does not fit the model is refused, naming the first keys that differ."""
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ConfigError(
            "source",
            path or "<task>",
            f"the checkpoint does not match the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}",
        )
    model.tie_weights()  # the tied copies become one tensor, which save_pretrained writes once


def save(model: Any, tmp: Path, limit: int, tokenizer: Path | None) -> None:
    """save_pretrained into `tmp`, then the tokenizer: a tokenizer.json file, or the tokenizer
    files of a directory."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp, max_shard_size=limit)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if tokenizer is not None and tokenizer.is_file():
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
    for name in TOKENIZER_FILES if tokenizer is not None and tokenizer.is_dir() else ():
        if (tokenizer / name).is_file():
            shutil.copyfile(tokenizer / name, tmp / name)


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
