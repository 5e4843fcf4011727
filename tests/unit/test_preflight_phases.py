"""`fw check`'s figures of the phases around a job's steps: a resume that changes the layout, a
pretrained load and `fw export`, printed under the table from the checkpoint's and the pretrained
files' metadata, and `--host-mem` refusing a job whose node they would not fit.

The resume reads the fixture checkpoint written by fsdp on 2 processes (tests/fixtures) into
fsdp on 1 and 2; the pretrained load and the export are those of two tiny Llamas whose
vocabularies differ by 2x (their largest tensor, the embedding, too).
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO

DCP = REPO / "tests/fixtures/checkpoints/dcp"
# the fixture's own model: digits with hidden=16 (its README)
DIGITS = ["task=digits", "task.model.hidden=16", "strategy=fsdp", "trainer.accelerator=cpu"]
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def run_check(args: list[str], capsys) -> tuple[int, str, str]:
    from framework.cli import main

    code = main(["check", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def note(out: str, start: str) -> list[float]:
    """The byte figures of the note under the table that starts with `start`, in order."""
    (line,) = [line for line in out.splitlines() if line.startswith(start)]
    return [float(n) * UNITS[u] for n, u in re.findall(r"([\d.]+) (KiB|MiB|GiB)", line)]


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    from tests.hf_pretrained import write_llama

    root = tmp_path_factory.mktemp("llamas")
    return {v: write_llama(root / f"llama{v}", vocab=v) for v in (300, 600)}


def largest_tensor(directory) -> int:
    """The largest tensor of a (tiny) pretrained directory, read back."""
    from safetensors.torch import load_file

    tensors = [t for path in directory.glob("*.safetensors") for t in load_file(path).values()]
    return max(t.numel() * t.element_size() for t in tensors)


@pytest.mark.slow
def test_a_resume_onto_more_processes_is_figured_per_rank_from_the_checkpoint(capsys):
    figures = {}
    for n in (1, 2):
        code, out, err = run_check([*DIGITS, f"trainer.devices={n}", f"resume={DCP}"], capsys)
        assert code == 0, err
        start = "Resume from step00000010 (dcp, written by 2 process(es)): each rank reads only"
        figures[n] = note(out, start)  # own share, held at once beyond it, the whole state
    (one, chunk, whole), (half, chunk2, whole2) = figures[1], figures[2]
    # the checkpoint's state is what one process keeps (params and optimizer: the same model)
    assert one == pytest.approx(whole, rel=0.01)
    assert half == pytest.approx(one / 2, rel=0.05), figures
    assert (chunk, whole) == (chunk2, whole2)
    # a reader holds one saved chunk at a time, never the state
    assert 0 < chunk < whole / 4, figures


def test_a_resume_from_a_checkpoint_holding_a_link_is_refused_not_figured(capsys, tmp_path):
    """The checkpoint is opened as `fw train` would open it: a link inside it is an exit 2 in
    one paragraph, not a traceback."""
    import shutil

    ckpt = tmp_path / "dcp"
    shutil.copytree(DCP, ckpt)
    (ckpt / "checkpoints" / "step00000010" / "state.ckpt" / "extra").symlink_to("/etc/passwd")
    code, out, err = run_check([*DIGITS, f"resume={ckpt}"], capsys)
    assert code == 2 and "is a link" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_a_pretrained_load_and_an_export_follow_the_models_size(capsys, llamas):
    figures = {}
    for vocab, directory in llamas.items():
        args = ["task=hf_lm", f"task.model.pretrained={directory}", "task.data.tokenizer=bytes"]
        args += ["strategy=fsdp", "trainer.devices=2", "trainer.accelerator=cpu"]
        code, out, err = run_check(args, capsys)
        assert code == 0, err
        own, read_at_once, weights = note(out, f"Pretrained load from {directory}:")
        at_once, model = note(out, "fw export of this job's checkpoints")
        largest = largest_tensor(directory)
        # each rank keeps half the weights (its params, no optimizer yet), one tensor at a time
        assert own == pytest.approx(weights / 2, rel=0.01)
        assert read_at_once == largest
        # the export holds its largest tensor and a piece being read into it: twice the tensor
        assert at_once == 2 * largest and model == weights
        figures[vocab] = (weights, largest)
    assert figures[600][1] == 2 * figures[300][1]  # the embedding: the largest tensor
    assert figures[600][0] > figures[300][0]


@pytest.mark.slow
def test_host_mem_below_a_phases_figure_refuses_before_launch(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    args = [*DIGITS, "trainer.devices=2", f"resume={DCP}"]
    code, out, err = run_check(args, capsys)
    assert code == 0, err
    own, chunk, _ = note(out, "Resume from step00000010")
    need = 2 * (own + chunk)  # a CPU job's two ranks on one node: each its share and one chunk
    code, out, err = run_check([*args, "--host-mem", str(int(need * 1.05))], capsys)
    assert code == 0, err
    code, out, err = run_check([*args, "--host-mem", str(int(need * 0.95))], capsys)
    assert code == 2
    assert out == "", "refused before the table"
    assert err.startswith("error: --host-mem=") and "the resume would need about" in err
    assert "step00000010" in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir()), "fw check writes nothing"
