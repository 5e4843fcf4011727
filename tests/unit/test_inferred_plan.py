"""A tensor-parallel plan inferred from a model's structure (framework/parallel/infer.py) for a
model that declares none: which linears feed which through attention and the MLP, found by a
forward pass on the meta device; printed as a strategy.tp_plan a user can copy; torch's own
transformer layers planned by their family. Splitting by these plans reproduces one process:
tests/distributed/test_inferred_plans.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from framework.errors import ConfigError
from framework.parallel.infer import describe, infer_plan, plan_for, whole_reasons
from framework.parallel.keys import matches
from framework.strategies.parallel.checks import plan_syntax


class Attention(nn.Module):
    """A user's attention: q, k, v and output projections, heads left to the tensor (-1)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, dim = x.shape
        q, k, v = (p(x).view(b, t, -1, dim // self.heads).transpose(1, 2) for p in self.qkv())
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))

    def qkv(self):
        return self.q, self.k, self.v


class FixedHeads(Attention):
    """The same attention reshaped with its head count written out (nanoGPT's way): on a rank
    holding part of the features that reshape would cut heads, so it stays whole."""

    def forward(self, x):
        b, t, dim = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, dim // self.heads).transpose(1, 2) for p in self.qkv()
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, attention=Attention, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = attention(dim, heads)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class LM(nn.Module):
    """Embedding, blocks in a ModuleList, a head wider than its input."""

    def __init__(self, attention=Attention, dim: int = 32, heads: int = 4, tied=False) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, dim)
        self.blocks = nn.ModuleList([Block(attention, dim, heads) for _ in range(2)])
        self.head = nn.Linear(dim, 64, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


LAYER = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise"}
LAYER |= {"up": "colwise", "down": "rowwise"}


def test_a_users_attention_and_mlp_are_split_in_megatron_pairs_and_printed_to_copy():
    model = LM()
    inferred = infer_plan(model, tp=2)
    want = {"embed": "rowwise_embedding"}
    want |= {f"blocks.{i}.{k}": v for i in (0, 1) for k, v in LAYER.items()}
    want |= {"head": "colwise_gather"}
    assert inferred.plan == want and inferred.whole == {}
    printed = describe(inferred, model)
    entries = printed.removeprefix("strategy.tp_plan=[").removesuffix("]").split(",")
    assert "blocks.*.attn.q:colwise" in entries and len(entries) == 8, printed
    plan_syntax(entries)  # a valid strategy.tp_plan
    names = [n for n, _ in model.named_modules() if n]
    copied = {
        n: e.rpartition(":")[2] for e in entries for n in names if matches(e.rpartition(":")[0], n)
    }
    assert copied == want, "the printed plan, copied, splits exactly the inferred modules"


def test_a_sequential_mlp_is_still_a_column_row_pair():
    from recipes.digits.task import DigitsTask
    from tests.tasks import PlainTwoLayer

    assert plan_for(DigitsTask(hidden=32), 2).plan == {"net.0": "colwise", "net.3": "rowwise"}
    # layers called only from training_step: no forward to trace, nothing inferred
    assert plan_for(PlainTwoLayer(), 2).plan == {}


def test_attention_that_writes_its_head_count_stays_whole_and_says_why():
    inferred = infer_plan(LM(FixedHeads), tp=2)
    assert all("attn" not in name for name in inferred.plan)
    assert inferred.plan["blocks.0.up"] == "colwise" and inferred.plan["blocks.1.down"] == "rowwise"
    assert whole_reasons(inferred)[0] == (
        "blocks.*.attn.q's output cannot stay split: view gives its split dimension a fixed "
        "size (write -1 there)"
    )


def test_heads_that_do_not_divide_tp_stay_whole():
    inferred = infer_plan(LM(dim=48, heads=3), tp=2)
    assert "blocks.0.attn.q" not in inferred.plan and inferred.plan["blocks.0.up"] == "colwise"
    assert "groups its features in 3, which do not divide by tp=2" in whole_reasons(inferred)[0]
    assert infer_plan(LM(dim=48, heads=3), tp=3).plan["blocks.0.attn.q"] == "colwise"


def test_a_fused_projection_splits_only_when_heads_are_its_outer_dimension():
    from framework.nn.blocks import Attention as Fused  # q, k, v of one head side by side

    fused = Fused(32, 4)
    assert infer_plan(fused, 2).plan == {"qkv": "colwise", "proj": "rowwise"}  # its own plan

    class Chunked(Fused):  # all of q, then k, then v: a column split would mix them
        def forward(self, x):
            b, t, dim = x.shape
            q, k, v = (
                z.view(b, t, -1, self.head_dim).transpose(1, 2)
                for z in self.qkv(x).split(dim, dim=-1)
            )
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    inferred = infer_plan(Chunked(32, 4), 2)
    assert inferred.plan == {}
    assert "split splits it along its split features" in whole_reasons(inferred)[0]


def test_a_tied_head_is_split_like_its_embedding():
    model = LM(tied=True)
    plan = infer_plan(model, 2).plan
    assert plan["embed"] == "rowwise_embedding" and plan["head"] == "colwise_gather"


def test_tracing_leaves_the_model_and_the_random_state_as_they_were():
    from tests.torch_tasks import DemoTransformer

    task = DemoTransformer()
    before = {k: v.clone() for k, v in task.state_dict().items()}
    rng = torch.get_rng_state()
    plan_for(task, 2)
    assert torch.equal(torch.get_rng_state(), rng)
    # the demo sets these on its first forward: a trace's meta tensors must not stay there
    assert task.model.pos_encoder.pe is None and task.model.src_mask is None
    after = task.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)
    assert all(p.device.type == "cpu" for p in task.parameters())


