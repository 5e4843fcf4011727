"""Context parallel (`strategy.cp`): gpt_tiny and moe_gpt_tiny with each sequence split over 2
or 4 processes reproduce one process, per-step losses within 1e-5 and the attention weights'
gradients at step 1 within 1e-6, in every composition: ulysses (cp=2), ring over cp=4,
allgather under cp=2 x fsdp=2, ring under cp=2 x tp=2 (tp inside cp), under pp=2 x cp=2 and
under cp=2 x ep=2 (moe_gpt; 4 processes but ulysses); with a quarter of the targets ignored
(all gpt runs but cp2xfsdp2: the chunks hold different counts, the loss is still the mean over
the sequences' tokens); in each, every rank embeds the positions of its own 2 chunks only and
its blocks hand on 64 / cp positions (equal losses alone would also come from every rank
computing the whole sequence); a kill -9 under cp=2 x fsdp=2 resumes bitwise; a cp checkpoint
moves to one process; bad settings are refused before launch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import QUIET, assert_resumed, fw, losses, metric_rows, read_metrics, refused
from tests.distributed.conftest import GPT
from tests.tasks import assert_sequence_share

pytestmark = pytest.mark.slow
COMMON = [*QUIET, "trainer.deterministic=true", "trainer.log_every_n_steps=1", "logger=[csv]"]
CP2 = ["strategy=fsdp", "strategy.cp=2"]
GRADS = ["+callbacks.grads._target_=tests.tasks.StepGrads"]  # grads-rank{r}.pt at step 1
# step 1 of every rank recorded and held to NCCL's rules (nccl-rules.json): the cp ring at
# cp=2 with a pipeline's sends, and with the experts' all-to-all
NCCL = ["+callbacks.nccl._target_=tests.tasks.RecordNcclRules"]
RECORDED = ("pp2xcp2", "cp2xep2")
# the positions every rank embeds and its blocks run at step 0 (sequence-rank{r}.json)
SHARE = ["+callbacks.share._target_=tests.tasks.SequenceShare"]
TEN = "trainer.max_steps=10"
VAL10 = "trainer.val_check_interval=10"
MOE = [
    "experiment=moe_gpt_tiny",
    "task.scheduler.name=constant",
    "trainer.val_check_interval=20",
    TEN,
]
ONE = ["strategy=ddp", "trainer.devices=1"]
# a quarter of each sequence's targets ignored: the cp ranks' chunks hold different counts
MASKED = ["task.data._target_=tests.tasks.PromptMaskedText"]
BATCH8 = ["task.data.batch_size=8", TEN]  # one data rank: masked8's batch
# name: (model and layout, the one-process run it reproduces (`one_process` of conftest, or a
# run of this module), steps). Each composition once; the modes spread over them.
RUNS = {
    "ulysses": (
        [
            *GPT,
            *MASKED,
            *CP2,
            "strategy.cp_mode=ulysses",
            "trainer.devices=2",
            "task.data.batch_size=8",
            TEN,
            VAL10,
        ],
        "masked8",
        10,
    ),
    "cp2xfsdp2": (  # 2 batches of 8 per step: gpt16; checkpoints at 5 and 10 (the kill's)
        [
            *GPT,
            *CP2,
            "strategy.cp_mode=allgather",
            "trainer.devices=4",
            "task.data.batch_size=8",
            TEN,
            "callbacks.checkpoint.every_n_steps=5",
        ],
        "gpt16",
        10,
    ),
    "pp2xcp2": (
        [
            *GPT,
            *MASKED,
            "strategy=pipeline",
            "strategy.pp=2",
            "strategy.fsdp=2",
            "strategy.cp=2",
            "trainer.devices=4",
            "task.data.batch_size=8",
            TEN,
        ],
        "masked8",
        10,
    ),
    "cp4": (  # ring over 4 ranks: each holds 2 chunks of 8 of every sequence
        [*GPT, *MASKED, "strategy=fsdp", "strategy.cp=4", "trainer.devices=4", *BATCH8],
        "masked8",
        10,
    ),
    "cp2xtp2": (  # tp inside cp: each cp rank's heads split over 2 tensor-parallel ranks
        [*GPT, *MASKED, *CP2, "strategy.tp=2", "trainer.devices=4", *BATCH8],
        "masked8",
        10,
    ),
    "cp2xep2": (  # fsdp=4 = ep 2 x cp 2: 2 data ranks of batch 8
        [*MOE, "strategy=fsdp", "strategy.ep=2", "strategy.cp=2", "trainer.devices=4"],
        "moe16",
        10,
    ),
    # one-process references of this module (conftest's `one_process` has gpt16)
    "masked8": ([*GPT, *MASKED, *ONE, "task.data.batch_size=8", TEN, VAL10], None, 10),
    "moe16": ([*MOE, *ONE, "task.data.batch_size=16"], None, 10),
}
GRADS_OF = {
    "ulysses": "masked8",
    "pp2xcp2": "masked8",
    "cp2xep2": "moe16",
    "cp4": "masked8",
    "cp2xtp2": "masked8",
}


def train(run, *args: str, cwd) -> str:
    result = fw("train", *COMMON, *args, f"run.dir={run}", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The run directory of `RUNS[name]`, trained on first use (once per module)."""
    root = tmp_path_factory.mktemp("context")

    def run(name: str):
        if not (root / name / "metrics.csv").exists():
            grads = GRADS if name in {*GRADS_OF, *GRADS_OF.values()} else []
            nccl = NCCL if name in RECORDED else []
            share = SHARE if RUNS[name][1] is not None else []  # the cp runs
            train(root / name, *RUNS[name][0], *grads, *nccl, *share, cwd=root)
        return root / name

    return run


