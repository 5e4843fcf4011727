"""`fw prepare` writes a corpus once, in parallel, resumably and deterministically; the gpt recipe
trains on it with the framework's order and resume guarantees (any process count)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import FW, QUIET, fw, fw_env, losses
from tests.distributed.conftest import CORPUS

pytestmark = pytest.mark.slow


def prepare(out: Path, *extra: str, cwd: Path) -> subprocess.CompletedProcess:
    return fw("prepare", "--workers", "2", *CORPUS, f"task.data.prepared={out}", *extra, cwd=cwd)


def contents(out: Path) -> dict[str, str]:
    """Every file's hash; index.json without its time stamp."""
    found = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == "index.json":
            index = json.loads(data)
            index.get("config", {}).pop("updated_at", None)
            index.pop("updated_at", None)
            data = json.dumps(index, sort_keys=True).encode()
        found[str(path.relative_to(out))] = hashlib.sha256(data).hexdigest()
    return found


@pytest.fixture(scope="module")
def prepared(prepared_corpus) -> Path:
    """The corpus prepared without interruption (tests/distributed/conftest.py)."""
    return prepared_corpus


def test_a_killed_preparation_rerun_gives_the_same_bytes_and_a_third_run_is_a_no_op(
    prepared, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "data"
    args = ["prepare", "--workers", "2", *CORPUS, f"task.data.prepared={out}"]
    proc = subprocess.Popen(
        [str(FW), *args],
        cwd=tmp_path,
        env=fw_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(out.glob("chunk-*.bin")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "index.json").exists(), "killed before it finished"
    again = prepare(out, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert contents(out) == contents(prepared)
    from framework.cli import main  # the third in this process: nothing is left to do

    monkeypatch.chdir(tmp_path)
    code = main(["prepare", "--workers", "2", *CORPUS, f"task.data.prepared={out}"])
    assert code == 0 and "Already prepared, nothing to do" in capsys.readouterr().out
    assert contents(out) == contents(prepared)


def test_bad_input_is_refused_before_any_work(prepared, tmp_path, monkeypatch, capsys):
    from framework.cli import main

    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a dataset")
    cases = {
        "missing": (
            [f"task.data.source={tmp_path / 'nope'}"],
            tmp_path / "a",
            "is not a directory",
        ),
        "empty": ([f"task.data.source={empty}"], tmp_path / "b", "holds no text"),
        "foreign dir": ([], other, "exists and is not an empty directory or a prepared dataset"),
        "other dataset": (
            [f"task.data.source={other}"],
            prepared,
            "holds a dataset prepared from other input",
        ),
        "workers": (["--workers", "0"], tmp_path / "c", "--workers=0: must be a whole number"),
    }
    for name, (extra, out, message) in cases.items():
        before = contents(out) if out.exists() else None
        code = main(["prepare", *CORPUS, f"task.data.prepared={out}", *extra])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (name, err)
        assert (contents(out) if out.exists() else None) == before, name
    code = main(["train", "task=gpt", f"task.data.prepared={tmp_path / 'b'}"])
    err = capsys.readouterr().err
    assert code == 2 and "is not a prepared dataset" in err and "fw prepare task=gpt" in err


TRAIN = [
    *QUIET,
    *CORPUS,
    "task.model.n_layer=2",
    "task.model.n_head=2",
    "task.model.n_embd=64",
    "task.model.block_size=64",
    "task.data.val_fraction=0.995",  # 116 training blocks: one epoch is 14 steps of 8
    "trainer.max_steps=-1",
    "trainer.max_epochs=1",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "trainer.limit_val_batches=2",
    "trainer.val_check_interval=6",
    "callbacks.checkpoint.every_n_steps=4",
    "callbacks.checkpoint.keep_last=4",
    "logger=[csv]",
]


EPOCH = 14  # steps in the epoch: 116 training blocks, a global batch of 8, the last 4 left out


def recorded(tmp_path: Path, name: str) -> list[str]:
    """Overrides that make every rank write the ids of the samples it trains on."""
    return [
        "+callbacks.ids._target_=tests.distributed.scripts.sample_ids.SampleIds",
        f"+callbacks.ids.out={tmp_path / ('ids-' + name)}",
    ]


def samples(tmp_path: Path, name: str) -> dict[int, list[str]]:
    """Step -> the ids of the samples trained on in it (all ranks)."""
    from tests.distributed.scripts.sample_ids import read

    by_step: dict[int, list[str]] = {}
    for step, digest in read(tmp_path / ("ids-" + name)):
        by_step.setdefault(step, []).append(digest)
    return by_step


def test_training_on_prepared_data_is_the_same_for_any_process_count_and_resumes_exactly(
    prepared, tmp_path
):
    data = f"task.data.prepared={prepared}"
    one = fw(
        "train",
        *TRAIN,
        data,
        "task.data.batch_size=8",
        "run.dir=one",
        *recorded(tmp_path, "one"),
        cwd=tmp_path,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = fw(
        "train",
        *TRAIN,
        data,
        "task.data.batch_size=4",
        "trainer.devices=2",
        "+task.data.num_workers=1",
        "run.dir=two",
        *recorded(tmp_path, "two"),
        cwd=tmp_path,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    want, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(want) == sorted(got) == list(range(EPOCH)), "one whole epoch"
    assert all(abs(want[s] - got[s]) <= 1e-5 for s in want), (want, got)
    # the same samples in each step, each sample of the epoch once (distinct ids make the
    # digests identities)
    seen = samples(tmp_path, "two")
    everything = [d for step in sorted(seen) for d in seen[step]]
    assert len(everything) == len(set(everything)) == EPOCH * 8
    assert {s: sorted(d) for s, d in samples(tmp_path, "one").items()} == {
        s: sorted(d) for s, d in seen.items()
    }
    # the 2-process run's step-8 checkpoint resumed by 1 and by 4 processes: the same next
    # samples, none replayed or skipped
    step8 = next(
        p for p in (tmp_path / "two" / "checkpoints").iterdir() if p.name.endswith("00000008")
    )
    for name, per_rank in (
        ("resumed1", ["task.data.batch_size=8"]),
        ("resumed4", ["task.data.batch_size=2", "trainer.devices=4"]),
    ):
        (tmp_path / name).mkdir()
        again = fw(
            "train",
            *TRAIN,
            data,
            *per_rank,
            f"run.dir={name}",
            f"resume={step8}",
            *recorded(tmp_path, name),
            cwd=tmp_path,
        )
        assert again.returncode == 0, again.stderr[-3000:]
        later = samples(tmp_path, name)
        assert sorted(later) == list(range(8, EPOCH)), name
        before = [d for step in range(8) for d in seen[step]]
        assert sorted(before + [d for s in later for d in later[s]]) == sorted(everything), name
        after = losses(tmp_path / name)
        assert sorted(after) == list(range(8, EPOCH)), f"{name} resumed at step 8"
        assert all(abs(after[s] - want[s]) <= 1e-5 for s in after), (name, after, want)
    # a kill -9 and the automatic resume of the same command: test_resume.py (bitwise, any
    # data); what depends on this data (the position saved with a loader worker prefetching,
    # the samples after it) is the checkpoint of step 8 above
