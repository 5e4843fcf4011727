"""The documentation site builds in strict mode (mkdocs.yml), and strict mode does fail: a broken
link, a missing anchor or an API reference to an object that does not exist, put into a copy of
the docs, stops the build and is named in its output. What strict mode cannot see is read from
the built pages with an HTML parser: a table cut in two by a blank line (its rows then render as
paragraphs of `|` text), a code fence left open (shown as text), an image whose file is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
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


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site") / "site"
    result = build(REPO, out)
    assert result.returncode == 0, result.stderr[-3000:]  # needs the docs extra: make install
    return out


def test_the_site_builds_strictly(site):
    home = (site / "index.html").read_text()
    assert "5-minute tour" in home, "README.md is the home page"
    api = (site / "docs" / "api" / "task" / "index.html").read_text()
    assert 'id="framework.task.TaskModule"' in api, "the API reference is rendered"
    assert (site / "search" / "search_index.json").is_file()


IMAGE_STARTS = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF8", b"<svg", b"<?xml")


def is_image(path: Path) -> bool:
    """A file whose first bytes are those of a PNG, JPEG, GIF or SVG image."""
    try:
        with path.open("rb") as fh:
            return fh.read(16).lstrip().startswith(IMAGE_STARTS)
    except OSError:
        return False


class PageReader(HTMLParser):
    """What reads badly on one built page: paragraphs that are table rows, fences shown as
    text, images whose file is not in the site."""

    def __init__(self, page: Path) -> None:
        super().__init__()
        self.page, self.problems = page, []
        self.code = 0  # depth inside <pre>/<code>
        self.paragraph: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag in ("pre", "code"):
            self.code += 1
        elif tag == "p":
            self.paragraph = []
        elif tag == "img":
            src = dict(attrs).get("src") or ""
            local = src.split("#")[0].split("?")[0]
            if not local.startswith(("http:", "https:", "data:")) and not is_image(
                self.page.parent / local
            ):
                self.problems.append(f"image {src!r} does not load")

    def handle_endtag(self, tag):
        if tag in ("pre", "code"):
            self.code -= 1
        elif tag == "p" and self.paragraph is not None:
            text = "".join(self.paragraph).strip()
            if text.startswith("|"):
                self.problems.append(f"a table row rendered as a paragraph: {text[:60]!r}")
            self.paragraph = None

    def handle_data(self, data):
        if self.paragraph is not None:
            self.paragraph.append(data)
        if self.code:
            return
        if "```" in data or "~~~" in data:
            self.problems.append(f"a code fence shown as text (left open?): {data.strip()[:60]!r}")


def site_problems(site: Path) -> list[str]:
    found = []
    for page in sorted(site.rglob("*.html")):
        reader = PageReader(page)
        reader.feed(page.read_text())
        found += [f"{page.relative_to(site)}: {p}" for p in reader.problems]
    return found


def test_every_page_reads_as_written(site):
    assert site_problems(site) == []


def test_a_cut_table_an_open_fence_and_a_missing_image_are_named(tmp_path):
    root = copy_of_the_docs(tmp_path)
    strategies = root / "docs" / "strategies.md"
    lines = strategies.read_text().splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("| `tensor`"))
    strategies.write_text("\n".join([*lines[:row], "", *lines[row:]]) + "\n")
    # strict mode checks a Markdown image's file, not raw HTML's, nor that the file is an image
    (root / "docs" / "img" / "memory.png").write_bytes(b"")
    concepts = root / "docs" / "concepts.md"
    concepts.write_text(f'{concepts.read_text()}\n<img src="no_such_plot.png" alt="a plot">\n')
    data = root / "docs" / "data.md"
    data.write_text(f"{data.read_text()}\n```python\nprint('never closed')\n")
    assert build(root, tmp_path / "site").returncode == 0, "strict mode sees none of these"
    found = "\n".join(site_problems(tmp_path / "site"))
    assert "docs/strategies/index.html: a table row rendered as a paragraph: '| tensor |" in found
    assert "docs/concepts/index.html: image 'no_such_plot.png' does not load" in found, found
    assert "docs/benchmarks/index.html: image '../img/memory.png' does not load" in found, found
    assert "docs/data/index.html: a code fence shown as text" in found, found


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


def test_a_page_left_out_of_the_nav_fails_the_build(tmp_path):
    root = copy_of_the_docs(tmp_path)
    (root / "docs" / "orphan.md").write_text("# A page nobody can reach\n")
    result = build(root, tmp_path / "site")
    assert result.returncode != 0, "strict mode let a page outside the nav through"
    assert "orphan.md" in result.stderr, result.stderr[-3000:]
