"""The reader's check: a page a user reads (the README, docs/, the recipes' READMEs) says what
the framework does and how to use it. Issue numbers, commit hashes and the suite's file and test
names belong in commit messages: a reader cannot use them, and they go stale. Every hit is
reported as page:line, so `pytest tests/docs/test_reader.py -k PAGE` lists what to fix."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO

# Lightning's own names that start with test_: a page explaining a task uses them
LIGHTNING_NAMES = frozenset(
    {"test_step", "test_dataloader", "test_after_fit", "test_epoch_end", "test_loop"}
)

RULES = {
    "issue reference": re.compile(r"\b(?:issues?|PR) ?#?\d+|\(#\d+\)", re.IGNORECASE),
    # 7-40 hex digits as a whole word, with a digit and a letter: a plain number or word is not
    # a hash. No page holds a checksum or other hex word that a reader needs.
    "commit hash": re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{7,40}\b"),
    "test path": re.compile(r"\btests/\S+\.py|\btest_\w+\.py|::test_\w+"),
}
TEST_WORD = re.compile(r"\btest_\w+")
# A link to another project's page, e.g. an upstream issue cited as a source: the reader can
# follow it, so its text may name an issue or a commit. This project's own issues are never linked.
WEB_LINK = re.compile(r"\[[^\]]*\]\(https?://[^)]*\)")


def pages() -> list[Path]:
    """Every page of the site a user reads: the README, docs/ (the API pages too: their prose
    is read), the recipes' READMEs."""
    return [
        REPO / "README.md",
        *sorted((REPO / "docs").rglob("*.md")),
        *sorted(REPO.glob("recipes/*/README.md")),
    ]


@cache
def suite_names() -> frozenset[str]:
    """The suite's module stems and test function names: such a word in a page names a test."""
    names = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        names.add(path.stem)
        names.update(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M))
    return frozenset(names - LIGHTNING_NAMES)


def problems(page: Path, names: frozenset[str] = frozenset()) -> list[str]:
    """`page:line: rule: text` for each thing on the page a reader should not meet; `names`
    are the test names to look for besides paths."""
    hits, shown = [], page.relative_to(REPO) if page.is_relative_to(REPO) else page
    for number, line in enumerate(page.read_text().splitlines(), 1):
        line = WEB_LINK.sub("", line)
        found = [(rule, m.group(0)) for rule, pat in RULES.items() for m in pat.finditer(line)]
        rest = RULES["test path"].sub("", line)  # a path's test name is reported once
        found += [("test name", w) for w in TEST_WORD.findall(rest) if w in names]
        hits += [f"{shown}:{number}: {rule}: {text}" for rule, text in found]
    return hits


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_a_page_holds_no_issue_reference_commit_hash_or_test_name(page):
    hits = problems(page, suite_names())
    assert not hits, "\n".join([f"{len(hits)} thing(s) a reader cannot use:", *hits])


def test_the_check_finds_each_kind_on_its_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n"
        "Resuming works again since issue 33 (#41).\n"
        "Measured at 4957cee on two cores; the sum is 3f0a9c2e1d.\n"
        "The suite checks it (tests/distributed/test_resume.py, test_resume_moves).\n"
        "Plain words: a test_step, 1e-5, 2026, deadbeef, run 1234567, commit-free.\n"
        "Cited: [torch issue 1789](https://github.com/pytorch/pytorch/issues/1789).\n"
    )
    hits = problems(page, frozenset({"test_resume_moves"}))
    assert [h.split(": ", 1)[0] for h in hits] == [f"{page}:2"] * 2 + [f"{page}:3"] * 2 + [
        f"{page}:4"
    ] * 2, hits
    rules = [h.split(": ")[1] for h in hits]
    assert rules == ["issue reference"] * 2 + ["commit hash"] * 2 + ["test path", "test name"]


def test_the_suites_test_names_are_found():
    names = suite_names()
    assert "test_reader" in names and "test_the_check_finds_each_kind_on_its_line" in names
    assert "test_step" not in names


def cli_commands(capsys) -> list[str]:
    """The commands the CLI dispatches, from its own answer to an unknown command."""
    from framework.cli import main

    assert main(["no-such-command"]) == 2
    choices = re.search(r"Valid choices: (.*)\.$", capsys.readouterr().err.strip())
    assert choices is not None
    return choices.group(1).split(", ")


def usage(command: str, capsys) -> str:
    """The usage lines `fw COMMAND --help` prints: `usage:` and its indented continuation."""
    from framework.cli import main

    assert main([command, "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("usage: fw "))
    end = start + 1
    while end < len(lines) and lines[end].startswith("    "):
        end += 1
    return "\n".join(lines[start:end])


def test_the_commands_page_gives_every_command_its_usage_as_fw_prints_it(capsys):
    """A new command, or a changed usage, fails here until docs/commands.md says it."""
    page = (REPO / "docs" / "commands.md").read_text()
    commands = cli_commands(capsys)
    assert {"train", "test", "export", "calibrate"} <= set(commands), commands
    headings = " ".join(re.findall(r"^## (.*)$", page, flags=re.M))
    table = page.split("\n## ", 1)[0]
    for command in commands:
        assert f"fw {command}" in headings, f"no heading for fw {command}"
        assert f"`fw {command}`" in table, f"fw {command} is missing from the table"
        assert f"```\n{usage(command, capsys)}\n```" in page, f"fw {command}: usage differs"
    named = set(re.findall(r"\bfw (\w+)", headings))
    assert named <= set(commands), named - set(commands)
