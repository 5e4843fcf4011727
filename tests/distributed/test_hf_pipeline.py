"""transformers causal LMs held by a plain LightningModule (no loss, no pipeline code of its own)
under strategies test_hf.py does not cover: pipeline stages cut from the model's pp_plan (1f1b,
interleaved, pp x fsdp, pp x tp) with the framework's causal-LM loss, Qwen2 under tensor and an
interleaved schedule balanced by time, Llama under zero3; each equals one process within 1e-5
for 10 steps (a layout is proven once, for one family: a plain task under ddp is
test_plain_lightning.py's). A cut into more stages than the model has layers is refused before
launch, naming its decoder-layer count."""

from __future__ import annotations

import json

import pytest
import transformers  # noqa: F401 (the hf extra: missing, these fail, not skip)

from tests.conftest import fw, losses, refused
from tests.distributed import test_hf

pytestmark = pytest.mark.slow
FAMILIES = {"llama": "tests.hf_tasks.PlainLlama", "qwen2": "tests.hf_tasks.PlainQwen2"}
# test_hf.py's settings (10 steps, CSV losses, deterministic), the family chosen per test
PLAIN = [a for a in test_hf.PLAIN if not a.startswith("task._target_=")]
PIPELINE = ["strategy=pipeline", "strategy.microbatches=2"]
INTERLEAVED = [*PIPELINE, "strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=2"]
# sequences per data rank: 8 a step in all (tp and pp ranks share their data rank's batch)
B8, B4 = "task.data.batch_size=8", "task.data.batch_size=4"
SHARDS = ["+callbacks.shards._target_=tests.tasks.ShardCounter", "+callbacks.shards.out=OUT"]


def train(family: str, *args: str, cwd) -> str:
    target = f"task._target_={FAMILIES[family]}"
    result = fw("train", *PLAIN, target, *args, "run.dir=run", cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Losses of one process, batch 8, per family (made when a test first asks for one)."""
    made: dict[str, dict[int, float]] = {}

    def reference(family: str) -> dict[int, float]:
        if family not in made:
            root = tmp_path_factory.mktemp(f"hf_{family}")
            train(family, B8, cwd=root)
            made[family] = losses(root / "run")
        return made[family]

    return reference


@pytest.mark.parametrize(
    ("family", "args"),
    [
        ("llama", [*PIPELINE, "strategy.schedule=1f1b", B8]),
        ("llama", [*INTERLEAVED, B8]),
        ("qwen2", [*INTERLEAVED, "strategy.balance=time", B8]),
        (
            "llama",
            [*PIPELINE, "strategy.pp=2", "strategy.fsdp=2", "trainer.devices=4", *SHARDS, B4],
        ),
        ("qwen2", ["strategy=tensor", B8, *SHARDS]),
        (
            "llama",
            [*PIPELINE, "strategy.pp=2", "strategy.tp=2", "trainer.devices=4", *SHARDS, B8],
        ),
        ("llama", ["strategy=zero3", B4]),
    ],
    ids=[
        "llama-pp2-1f1b",
        "llama-pp2-interleaved",
        "qwen2-pp2-interleaved-time",
        "llama-pp2xfsdp2",
        "qwen2-tp2",
        "llama-pp2xtp2",
        "llama-zero3",
    ],
)
def test_plain_task_reproduces_one_process(family, args, one_process, tmp_path):
    args = [a.replace("OUT", str(tmp_path)) for a in args]
    if "trainer.devices=4" not in args:
        args.append("trainer.devices=2")
    log = train(family, *args, cwd=tmp_path)
    got, want = losses(tmp_path / "run"), one_process(family)
    assert sorted(got) == sorted(want) and len(got) == 10
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)
    if "strategy=pipeline" in args:
        assert "Pipeline stages (first layers): lm.model.embed_tokens, " in log, log[-2000:]
    if SHARDS[0] in args:
        ranks = 4 if "trainer.devices=4" in args else 2
        for rank in range(ranks):
            counts = json.loads((tmp_path / f"shards-rank{rank}.json").read_text())
            # tp: all but the norms split; pp x fsdp: half of each stage's weights ("full"
            # counts the stage's own)
            assert counts["params"] <= 0.55 * counts["full"], counts


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_more_stages_than_layers_is_refused_naming_the_decoder_layers(
    family, tmp_path, monkeypatch, capsys
):
    args = [*PLAIN, f"task._target_={FAMILIES[family]}", *PIPELINE, "trainer.devices=2"]
    args += ["strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=3"]
    err = refused(args, tmp_path, monkeypatch, capsys)
    assert "6 stages (pp x virtual_stages) is more than the 4 layers" in err, err
    assert "2 decoder layers (lm.config.num_hidden_layers=2)" in err, err