def assert_same(run, want, steps: int) -> None:
    got = losses(run)
    assert sorted(got) == list(range(steps)), sorted(got)
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in got), (got, want)


def step_grads(run) -> dict[str, torch.Tensor]:
    """Every rank's saved step-1 gradients (under a pipeline each holds its stage's)."""
    grads = {}
    for path in sorted(run.glob("grads-rank*.pt")):
        grads.update(torch.load(path, weights_only=True))
    return grads


def reference_losses(name, trained, one_process) -> dict[int, float]:
    reference = RUNS[name][1]
    if reference in RUNS:
        return losses(trained(reference))
    return one_process[reference]


@pytest.mark.parametrize("name", ["ulysses", "cp2xfsdp2", "pp2xcp2", "cp2xep2", "cp4", "cp2xtp2"])
def test_split_sequences_train_as_one_process(name, trained, one_process):
    """Same global batch, per-step losses within 1e-5 of the one-process run."""
    run = trained(name)
    assert_same(run, reference_losses(name, trained, one_process), RUNS[name][2])
    if name == "cp2xep2":  # every token goes to the same experts (counts over all cp ranks)
        got, want = routing(run), routing(trained("moe16"))
        assert len(got) == 10 and got == want


@pytest.mark.parametrize("name", list(GRADS_OF))
def test_attention_gradients_at_step_1_equal_one_process(name, trained):
    """The whole gradient of every attention weight (q/k/v and output projections of each
    layer, after FSDP's reduction over the cp ranks) within 1e-6 of one process's."""
    got, want = step_grads(trained(name)), step_grads(trained(GRADS_OF[name]))
    assert len(want) == 8 and got.keys() == want.keys(), (sorted(got), sorted(want))
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-6, worst


@pytest.mark.parametrize(
    ("name", "cp"),
    [("ulysses", 2), ("cp2xfsdp2", 2), ("pp2xcp2", 2), ("cp2xep2", 2), ("cp4", 4), ("cp2xtp2", 2)],
)
def test_each_rank_holds_only_its_chunks_of_every_sequence(name, cp, trained):
    """Under every cp mode (ulysses, allgather at cp2xfsdp2, ring at cp4 and in the others'
    default) each rank embeds the positions of its 2 of the 2 x cp chunks of the 64 and every
    block it runs hands on 64 / cp positions: context parallel switched off (every rank on the
    whole sequence, FSDP averaging the same gradients) gives the same losses, but not this."""
    assert_sequence_share(trained(name), 2 if name == "ulysses" else 4, 64, cp)


def routing(run) -> list[dict[str, str]]:
    return [
        {k: v for k, v in row.items() if "/tokens_e" in k}
        for row in read_metrics(run)
        if row.get("moe/layer0/tokens_e0")
    ]


def val_loss(run) -> float:
    return float(next(r["val/loss"] for r in read_metrics(run) if r.get("val/loss")))


@pytest.mark.parametrize(
    ("name", "ops"),
    [("pp2xcp2", {"send", "recv_"}), ("cp2xep2", {"send", "recv_", "all_to_all_single"})],
)
def test_a_step_keeps_nccls_rules(name, ops, trained):
    """Gloo forgives what NCCL does not: every rank's step 1, recorded on the CPU, issues its
    point-to-point pairs batched (the cp ring at cp=2 sends to the rank it receives from) and
    hands the collectives of the would-be NCCL groups only tensors on the device, in forward
    and backward (framework/parallel/nccl_rules.py)."""
    found = json.loads((trained(name) / "nccl-rules.json").read_text())
    assert ops <= set(found["ops"]), found["ops"]
    assert found["violations"] == []


