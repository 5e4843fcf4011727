"""Checkpoint directories on disk: naming, atomic commit, verification, retention, choosing one.

A checkpoint is a directory `checkpoints/stepNNNNNNNN/` holding the strategy's state files and a
`meta.json` (step, sizes and SHA-256 of every file, the resolved config and its hash, the run id).
It is written as `stepNNNNNNNN.tmp/` and renamed when complete, so a crash mid-save leaves only a
`.tmp` directory, which is never chosen. `checkpoints/last` is a symlink to the newest one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from framework import files

log = logging.getLogger("framework.checkpoint.disk")

NAME = re.compile(r"^step(\d{8,})$")
META = "meta.json"


def name_for(step: int) -> str:
    return f"step{step:08d}"


def listing(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints as (step, path), newest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in ckpt_dir.iterdir()
        if p.is_dir() and not p.is_symlink() and (m := NAME.match(p.name))
    ]
    return sorted(found, reverse=True)


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write a file whole or not at all, 0640 (framework.files.write_atomic)."""
    files.write_atomic(path, text)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def commit(tmp_dir: Path, meta: dict[str, Any]) -> Path:
    """Fsync the state files, write meta.json with their digests, rename `.tmp` to final."""
    # the strategy's writers (torch, DCP, DeepSpeed) follow the umask (0644): narrow their files
    # to 0640, and the folders to the checkpoints folder's mode, as the rest of the run directory
    folder_mode = tmp_dir.parent.stat().st_mode & 0o777
    listed = {}
    for f in sorted(tmp_dir.rglob("*")):
        files.restrict(f, folder_mode if f.is_dir() else files.FILE_MODE)
        if not f.is_file():
            continue
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
        listed[str(f.relative_to(tmp_dir))] = {"size": f.stat().st_size, "sha256": digest(f)}
    files.restrict(tmp_dir, folder_mode)
    write_json_atomic(tmp_dir / META, {**meta, "files": listed})
    final = tmp_dir.with_name(tmp_dir.name.removesuffix(".tmp"))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp_dir, final)
    fsync_dir(final.parent)
    point_last(final)
    return final


def point_last(target: Path) -> None:
    """Atomically repoint `checkpoints/last` at `target`."""
    link = target.parent / "last"
    tmp = target.parent / ".last.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target.name)
    os.replace(tmp, link)


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META).read_text())


def update_metrics(path: Path, metrics: dict[str, float]) -> None:
    """Record metrics computed after a checkpoint was written (its files stay as they are)."""
    meta = read_meta(path)
    meta["metrics"] = {**meta.get("metrics", {}), **metrics}
    write_json_atomic(path / META, meta)


def verify(path: Path, full: bool = True) -> str | None:
    """Why the checkpoint at `path` cannot be used, or None when it is complete and intact."""
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as err:
        return f"unreadable {META} ({err})"
    for rel, expected in meta.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != expected["size"]:
            return f"{rel} is {f.stat().st_size} bytes, {expected['size']} expected (truncated?)"
        if full and digest(f) != expected["sha256"]:
            return f"{rel} does not match its checksum (corrupted)"
    return None if meta.get("files") else "no state files recorded"


def newest_complete(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint that verifies; broken newer ones are reported and skipped."""
    for _step, path in listing(ckpt_dir):
        problem = verify(path)
        if problem is None:
            return path
        log.warning("Skipping checkpoint %s: %s", path, problem)
    return None


def remove_incomplete(ckpt_dir: Path) -> None:
    """Delete `.tmp` directories left by a save that was interrupted."""
    if ckpt_dir.is_dir():
        for p in ckpt_dir.glob("*.tmp"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def prune(ckpt_dir: Path, keep_last: int, keep_best: int, monitor: str | None, mode: str) -> None:
    """Keep the newest `keep_last` checkpoints plus the best `keep_best` by `monitor`."""
    all_ckpts = listing(ckpt_dir)
    keep = {p for _, p in all_ckpts[: max(keep_last, 1)]}
    if monitor and keep_best > 0:
        scored = []
        for _, p in all_ckpts:
            value = read_meta(p).get("metrics", {}).get(monitor)
            if value is not None:
                scored.append((value, p))
        scored.sort(key=lambda vp: vp[0], reverse=(mode == "max"))
        keep |= {p for _, p in scored[:keep_best]}
    for _, p in all_ckpts:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)


def best(ckpt_dir: Path, monitor: str, mode: str) -> Path | None:
    scored = [(read_meta(p).get("metrics", {}).get(monitor), p) for _, p in listing(ckpt_dir)]
    scored = [(v, p) for v, p in scored if v is not None]
    if not scored:
        return None
    return (max if mode == "max" else min)(scored, key=lambda vp: vp[0])[1]


def resolve(path: Path, key: str) -> Path:
    """The checkpoint a user named: a checkpoint directory, `last`, or a run directory (its newest).

    Raises a ConfigError naming `key` when there is none or it does not verify.
    """
    from framework.errors import ConfigError

    hint = "Give a run directory or one of its checkpoints/stepNNNNNNNN folders."
    if not path.exists():
        raise ConfigError(key, str(path), "no such file or directory", hint=hint)
    if (path / "checkpoints").is_dir():
        found = newest_complete(path / "checkpoints")
        if found is None:
            raise ConfigError(key, str(path), "this run directory has no complete checkpoint")
        return found
    path = path.resolve()
    if not (path / META).is_file():
        raise ConfigError(key, str(path), f"not a checkpoint directory (no {META})", hint=hint)
    problem = verify(path)
    if problem:
        raise ConfigError(key, str(path), f"the checkpoint is damaged: {problem}")
    return path
