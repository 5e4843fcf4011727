"""Context parallel for transformers models (framework/integrations/hf/context_parallel.py): a plain LightningModule
holding a Llama (grouped-query attention, rotary positions, transformers' own shifted loss) with
each sequence split over 2 processes reproduces one process at the same global batch, by
ulysses under cp=2 and by ring under pp=2 x cp=2 (pipeline stages cut from the model's pp_plan,
4 processes), with no change to the task; a model whose attention cannot be split, or a data
module whose sequence length does not split into 2 x cp chunks, is refused before launch,
naming the setting."""

from __future__ import annotations

import pytest
import transformers  # noqa: F401 (the hf extra: missing, these fail, not skip)

from tests.conftest import QUIET, fw, losses, refused
from tests.hf_tasks import PlainLlama
from tests.tasks import assert_sequence_share

pytestmark = pytest.mark.slow
PLAIN = [
    "task=digits",
    "~task.model.dropout",
    "task.model.hidden=64",
    "task.data._target_=tests.hf_tasks.RandomTokens",
    "~task.data.val_fraction",
    "task.data.batch_size=8",
    "trainer.max_steps=10",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "logger=[csv]",
    "callbacks=none",
    *QUIET,
]
CP2 = ["strategy=fsdp", "strategy.cp=2", "trainer.devices=2"]
SHARE = "+callbacks.share._target_=tests.tasks.SequenceShare"  # sequence-rank{r}.json
# 2 stages, each split over 2 cp ranks (which FSDP shards over); 2 microbatches of 4 sequences
PP2XCP2 = [
    "strategy=pipeline",
    "strategy.pp=2",
    "strategy.fsdp=2",
    "strategy.cp=2",
    "strategy.microbatches=2",
    "trainer.devices=4",
]


class SlidingMistral(PlainLlama):
    """A Mistral whose attention looks back 8 positions only (a sliding window)."""

    family = ("MistralConfig", "MistralForCausalLM")
    extra = {"sliding_window": 8}


class DroppingLlama(PlainLlama):
    """A Llama that drops attention weights in training."""

    extra = {"attention_dropout": 0.1}


def train(*args: str, cwd, family: str = "tests.hf_tasks.PlainLlama") -> dict[int, float]:
    result = fw("train", f"task._target_={family}", *PLAIN, *args, "run.dir=run", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(cwd / "run")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Losses of one process, batch 8 (the cp ranks of a group read the same 8 sequences)."""
    return train(cwd=tmp_path_factory.mktemp("hf_cp_one"))


@pytest.mark.parametrize(
    "layout",
    [[*CP2, "strategy.cp_mode=ulysses"], [*PP2XCP2, "strategy.cp_mode=ring"]],
    ids=["ulysses", "pp2xcp2-ring"],
)
def test_llama_split_over_the_sequence_trains_as_one_process(one_process, layout, tmp_path):
    """The same losses as one process at the same 8 sequences a step; under a pipeline the
    decoder layers take the chunks' positions and the stages' loss their shifted labels. Each
    rank's rotary embedding takes the positions of its 2 of the 4 chunks of the 16, and its
    decoder layers hand on 8 positions (the same losses come from every rank computing the
    whole sequence)."""
    got = train(*layout, SHARE, cwd=tmp_path)
    assert sorted(got) == sorted(one_process) and len(got) == 10
    assert all(abs(got[s] - one_process[s]) <= 1e-5 for s in got), (got, one_process)
    assert_sequence_share(tmp_path / "run", 4 if PP2XCP2[0] in layout else 2, 16, 2)


@pytest.mark.parametrize(
    ("family", "says"),
    [("SlidingMistral", "lm.config.sliding_window"), ("DroppingLlama", "attention_dropout")],
)
def test_attention_that_cannot_be_split_is_refused(family, says, tmp_path, monkeypatch, capsys):
    task = f"task._target_=tests.distributed.test_hf_context.{family}"
    line = refused([task, *PLAIN, *CP2], tmp_path, monkeypatch, capsys)
    assert says in line and "strategy.cp" in line, line


def test_sequence_length_that_does_not_split_is_refused(tmp_path, monkeypatch, capsys):
    """cp=2 cuts every sequence into 4 chunks: the data module's length 18 (RandomTokens'
    `length`) is refused before launch, not at the first step."""
    args = ["task._target_=tests.hf_tasks.PlainLlama", *PLAIN, *CP2, "+task.data.length=18"]
    line = refused(args, tmp_path, monkeypatch, capsys)
    assert "task.data.length=18" in line and "2 x cp = 4" in line, line
