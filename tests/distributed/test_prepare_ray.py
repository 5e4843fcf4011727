"""`fw prepare --engine ray` writes, on Ray Data in local mode, the dataset the local engine
writes: the same blocks (byte-identical chunk files), a no-op when done, a run killed after its
parts finished is completed without redoing them, and Ray is gone when the command ends."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import fw
from tests.distributed.conftest import CORPUS
from tests.distributed.test_prepared import contents

pytestmark = pytest.mark.slow


def prepare(out: Path, *extra: str, cwd: Path):
    return fw("prepare", "--workers", "2", *CORPUS, f"task.data.prepared={out}", *extra, cwd=cwd)


def ray_processes() -> set[int]:
    """Ids of the running processes of a Ray cluster (its GCS, raylet and task workers)."""
    found = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if any(name in cmdline for name in (b"gcs_server", b"raylet", b"ray::")):
            found.add(int(proc.name))
    return found


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, prepared_corpus) -> dict:
    """The corpus prepared once by each engine (the only Ray run of this module; the local
    engine's: tests/distributed/conftest.py, shared with test_prepared.py)."""
    root = tmp_path_factory.mktemp("engines")
    before = ray_processes()
    ray = prepare(root / "ray", "--engine", "ray", cwd=root)
    assert ray.returncode == 0, ray.stderr[-3000:]
    deadline = time.monotonic() + 30  # the cluster's processes exit right after its shutdown
    while ray_processes() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    left = ray_processes() - before
    return {"local": prepared_corpus, "ray": root / "ray", "left": left, "root": root}


def test_the_ray_engine_writes_the_local_engines_blocks_and_bytes(prepared):
    from framework.data.prepared import TokenBlocks

    local, ray = prepared["local"], prepared["ray"]
    assert not prepared["left"], "Ray processes outlived fw prepare"
    want, got = TokenBlocks(local, 65), TokenBlocks(ray, 65)
    assert len(got) == len(want) > 20_000
    different = [i for i in range(len(want)) if not torch.equal(want[i], got[i])]
    assert not different, f"{len(different)} blocks differ, the first {different[0]}"
    # beyond equal blocks: every chunk file and the index byte for byte, the manifests but engine
    found = {name: digest for name, digest in contents(ray).items() if name != "fw_prepared.json"}
    assert found == {n: d for n, d in contents(local).items() if n != "fw_prepared.json"}
    manifests = [json.loads((p / "fw_prepared.json").read_text()) for p in (local, ray)]
    assert [m.pop("engine") for m in manifests] == ["local", "ray"]
    assert manifests[0] == manifests[1] and manifests[1]["complete"]


def no_ray(monkeypatch) -> None:
    """Starting Ray in this process fails the test."""
    import framework.data.ray_engine

    def refuse(workers):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(framework.data.ray_engine, "ray_cluster", refuse)


def test_a_finished_dataset_is_a_no_op_with_either_engine(prepared, monkeypatch, capsys):
    from framework.cli import main

    ray = prepared["ray"]
    before = contents(ray)
    monkeypatch.chdir(prepared["root"])
    no_ray(monkeypatch)
    for engine in ("ray", "local"):
        code = main(["prepare", "--engine", engine, *CORPUS, f"task.data.prepared={ray}"])
        out, err = capsys.readouterr()
        assert code == 0 and "Already prepared, nothing to do" in out, err[-3000:]
    assert contents(ray) == before


def killed_after_the_parts(done: Path, out: Path) -> None:
    """`out` as a ray preparation killed after both parts were written, before their indexes
    were joined: part k's chunks and its own index (`k.index.json`), no index.json."""
    shutil.copytree(done, out)
    index = json.loads((out / "index.json").read_text())
    for part in (0, 1):
        chunks = [c for c in index["chunks"] if c["filename"].startswith(f"chunk-{part}-")]
        text = json.dumps({"chunks": chunks, "config": index["config"]}, sort_keys=True)
        (out / f"{part}.index.json").write_text(text)
    (out / "index.json").unlink()
    manifest = json.loads((out / "fw_prepared.json").read_text())
    (out / "fw_prepared.json").write_text(json.dumps({**manifest, "complete": False}))


def test_a_killed_ray_preparation_keeps_its_finished_parts_and_only_continues_on_ray(
    prepared, tmp_path, monkeypatch, capsys, caplog
):
    from framework.cli import main

    out = tmp_path / "killed"
    killed_after_the_parts(prepared["ray"], out)
    monkeypatch.chdir(tmp_path)
    no_ray(monkeypatch)  # nothing is left for it to do
    code = main(["prepare", "--workers", "2", *CORPUS, f"task.data.prepared={out}"])
    err = capsys.readouterr().err
    assert code == 2 and "ran with 2 workers, chunks of 60000 bytes and the ray engine" in err
    code = main(
        ["prepare", "--workers", "2", "--engine", "ray", *CORPUS, f"task.data.prepared={out}"]
    )
    said = capsys.readouterr().err + caplog.text
    assert code == 0 and "2 of 2 parts were written before; kept" in said, said[-3000:]
    assert contents(out) == contents(prepared["ray"])


def test_engine_mistakes_are_refused_before_any_work(tmp_path, monkeypatch, capsys):
    import importlib.util

    from framework.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["prepare", "--engine", "spark", *CORPUS, f"task.data.prepared={tmp_path / 'a'}"])
    err = capsys.readouterr().err
    assert code == 2 and "--engine=spark: is not a preparation engine" in err, err
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a)
    )
    code = main(["prepare", "--engine", "ray", *CORPUS, f"task.data.prepared={tmp_path / 'b'}"])
    err = capsys.readouterr().err
    assert code == 2 and "needs Ray Data, which is not installed" in err and "[ray]" in err, err
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # no cluster there
    code = main(["prepare", "--engine", "ray", *CORPUS, f"task.data.prepared={tmp_path / 'c'}"])
    err = capsys.readouterr().err
    assert code == 2 and "RAY_ADDRESS=127.0.0.1:1: no Ray cluster could be joined there" in err
    assert not any((tmp_path / name).exists() for name in "abc"), "nothing written"
