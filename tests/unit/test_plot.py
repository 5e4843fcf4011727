"""`fw plot`: one PNG of a run's metrics.csv, several runs overlaid; bad input exits 2."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from framework.cli import main

COLUMNS = [
    "step",
    "lr-AdamW",
    "perf/memory_peak_gib",
    "perf/samples_per_sec",
    "perf/steps_per_sec",
    "perf/tokens_per_sec",
    "train/loss",
    "val/loss",
]


def fake_run(root: Path, name: str, rows: list[dict[str, float]], columns=COLUMNS) -> Path:
    """A run directory whose metrics.csv holds `rows` (absent cells empty, as the logger writes)."""
    run = root / name
    run.mkdir(parents=True)
    with (run / "metrics.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return run


def full_rows(scale: float) -> list[dict[str, float]]:
    rows = []
    for step in range(20):
        row = {"step": step, "train/loss": scale * 2.0 / (step + 1), "lr-AdamW": 1e-3}
        if step % 10 == 9:
            row |= {"val/loss": scale * 1.5 / (step + 1), "perf/steps_per_sec": 9.0 + scale}
            row |= {"perf/samples_per_sec": 300.0 * scale, "perf/tokens_per_sec": 4e4 * scale}
            row |= {"perf/memory_peak_gib": 1.2 * scale}
        rows.append(row)
    return rows


def image(path: Path):
    import matplotlib.image

    assert path.is_file()
    assert 10_000 < path.stat().st_size < 2_000_000, path.stat().st_size
    return matplotlib.image.imread(path)


def test_one_run_gives_metrics_png_in_the_run_dir(tmp_path):
    run = fake_run(tmp_path, "ddp", full_rows(1.0))
    assert main(["plot", str(run)]) == 0
    pixels = image(run / "metrics.png")
    assert pixels.ndim == 3 and pixels.shape[1] == 800  # 8 in wide at 100 dpi
    assert pixels.shape[0] == 3 * 280, "three panels: loss, throughput, memory"


def test_runs_overlaid_in_compare_png_and_empty_panels_left_out(tmp_path):
    ddp = fake_run(tmp_path, "ddp", full_rows(1.0))
    only_loss = [{"step": s, "train/loss": 1.0 / (s + 1)} for s in range(5)]
    fsdp = fake_run(tmp_path, "fsdp", only_loss, columns=["step", "train/loss"])
    assert main(["plot", str(ddp), str(fsdp)]) == 0
    assert image(tmp_path / "compare.png").shape[0] == 3 * 280
    assert main(["plot", str(fsdp), "--out", str(tmp_path / "out" / "loss.png")]) == 0
    assert image(tmp_path / "out" / "loss.png").shape[:2] == (280, 800), "the loss panel only"


@pytest.mark.parametrize(
    "case,key",
    [
        ("no run", "RUN_DIR=None: no run directory given"),
        ("a file", "not a directory"),
        ("no metrics.csv", "holds no metrics.csv"),
        ("header only", "has no rows with figures"),
        ("no figures to draw", "no train/loss, val/loss"),
        ("out not png", "--out="),
        ("unknown option", "option=--dpi: unknown option"),
    ],
)
def test_bad_input_exits_2_naming_the_key(case, key, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "file.txt").write_text("x")
    header = fake_run(tmp_path, "header", [])
    lr_only = fake_run(tmp_path, "lr", [{"step": 0, "lr-AdamW": 1e-3}], ["step", "lr-AdamW"])
    args = {
        "no run": [],
        "a file": [str(tmp_path / "file.txt")],
        "no metrics.csv": [str(empty)],
        "header only": [str(header)],
        "no figures to draw": [str(lr_only)],
        "out not png": [str(header), "--out", str(tmp_path / "x.pdf")],
        "unknown option": [str(header), "--dpi", "300"],
    }[case]
    assert main(["plot", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err
    assert key in err, err
    assert not list(tmp_path.rglob("*.png")), "nothing drawn for a refused command"


def test_missing_matplotlib_names_the_install(tmp_path, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else find_spec(n, *a)
    )
    assert main(["plot", str(fake_run(tmp_path, "ddp", full_rows(1.0)))]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
