"""Pretrained transformers weights into a split model: a tiny Llama written by the test in
several safetensors files (with an index) trains under fsdp=2, tensor=2 and pipeline=2 from
exactly the weights `from_pretrained` gives one process, each rank reading only the slices it
holds; a resumed run continues from its checkpoint, not from the pretrained weights."""

from __future__ import annotations

import json

import pytest
import transformers  # noqa: F401 (the hf extra: missing, these fail, not skip)

from framework.integrations.hf.safetensors_io import weight_map
from tests.conftest import QUIET, fw, losses
from tests.hf_pretrained import BLOCK, periodic_corpus, reference_loss, write_llama, write_moe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """The model directory, the corpus, and the first step's loss of `from_pretrained` here."""
    root = tmp_path_factory.mktemp("hf_pretrained")
    model = write_llama(root / "llama", tied=True)  # the head reads the embedding's weight
    assert (model / "model.safetensors.index.json").is_file()
    assert len(list(model.glob("*.safetensors"))) > 2
    window = periodic_corpus(root / "corpus.txt")
    return {"model": model, "corpus": root / "corpus.txt", "loss": reference_loss(model, window)}


ONE_STEP = ["trainer.max_steps=1", "callbacks=none"]


def train(pretrained, cwd, *args: str):
    result = fw(
        "train",
        "task=hf_lm",
        f"task.model.pretrained={pretrained['model']}",
        "task.data.tokenizer=bytes",
        f"task.data.path={pretrained['corpus']}",
        f"task.data.block_size={BLOCK}",
        "task.data.batch_size=4",
        "task.scheduler.warmup_steps=0",
        "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=0",
        "logger=[csv]",
        *QUIET,
        *args,
        "run.dir=run",
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "run", result.stderr


def reports(run, ranks: int) -> list[dict]:
    return [json.loads((run / "pretrained" / f"rank{r}.json").read_text())[0] for r in range(ranks)]


def model_bytes(directory) -> int:
    return weight_bytes(directory, weight_map(directory))


def weight_bytes(directory, files) -> int:
    """Bytes of the tensors in `files`, all fp32."""
    import math

    from framework.integrations.hf.safetensors_io import read_header

    total = 0
    for name in set(files.values()):
        with open(directory / name, "rb") as fh:
            header, _ = read_header(fh)
        total += sum(math.prod(e["shape"]) * 4 for e in header.values())
    return total


@pytest.mark.parametrize(
    ("layout", "share"),
    [
        (["strategy=fsdp"], 0.5),
        (["strategy=tensor"], 0.55),  # the norms (320 of 93760 elements) are whole on both
        (["strategy=pipeline"], 0.62),  # the tied embedding is on the first and last stage
    ],
    ids=["fsdp2", "tensor2", "pipeline2"],
)
def test_pretrained_weights_load_into_a_split_model(pretrained, tmp_path, layout, share):
    run, _ = train(pretrained, tmp_path, *layout, *ONE_STEP, "trainer.devices=2")
    got = losses(run)
    assert sorted(got) == [0]
    assert abs(got[0] - pretrained["loss"]) <= 1e-5, (got[0], pretrained["loss"])
    total = model_bytes(pretrained["model"])
    per_rank = reports(run, 2)
    for r in per_rank:
        # a rank reads what it holds, no more: as the loader counts it, and as the kernel
        # counted the bytes its read calls returned (headers, a few KiB, come on top)
        assert r["bytes_read"] == r["local_bytes"] <= share * total + 64, (r, total)
        assert r["local_bytes"] <= r["io_read"] <= r["local_bytes"] + 64 * 1024, (r, total)
        print(
            f"{layout[0]} peak RSS while loading: +{r['peak_rss_delta']} B for {r['local_bytes']} B held"
        )
    if layout == ["strategy=fsdp"]:  # shards of dim 0 cover every weight exactly once
        assert sum(r["bytes_read"] for r in per_rank) == total


def test_one_process_loads_whole(pretrained, tmp_path):
    run, _ = train(pretrained, tmp_path, *ONE_STEP, "trainer.devices=1")
    assert abs(losses(run)[0] - pretrained["loss"]) <= 1e-5
    (report,) = reports(run, 1)
    assert report["bytes_read"] == model_bytes(pretrained["model"])


def test_a_resumed_run_continues_from_its_checkpoint(pretrained, tmp_path):
    """The pretrained weights are read before the checkpoint is restored over them: the resumed
    run's first step starts from the trained weights (read again, they would give step 0's loss)."""
    legs = ["strategy=fsdp", "trainer.devices=2", "callbacks.checkpoint.every_n_steps=2"]
    train(pretrained, tmp_path, *legs, "trainer.max_steps=2")
    run, log = train(pretrained, tmp_path, *legs, "trainer.max_steps=4")
    assert "Resuming from" in log
    got = losses(run)
    assert sorted(got) == [0, 1, 2, 3]
    assert abs(got[0] - pretrained["loss"]) <= 1e-5
    assert got[3] < got[2] < got[1] < got[0] - 1e-3, got


@pytest.fixture(scope="module")
def moe_models(pretrained, tmp_path_factory):
    """family -> (its directory: 8 experts per layer, written once when first asked; the first
    step's loss of `from_pretrained` on the corpus here)."""
    made = {}

    def model(family: str):
        if family not in made:
            directory = write_moe(tmp_path_factory.mktemp("hf_moe") / family, family, experts=8)
            window = periodic_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")
            made[family] = directory, reference_loss(directory, window)
        return made[family]

    return model


@pytest.mark.parametrize(
    ("family", "layout", "ranks"),
    [
        ("qwen3_moe", ["strategy=expert"], 2),
        ("mixtral", ["strategy=expert"], 2),
        # experts split over ep = 2, then by FSDP over the 2 ranks holding the same ones
        ("qwen3_moe", ["strategy=fsdp", "strategy.ep=2"], 4),
    ],
    ids=["qwen3_moe-ep2", "mixtral-ep2", "qwen3_moe-ep2xfsdp2"],
)
def test_a_pretrained_moe_model_loads_under_expert_parallel(
    pretrained, moe_models, tmp_path, family, layout, ranks
):
    """The files hold one tensor per expert (as transformers saves MoE models); under ep=2 (x
    fsdp=2) each rank reads only its own experts' tensors into the stacked (E, ...) weights it
    holds, and the first step's loss is `from_pretrained`'s on one process."""
    model, want = moe_models(family)
    assert any(".experts.7." in k for k in weight_map(model)), "per-expert tensors in the files"
    moe = {**pretrained, "model": model}
    run, _ = train(moe, tmp_path, *layout, *ONE_STEP, f"trainer.devices={ranks}")
    got = losses(run)
    assert sorted(got) == [0] and abs(got[0] - want) <= 1e-5, (got, want)
    per_rank = reports(run, ranks)
    # the dense weights sharded by FSDP, the experts split over ep (and efsdp): each rank reads
    # what it holds, its 1/ranks of every weight (all sizes divide by 4), no more
    total = model_bytes(model)
    assert all(r["bytes_read"] == r["local_bytes"] == total // ranks for r in per_rank), (
        per_rank,
        total,
    )
