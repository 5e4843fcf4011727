"""The gpt recipe's default corpus is the standard library's .py files in sorted path order:
the same bytes on every machine with the same Python. The walk that stops early must list the
same files as sorting the whole tree."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

from recipes.gpt.data import stdlib_files


def sorted_tree(max_bytes: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or not os.access(path, os.R_OK):
            continue
        files.append(path)
        size += path.stat().st_size
        if size >= max_bytes:
            break
    return files


@pytest.mark.parametrize("max_bytes", [1, 2_000_000, 10**15])
def test_the_corpus_is_the_sorted_standard_library(max_bytes):
    assert stdlib_files(max_bytes) == sorted_tree(max_bytes)
