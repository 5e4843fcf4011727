"""A run directory someone sends you is data: its checkpoints cannot make `fw train` or
`fw export` run code unless you pass --trust (framework.checkpoint.safe).

Each crafted checkpoint holds a pickle that, once unpickled, creates a marker file. It is
committed the way the framework commits its own (meta.json with digests), in the format the
meta names: a Lightning file, a DCP directory, DeepSpeed ZeRO partitions. The job's own
checkpoints still resume: every resume and move test in tests/distributed goes through the same
check."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from framework.checkpoint import disk
from tests.conftest import QUIET, fw, refused

STEP = "step00000002"


class Payload:
    """Unpickled, it opens (creates) `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def own_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("own") / "run"
    args = ["task.model.hidden=16", "trainer.max_steps=2", "callbacks.checkpoint.every_n_steps=2"]
    result = fw("train", *args, *QUIET, f"run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def write_payload(state: Path, fmt: str, marker: Path) -> None:
    """The checkpoint's state in format `fmt`, with the payload where that format unpickles."""
    if fmt == "lightning":
        torch.save({"state_dict": {}, "callbacks": Payload(marker)}, state)
    elif fmt == "dcp":
        state.mkdir()
        (state / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    else:  # deepspeed: the tag in `latest`, one ZeRO partition per rank
        (state / "checkpoint").mkdir(parents=True)
        (state / "latest").write_text("checkpoint")
        part = state / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        torch.save({"optimizer_state_dict": Payload(marker)}, part)


def crafted(own_run: Path, where: Path, fmt: str, marker: Path) -> Path:
    """A copy of `own_run` whose newest checkpoint is the payload, committed as ours are."""
    run = where / "run"
    shutil.copytree(own_run, run, symlinks=True)
    ckpts = run / "checkpoints"
    for path in ckpts.iterdir():
        if path.is_symlink() or path.name != STEP:
            path.unlink() if path.is_symlink() else shutil.rmtree(path)
    meta = disk.read_meta(ckpts / STEP)
    meta.pop("files")
    tmp = ckpts / f"{STEP}.tmp"
    shutil.rmtree(ckpts / STEP)
    tmp.mkdir()
    write_payload(tmp / "state.ckpt", fmt, marker)
    disk.commit(tmp, {**meta, "format": fmt, "state": "state.ckpt"})
    assert disk.verify(ckpts / STEP) is None, "the digests match: only the check stops it"
    return run


CASES = {  # the format written, and the strategy that resumes it
    "lightning": ("lightning", "ddp"),
    "dcp": ("dcp", "fsdp"),
    "deepspeed": ("deepspeed", "zero2"),
    "dcp moved to ddp": ("dcp", "ddp"),
    "deepspeed moved to ddp": ("deepspeed", "ddp"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_checkpoint_runs_no_code_on_resume_or_export(
    case, own_run, tmp_path, monkeypatch, capsys
):
    from framework.cli import main

    fmt, strategy = CASES[case]
    marker = tmp_path / "ran"
    work = tmp_path / "work"
    work.mkdir()
    run = crafted(own_run, work, fmt, marker)
    args = ["task.model.hidden=16", "trainer.max_steps=4", f"strategy={strategy}", *QUIET]
    err = refused(args, work, monkeypatch, capsys)
    assert "loading it could run code" in err and "names io.open" in err, err
    assert "--trust" in err
    out = tmp_path / "out.pt"
    assert main(["export", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert "loading it could run code" in err and STEP in err, err
    assert not out.exists() and not marker.exists(), "nothing ran, nothing written"


def test_the_payload_is_real_and_trust_loads_it(own_run, tmp_path, capsys):
    """Without the check the crafted DCP checkpoint runs its payload: what --trust is for."""
    from framework.cli import main

    marker = tmp_path / "ran"
    run = crafted(own_run, tmp_path, "dcp", marker)
    with pytest.raises(BaseException):  # noqa: B017 - what the payload returns is no metadata
        main(["export", str(run), str(tmp_path / "out.pt"), "--trust"])
    assert marker.exists()


def test_the_frameworks_own_checkpoint_exports_without_trust(own_run, tmp_path, capsys):
    from framework.cli import main

    out = tmp_path / "out.pt"
    assert main(["export", str(own_run), str(out)]) == 0, capsys.readouterr().err
    assert torch.load(out, weights_only=True), "a state dict"


def test_export_writes_through_no_planted_symlink(own_run, tmp_path, capsys):
    """The output is written under a fresh temporary name, then renamed: a symlink planted
    where a predictable temporary file would go leaves its target alone."""
    from framework.cli import main

    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    out = tmp_path / "out.pt"
    (tmp_path / "out.pt.tmp").symlink_to(victim)
    assert main(["export", str(own_run), str(out)]) == 0, capsys.readouterr().err
    assert victim.read_text() == "untouched"
    assert not out.is_symlink() and torch.load(out, weights_only=True)


def dcp_with_payload_entry(source: Path, state: Path, marker: Path) -> None:
    """A DCP directory whose byte entry (a param group setting) holds the payload: a copy of a
    real DCP checkpoint's files with that entry's bytes replaced in its .distcp file and the
    metadata's recorded length updated (the pickle of the metadata itself stays data)."""
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from framework.checkpoint import safe
    from framework.checkpoint.formats import dcp

    shutil.copytree(source, state)
    md = safe.load_pickle(state / ".metadata", dcp.ALLOWED, "metadata")
    key = next(k for k in md.state_dict_metadata if ".param_groups." in k)
    info = md.storage_data[MetadataIndex(key)]
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    payload = buffer.getvalue()
    shard = state / info.relative_path
    data = shard.read_bytes()
    shard.write_bytes(data + payload)
    info.offset, info.length = len(data), len(payload)
    (state / ".metadata").write_bytes(pickle.dumps(md))


def test_a_pickle_in_a_dcp_shards_byte_entry_runs_nothing(tmp_path, monkeypatch, capsys):
    """A byte entry of a .distcp shard is unpickled by torch's own load planner without
    restriction; the framework's reader refuses it, at the check before launch and on export."""
    from framework.cli import main

    fixture = Path(__file__).parents[1] / "fixtures" / "checkpoints" / "dcp"
    run = tmp_path / "run"
    shutil.copytree(fixture, run, symlinks=True)
    ckpt = run / "checkpoints" / "step00000010"
    meta = disk.read_meta(ckpt)
    meta.pop("files")
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    tmp.mkdir()
    marker = tmp_path / "ran"
    dcp_with_payload_entry(ckpt / "state.ckpt", tmp / "state.ckpt", marker)
    shutil.rmtree(ckpt)
    disk.commit(tmp, meta)
    assert main(["export", str(run), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert "loading it could run code" in err and "names io.open" in err, err
    assert not marker.exists()


def test_a_legacy_pickle_file_is_never_read(own_run, tmp_path, capsys):
    """A torch file in the legacy (non-zip) format is one pickle (DeepSpeed's loaders would
    unpickle it, whatever its first byte): refused."""
    from framework.cli import main

    run = tmp_path / "run"
    shutil.copytree(own_run, run, symlinks=True)
    ckpt = run / "checkpoints" / STEP
    marker = tmp_path / "ran"
    state = ckpt / "state.ckpt"
    state.write_bytes(pickle.dumps(Payload(marker), protocol=0))  # starts with "c", not \x80
    meta = disk.read_meta(ckpt)
    meta.pop("files")
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    shutil.move(ckpt, tmp)
    (tmp / "meta.json").unlink()
    disk.commit(tmp, meta)
    assert main(["export", str(run), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert "not a zip-format torch file" in err, err
    assert not marker.exists()


def test_a_link_inside_a_checkpoint_is_refused(own_run, tmp_path, capsys):
    """A symlinked folder inside the checkpoint (which a walk of its files would not enter, and
    a loader would follow) is refused before anything is read."""
    from framework.cli import main

    run = tmp_path / "run"
    shutil.copytree(own_run, run, symlinks=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "checkpoints" / STEP / "extra").symlink_to(elsewhere, target_is_directory=True)
    assert main(["export", str(run), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert "is a link, which a checkpoint never holds" in err, err


def test_what_is_checked_is_what_is_loaded(own_run, tmp_path, capsys):
    """meta.json's 'state' no longer chooses the file: the format names where its state lies
    (a crafted meta pointing the check at a harmless file changes nothing); DeepSpeed's tag
    file naming a path outside the checkpoint is refused."""
    from framework.checkpoint import formats
    from framework.checkpoint.portable import NotPortable
    from framework.checkpoint.safe import UnsafeCheckpoint
    from framework.cli import main

    run = tmp_path / "run"
    shutil.copytree(own_run, run, symlinks=True)
    ckpt = run / "checkpoints" / STEP
    marker = tmp_path / "ran"
    (ckpt / "harmless.ckpt").write_bytes((ckpt / "state.ckpt").read_bytes())
    torch.save({"state_dict": {}, "callbacks": Payload(marker)}, ckpt / "state.ckpt")
    meta = disk.read_meta(ckpt)
    meta.pop("files")
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    shutil.move(ckpt, tmp)
    (tmp / "meta.json").unlink()
    disk.commit(tmp, {**meta, "state": "harmless.ckpt"})
    assert main(["export", str(run), str(tmp_path / "out.pt")]) == 2
    assert "names io.open" in capsys.readouterr().err
    assert not marker.exists()
    ds = tmp_path / "ds" / "state.ckpt"
    ds.mkdir(parents=True)
    (ds / "latest").write_text(str(tmp_path / "elsewhere"))
    with pytest.raises((UnsafeCheckpoint, NotPortable), match="not a file of the checkpoint"):
        formats.named("deepspeed").open(ds)


def test_restarts_and_planted_checkpoints_are_checked(own_run, tmp_path, monkeypatch, capsys):
    """An automatic restart resumes from the newest checkpoint only once it reads as data, and a
    run directory holding checkpoints but no config.yaml (planted, not a run of this framework)
    is refused rather than loaded on the first restart."""
    from framework.launch.restarts import WorkerFailure, with_restarts

    run = crafted(own_run, tmp_path / "c", "lightning", tmp_path / "ran")
    starts = []
    with pytest.raises(WorkerFailure, match="to restart from is refused.*names io.open"):
        with_restarts(1, run, None, lambda attempt, ckpt: starts.append(ckpt) or "failed")
    assert starts == [None] and not (tmp_path / "ran").exists()
    capsys.readouterr()  # the restart's warning
    (run / "config.yaml").unlink()
    work = tmp_path / "w"
    work.mkdir()
    shutil.move(run, work / "run")
    err = refused(["task.model.hidden=16", *QUIET], work, monkeypatch, capsys)
    assert "holds checkpoints but no config.yaml" in err, err
