"""The documentation site builds in strict mode (mkdocs.yml), and strict mode does fail: a broken
link, a missing anchor or an API reference to an object that does not exist, put into a copy of
the docs, stops the build and is named in its output."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml")]
        + ["--site-dir", str(site)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_site_builds_strictly(tmp_path):
    result = build(REPO, tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]  # needs the docs extra: make install
    home = (tmp_path / "site" / "index.html").read_text()
    assert "5-minute tour" in home, "README.md is the home page"
    api = (tmp_path / "site" / "docs" / "api" / "task" / "index.html").read_text()
    assert 'id="framework.task.TaskModule"' in api, "the API reference is rendered"
    assert (tmp_path / "site" / "search" / "search_index.json").is_file()


def copy_of_the_docs(tmp_path: Path) -> Path:
    """The site's sources in tmp_path; the code that the API reference reads is linked."""
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(REPO / name, root / name)
    for name in ("docs", "recipes", "conf"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "framework").symlink_to(REPO / "framework")
    return root


BREAKAGES = {
    "link": ("[the guide](no_such_page.md)", "no_such_page.md"),
    "anchor": ("[a section](checkpoints.md#no-such-section)", "#no-such-section"),
    "api": ("::: framework.task.NoSuchClass", "framework.task.NoSuchClass"),
}


@pytest.mark.parametrize("kind", list(BREAKAGES))
def test_a_broken_reference_fails_the_build(tmp_path, kind):
    root = copy_of_the_docs(tmp_path)
    text, named = BREAKAGES[kind]
    page = root / "docs" / "concepts.md"
    page.write_text(f"{page.read_text()}\n{text}\n")
    result = build(root, tmp_path / "site")
    assert result.returncode != 0, f"strict mode let a broken {kind} through"
    assert named in result.stderr, result.stderr[-3000:]