def test_validation_loss_counts_every_token_once(trained):
    want = val_loss(trained("masked8"))
    assert abs(val_loss(trained("ulysses")) - want) <= 1e-5


def test_cp_checkpoint_moves_to_one_process(trained, one_process, tmp_path):
    """cp=2 x fsdp=2's checkpoint at 10 continued on one process to 20 (gpt16's)."""
    shutil.copytree(trained("cp2xfsdp2"), tmp_path / "moved", symlinks=True)
    err = train(tmp_path / "moved", *GPT, *ONE, "task.data.batch_size=16", cwd=tmp_path)
    assert_resumed(err, tmp_path / "moved", 20, moved=True)
    assert_same(tmp_path / "moved", one_process["gpt16"], 20)


def test_kill_9_under_cp2_x_fsdp2_resumes_bitwise(trained, tmp_path):
    """SIGKILL of the whole job after step 7, restart from the checkpoint at 5: the losses and
    the final weights are bitwise the uninterrupted run's."""
    from framework.checkpoint.export import consolidated_state

    marker = tmp_path / "killed"
    kill = [
        "+callbacks.kill._target_=tests.tasks.KillAfterSave",
        "+callbacks.kill.step=7",
        f"+callbacks.kill.marker={marker}",
    ]
    args = [*RUNS["cp2xfsdp2"][0], *kill, f"run.dir={tmp_path / 'run'}"]
    first = fw("train", *COMMON, *args, cwd=tmp_path)
    assert first.returncode != 0 and marker.exists(), first.stderr[-3000:]
    err = train(tmp_path / "run", *args[:-1], cwd=tmp_path)
    assert "(step 5)" in err, err[-3000:]
    reference = trained("cp2xfsdp2")
    assert metric_rows(tmp_path / "run") == metric_rows(reference)
    last = "checkpoints/step00000010"
    a, b = consolidated_state(tmp_path / "run" / last), consolidated_state(reference / last)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


BASE = ["experiment=gpt_tiny", *CP2, "trainer.devices=2"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([*BASE, "task.model.block_size=66"], "task.model.block_size"),
        ([*BASE, "strategy.cp_mode=ulysses", "task.model.n_head=1"], "cp_mode=ulysses"),
        (
            ["experiment=gpt_tiny", "strategy=fsdp", "strategy.cp=3", "trainer.devices=2"],
            "borrows its ranks from the fsdp degree",
        ),
        (
            [
                "experiment=moe_gpt_tiny",
                "strategy=fsdp",
                "strategy.ep=2",
                "strategy.cp=2",
                "trainer.devices=2",
            ],
            "fsdp / ep = 1 left after strategy.ep=2",
        ),
        ([*BASE, "strategy.cp_mode=spiral"], "ring"),
        (["task=digits", *CP2, "trainer.devices=2"], "has no attention"),
    ],
    ids=[
        "length",
        "ulysses-heads",
        "cp-does-not-divide",
        "cp-x-ep-does-not-divide",
        "mode",
        "no-attention",
    ],
)
def test_bad_settings_are_refused_before_launch(args, says, workdir, monkeypatch, capsys):
    line = refused(args, workdir, monkeypatch, capsys)
    assert says in line, line


def test_fw_check_divides_activations_by_cp():
    """fw check simulates a cp rank on its chunks: for gpt at block_size 2048 its activations
    at cp=2 and cp=4 are at most 0.55x and 0.30x those of cp=1 (the same batch per rank, 4
    processes each)."""
    from framework.preflight.check import check

    gpt = ["task=gpt", "task.model.n_layer=2", "task.model.n_embd=64", "task.model.n_head=4"]
    base = [*gpt, "task.model.block_size=2048", "task.data.batch_size=2", "strategy=fsdp"]
    base += ["task.data.max_bytes=200000", "trainer.devices=4"]
    per_rank = {
        cp: max(r.activations for r in check([*base, f"strategy.cp={cp}"], quick=True).ranks)
        for cp in (1, 2, 4)
    }
    assert per_rank[2] <= 0.55 * per_rank[1], per_rank
    assert per_rank[4] <= 0.30 * per_rank[1], per_rank
