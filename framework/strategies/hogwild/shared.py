"""Parameters in memory that the processes of one machine share (plain torch, no Lightning).

Rank 0 creates one file in `shm_dir` (a tmpfs such as /dev/shm: memory, not disk), reserves its
size and writes every parameter into it; every process maps the file (MAP_SHARED) and points each
parameter's `.data` at its piece, so an optimizer step anywhere writes into the one copy. Once
every process has mapped it, rank 0 removes the file's name: the memory stays while a process
maps it and the kernel frees it when the last one exits, however it exits (kill -9 included). A
kill in the moment between creating and removing the name leaves a file; its name carries the
creator's process id, and the next start removes files of processes that no longer exist.

Buffers (BatchNorm statistics, router load counters) are not shared: each process keeps its own.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("framework.hogwild")
PREFIX = "fw-hogwild-"
ALIGN = 64  # bytes: each tensor starts on its own cache line (and at a multiple of its item size)


def share_parameters(module: torch.nn.Module, shm_dir: Path, rank: int) -> int:
    """Point every parameter of `module` at shared memory holding rank 0's values; returns the
    bytes shared. A collective: every process of the job calls it at the same point."""
    params = [p for p in module.parameters() if p.numel()]  # tied parameters once
    offsets, total = layout(params)
    path = create(shm_dir, total) if rank == 0 else None
    if dist.is_available() and dist.is_initialized():
        sent = [str(path)]
        dist.broadcast_object_list(sent, src=0)
        path = Path(sent[0])
    try:
        storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=max(total, 1))
        with torch.no_grad():
            for p, offset in zip(params, offsets, strict=True):
                view = piece(storage, offset, p)
                if rank == 0:
                    view.copy_(p)
                p.data = view
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # everyone has mapped it (and rank 0 has filled it)
    finally:
        if rank == 0:
            path.unlink(missing_ok=True)
    return total


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """The byte offset of each tensor in the shared file, and the file's size."""
    offsets, end = [], 0
    for t in tensors:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    return offsets, end


def piece(storage: torch.UntypedStorage, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor shaped and typed as `like` over `storage` from byte `offset`."""
    view = torch.empty(0, dtype=like.dtype)
    strides = torch.empty(like.shape, dtype=like.dtype, device="meta").stride()
    return view.set_(storage, offset // like.element_size(), like.shape, strides)


def create(shm_dir: Path, size: int) -> Path:
    """A new file of `size` bytes, reserved now: a tmpfs that runs out of room would otherwise
    kill a process with SIGBUS at its first write instead of raising here."""
    remove_orphans(shm_dir)
    path = shm_dir / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as err:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise OSError(
            f"cannot reserve {size / 2**20:.1f} MiB of shared memory in {shm_dir}: {err}; "
            "set strategy.shm_dir to a tmpfs with room (or enlarge /dev/shm)"
        ) from None
    os.close(fd)
    return path


def remove_orphans(shm_dir: Path) -> None:
    """Remove shared files whose creating process no longer exists (killed before it removed
    the name)."""
    for path in shm_dir.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            log.info("Removing %s, left by process %s, which no longer exists.", path, pid)
            path.unlink(missing_ok=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
