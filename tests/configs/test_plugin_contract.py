"""A strategy plugin written outside the framework from only what docs/strategies.md says:
the files are taken from the page's code blocks, and the page's commands behave as it says."""

from __future__ import annotations

import json
import re

import pytest

from framework.errors import ConfigError
from framework.plugins import load_plugin, required_names
from tests.conftest import QUIET, REPO, fw, read_metrics

DOC = REPO / "docs" / "strategies.md"


def section_blocks() -> tuple[dict[str, str], list[str]]:
    """{path: text} of the section's files (a block whose first line is `# <path>`), and its
    `fw` commands."""
    text = DOC.read_text().split("## Adding a strategy plugin", 1)[1]
    files, commands = {}, []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S):
        first = body.splitlines()[0]
        if lang == "bash":
            commands += [line.split("#")[0].split() for line in body.splitlines() if line.strip()]
        elif first.startswith("# ") and "/" in first:
            files[first[2:].strip()] = body
    return files, commands


def test_the_out_of_tree_plugin_from_the_docs_works(workdir):
    files, commands = section_blocks()
    assert set(files) == {
        "my_plugins/single.py",
        "my_plugins/__init__.py",
        "my_conf/strategy/single.yaml",
    }
    for path, body in files.items():
        (workdir / path).parent.mkdir(parents=True, exist_ok=True)
        (workdir / path).write_text(body)
    train, two, typo, check, plan = commands
    common = [*QUIET, "logger=[csv]", "trainer.log_every_n_steps=1", "run.dir=run"]
    result = fw(*train[1:], *common, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [int(r["step"]) for r in read_metrics(workdir / "run") if r.get("train/loss")] == list(
        range(5)
    )
    meta = json.loads((workdir / "run" / "checkpoints" / "last" / "meta.json").read_text())
    assert meta["format"] == "lightning" and meta["step"] == 5
    for command, message in (
        (two, "strategy=single runs exactly one process"),
        (typo, "strategy.device_indx=1: no such key. Did you mean 'device_index'?"),
    ):
        result = fw(
            *command[1:], *[c for c in common if c != "run.dir=run"], "run.dir=bad", cwd=workdir
        )
        assert result.returncode == 2, result.stderr[-3000:]
        assert message in result.stderr and "Traceback" not in result.stderr
        assert not (workdir / "bad").exists()
    # fw check and fw plan understand the new strategy (its optional `describe` names it)
    result = fw(*check[1:], *QUIET, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("single device, 1 processes;"), result.stdout
    result = fw(*plan[1:], *QUIET, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    best = next(line for line in result.stdout.splitlines() if line.startswith("*"))
    assert best.split()[1] == "single" and "strategy=single" in best, result.stdout


def test_a_module_missing_a_hook_is_refused_by_name(tmp_path, monkeypatch):
    (tmp_path / "half_plugin.py").write_text(
        "class Config:\n    pass\n\ndef build(cfg, world, inputs):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        load_plugin("strategy", "half_plugin", "strategy.kind")
    assert "no strategy plugin of that kind" in str(err.value)  # an undotted kind is built in
    (tmp_path / "pkg_half").mkdir()
    (tmp_path / "pkg_half" / "__init__.py").write_text("")
    (tmp_path / "pkg_half" / "plugin.py").write_text((tmp_path / "half_plugin.py").read_text())
    with pytest.raises(ConfigError) as err:
        load_plugin("strategy", "pkg_half.plugin", "strategy.kind")
    missing = "validate, checkpoint_format, check_move, data_parallel"
    assert f"it lacks {missing}" in str(err.value)
    assert required_names("strategy") == ["Config", *missing.split(", "), "build"]
