"""Files and directories the framework writes: private modes, written whole, no symlink followed.

Run directories are created `run.dir_mode` (0750: the owner and the group, nobody else) and files
0640, never more open than the umask allows (the modes are passed to the kernel, which applies
the umask; there is no process-wide umask to change). A file is written through a new temporary
file beside it, created exclusively (`O_EXCL | O_NOFOLLOW`) under a random name, so a symlink or
file someone planted at a predictable temporary path is never opened, then renamed over the
target (the rename replaces a symlink at the target itself, never the file it points to).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

FILE_MODE = 0o640  # the owner writes, the group reads
DIR_MODE = 0o750  # run.dir_mode's default
NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def dir_mode(text: str | int | None) -> int:
    """`run.dir_mode` ('0750', '750' or an int already parsed as octal) as a mode."""
    if text is None:
        return DIR_MODE
    return text if isinstance(text, int) else int(str(text), 8)


def make_dir(path: Path, mode: int = DIR_MODE) -> Path:
    """Create the directory `path` as `mode`, and each missing parent too (the default `runs/`:
    created as the umask allows, it would be 0777 under umask 000); one that exists is left as
    its owner set it."""
    path = Path(path)
    missing = []
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    for directory in [*reversed(missing), path]:
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            if not directory.is_dir():
                raise
    return path


def write_atomic(path: Path, data: bytes | str, mode: int = FILE_MODE) -> None:
    """Write a file whole or not at all: a new temporary file beside `path`, fsynced, renamed
    over it. Several processes may write the same file at once: the last rename wins."""
    data = data.encode() if isinstance(data, str) else data
    write_atomic_with(path, lambda fh: fh.write(data), mode)


def write_atomic_with(path: Path, write: Callable[[BinaryIO], object], mode: int = FILE_MODE):
    """`write_atomic` for a writer that streams into the file (e.g. torch.save)."""
    path = Path(path)
    # random: nobody can plant a symlink there in advance; O_EXCL | O_NOFOLLOW refuse one anyway
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, NEW, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def create_new(path: Path, mode: int = FILE_MODE) -> None:
    """Create an empty file at `path` unless something (a file, a symlink) is there already."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, NEW, mode))


def open_append(path: Path, mode: int = FILE_MODE) -> BinaryIO:
    """`path` opened to append (created `mode`), refusing a symlink in its place."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, mode), "ab")


def open_lock(path: Path, mode: int = FILE_MODE) -> BinaryIO:
    """A lock file shared by several processes (created `mode`), refusing a symlink in its
    place; its content is never written."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, mode), "r+b")


def restrict(path: Path, mode: int) -> None:
    """Take away the permission bits `mode` does not grant (never add any): for files that
    other code created with the umask's modes. Symlinks are left alone."""
    path = Path(path)
    if path.is_symlink():
        return
    current = path.stat().st_mode & 0o7777
    if current & ~mode:
        os.chmod(path, current & mode)