def test_torch_layers_are_planned_by_their_family_and_the_rest_is_inferred():
    from framework.parallel.model import adapter_for
    from tests.torch_tasks import DemoTransformer

    task = DemoTransformer()
    adapter = adapter_for(task)
    assert [a.name for a in adapter.adapters] == ["declared", "torch"]
    known = adapter.tensor_plan(task)
    layer = "model.transformer.decoder.layers.1"
    assert known[f"{layer}.self_attn"] == "multihead_attention"
    assert known[f"{layer}.multihead_attn"] == "multihead_attention"
    assert known[f"{layer}.linear1"] == "colwise" and known[f"{layer}.linear2"] == "rowwise"
    assert adapter.blocks(task) == [
        *task.model.transformer.encoder.layers,
        *task.model.transformer.decoder.layers,
    ]
    inferred = plan_for(task, 2)
    assert inferred.plan == {
        "model.embedding": "rowwise_embedding",
        "model.decoder": "colwise_gather",
    }
    with pytest.raises(ConfigError, match="has 4 attention heads"):
        adapter.check_tensor(task, 3)
    with pytest.raises(ConfigError, match="no sequence-parallel form"):
        adapter.tensor_plan(task, sequence_parallel=True)


def test_a_model_with_declared_plans_is_not_inferred():
    from framework.nn.blocks import MLP

    model = nn.Sequential(MLP(16, 32), nn.Linear(16, 64))
    assert plan_for(model, 2).plan == {}  # its MLP declares a plan: nothing else is split


def test_bert_gets_attention_mlp_and_pooler_pairs():
    from tests.hf_tasks import PlainBert

    task = PlainBert()
    inferred = plan_for(task, 2)
    layer = "bert.bert.encoder.layer.1"
    for name in ("attention.self.query", "attention.self.key", "intermediate.dense"):
        assert inferred.plan[f"{layer}.{name}"] == "colwise"
    for name in ("attention.output.dense", "output.dense"):
        assert inferred.plan[f"{layer}.{name}"] == "rowwise"
    assert inferred.plan["bert.bert.pooler.dense"] == "colwise"
    assert inferred.plan["bert.classifier"] == "rowwise"
    assert inferred.plan["bert.bert.embeddings.word_embeddings"] == "rowwise_embedding"
    assert inferred.whole == {}
