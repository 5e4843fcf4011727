"""transformers' sparse MoE blocks swapped for framework MoE layers (framework.integrations.hf.sparse_moe): the
swapped model computes what transformers computes (logits, loss, the auxiliary loss from the
router logits it records, every gradient), holds the same tensors under the same names, counts
the routers' choices; blocks the swap would not reproduce and experts that do not divide by ep
are refused before launch, naming the block."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from framework.errors import ConfigError
from framework.integrations.hf.sparse_moe import sparse_blocks, swap_sparse_blocks
from framework.parallel.experts import moe_layers
from tests.conftest import QUIET, refused
from tests.hf_moe_tasks import mixtral_config, qwen3_moe_config


class Holder(nn.Module):
    """A task's module tree: the transformers model one level down, as in a LightningModule."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.lm = model


MODELS = {
    "qwen3_moe-normalised": lambda: transformers.Qwen3MoeForCausalLM(
        qwen3_moe_config(norm_topk_prob=True, output_router_logits=True)
    ),
    "qwen3_moe-raw-top-k": lambda: transformers.Qwen3MoeForCausalLM(
        qwen3_moe_config(norm_topk_prob=False, output_router_logits=True)
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(mixtral_config(output_router_logits=True)),
}


@pytest.mark.parametrize("family", list(MODELS))
def test_the_swap_computes_what_transformers_computes(family):
    torch.manual_seed(0)
    theirs = Holder(MODELS[family]())
    ours = copy.deepcopy(theirs)
    before = ours.state_dict()
    layers = swap_sparse_blocks(ours, ep=2)
    assert len(layers) == 2 and moe_layers(ours) == layers
    after = ours.state_dict()
    assert list(after) == list(before), "same names, same order"
    assert all(after[k].data_ptr() == before[k].data_ptr() for k in before), "same tensors"
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    want, got = theirs.lm(input_ids=ids, labels=ids), ours.lm(input_ids=ids, labels=ids)
    assert (got.logits - want.logits).abs().max() <= 1e-6
    assert abs(got.loss - want.loss) <= 1e-6 and abs(got.aux_loss - want.aux_loss) <= 1e-6
    assert want.aux_loss > 0, "the router logits were recorded, the aux loss added"
    for a, b in zip(got.router_logits, want.router_logits, strict=True):
        assert (a - b).abs().max() <= 1e-6
    want.loss.backward()
    got.loss.backward()
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert (p.grad - grads[name].grad).abs().max() <= 1e-6, name
    top_k = theirs.lm.config.num_experts_per_tok
    for layer, logits in zip(layers, want.router_logits, strict=True):
        chosen = logits.softmax(-1).topk(top_k).indices
        counted = torch.bincount(chosen.flatten(), minlength=4).float()
        assert torch.equal(layer.router.tokens_per_expert, counted)


def test_blocks_are_read_from_the_models_ep_plan_at_their_path_in_the_task():
    torch.manual_seed(0)
    task = Holder(transformers.MixtralForCausalLM(mixtral_config()))
    found = sparse_blocks(task, ep=2)
    assert [(b.path, b.router_name, b.num_experts) for b in found] == [
        ("lm.model.layers.0.mlp", "gate", 4),
        ("lm.model.layers.1.mlp", "gate", 4),
    ]
    swap_sparse_blocks(task, ep=2)
    assert sparse_blocks(task, ep=2) == [], "a swapped block is not swapped again"
    task.lm.ep_plan = {}
    assert sparse_blocks(Holder(task.lm), ep=2) == [], "no plan, no experts"


def qwen2_moe() -> nn.Module:
    config = transformers.Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.Qwen2MoeForCausalLM(config)


def test_blocks_the_swap_would_not_reproduce_are_refused_naming_them():
    with pytest.raises(ConfigError) as shared:
        sparse_blocks(Holder(qwen2_moe()), ep=2)
    text = str(shared.value)
    assert "strategy.ep=2" in text and "lm.model.layers.0.mlp (Qwen2MoeSparseMoeBlock)" in text
    assert "shared_expert" in text, text
    mixtral = transformers.MixtralForCausalLM(mixtral_config(router_jitter_noise=0.1))
    with pytest.raises(ConfigError, match="lm.model.layers.0.mlp .* jitter noise"):
        sparse_blocks(Holder(mixtral), ep=2)
    mixtral.ep_plan = {**mixtral.ep_plan, "model.layers.*.mlp.gate": "colwise"}
    with pytest.raises(ConfigError, match=r"lm.model.layers.\*.mlp.gate its ep plan .*'colwise'"):
        sparse_blocks(Holder(mixtral), ep=2)


PLAIN = [
    "task=digits",
    "task._target_=tests.hf_moe_tasks.PlainMoE",
    "~task.model.dropout",
    "task.data._target_=tests.hf_tasks.RandomTokens",
    "~task.data.val_fraction",
    "strategy=expert",
    "trainer.devices=2",
    *QUIET,
]


def test_experts_not_dividing_by_ep_are_refused_before_launch(tmp_path, monkeypatch, capsys):
    args = [*PLAIN, "+task.model.family=qwen3_moe", "+task.model.experts=3"]
    err = refused(args, tmp_path, monkeypatch, capsys)
    assert "strategy.ep=2: the transformers MoE block lm.model.layers.0.mlp has 3 experts" in err
    assert "Valid choices: 1, 3" in err, err


def test_a_block_the_framework_cannot_apply_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    args = [*PLAIN, "+task.model.family=mixtral", "+task.model.jitter=0.01"]
    err = refused(args, tmp_path, monkeypatch, capsys)
    assert "lm.model.layers.0.mlp (MixtralSparseMoeBlock)" in err and "jitter" in err, err


def test_a_pipeline_refuses_a_moe_model_adding_its_routers_auxiliary_loss(
    tmp_path, monkeypatch, capsys
):
    """Under pp > 1 the last stage computes the loss from hidden states: transformers' auxiliary
    loss, made from every layer's router logits, would silently drop out of it."""
    plain = [a for a in PLAIN if not a.startswith(("strategy=", "trainer.devices="))]
    args = [*plain, "+task.model.family=qwen3_moe", "strategy=pipeline", "trainer.devices=2"]
    err = refused([*args, "+task.model.router_logits=true"], tmp_path, monkeypatch, capsys)
    assert "lm.config.output_router_logits=True" in err and "strategy.pp=2" in err, err
    assert "Valid choices: false" in err, err


@pytest.mark.parametrize(
    ("family", "layout", "shown"),
    [
        ("mixtral", ["strategy=fsdp"], "fsdp=4 x ep=2, 4 processes"),
        ("qwen3_moe", ["strategy=fsdp_tp"], "fsdp=2 x tp=2 x ep=2, 4 processes"),
        (
            "qwen3_moe",
            ["strategy=pipeline", "strategy.pp=2", "strategy.fsdp=2", "strategy.microbatches=2"],
            "pp=2 x fsdp=2 x ep=2, 4 processes",
        ),
    ],
    ids=["ep2xfsdp", "ep2xtp2", "pp2xep2"],
)
def test_fw_check_simulates_the_swapped_layers(
    family, layout, shown, tmp_path, monkeypatch, capsys
):
    """fw check runs the same swap inside its fake tensors, before the tensor plans, as fw train
    does: the counts the swap adds are fake too (a real one failed FSDP's move to the simulated
    device: exit 2, 'rank 0 would fail'), under ep x tp the experts are split by ep, not
    refused as the model's tp plan styles them (moe_tp_experts), and under pp x ep the stages'
    inputs are found with the experts passing their input through (routing fake tokens has
    data-dependent shapes: DynamicOutputShapeException, exit 2)."""
    from framework.cli import main

    monkeypatch.chdir(tmp_path)
    plain = [a for a in PLAIN if not a.startswith(("strategy=", "trainer.devices="))]
    args = [*plain, f"+task.model.family={family}", "task.data.batch_size=2"]
    code = main(["check", *args, *layout, "strategy.ep=2", "trainer.devices=4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert shown in out, out


def test_a_block_computing_more_than_its_structure_shows_is_not_swapped(monkeypatch):
    """The swap checks the layer against the block's own forward on random tokens: a block
    that, say, scales its output is refused rather than trained as another function."""
    model = transformers.MixtralForCausalLM(mixtral_config())
    block = type(model.model.layers[0].mlp)
    forward = block.forward
    monkeypatch.setattr(block, "forward", lambda self, hidden: 2 * forward(self, hidden))
    state = torch.random.get_rng_state()
    with pytest.raises(ConfigError, match="model.layers.0.mlp .* computes something else"):
        swap_sparse_blocks(Holder(model), ep=2)
    monkeypatch.setattr(block, "forward", forward)
    assert len(swap_sparse_blocks(Holder(model), ep=2)) == 2
    assert torch.equal(torch.random.get_rng_state(), state), "no random state drawn"
    assert model.training and model.model.layers[0].mlp.gate.training, "modes restored"


def test_sequence_parallel_runs_a_moe_block_ep_splits_whole_on_the_gathered_sequence():
    """Under ep x tp with sequence parallel each MoE block takes the whole sequence, gathered,
    and hands on this rank's positions; the rest of the layer is split as in a dense model."""
    from framework.integrations.hf.plans import tensor_plan as hf_plan

    torch.manual_seed(0)
    task = Holder(transformers.Qwen3MoeForCausalLM(qwen3_moe_config()))
    blocks = [b.path for b in sparse_blocks(task, ep=2)]
    plan = hf_plan(task, sequence_parallel=True, experts=blocks)
    for i in (0, 1):
        layer = f"lm.model.layers.{i}"
        assert plan[f"{layer}.mlp"] == "gather_sequence_whole"
        assert not [k for k in plan if k.startswith(f"{layer}.mlp.")], plan
        assert plan[f"{layer}.self_attn"] == "gather_sequence_input"
        assert plan[f"{layer}.self_attn.o_proj"] == "rowwise_scatter_sequence"
        assert plan[f"{layer}.post_attention_layernorm"] == "sequence"
    assert plan["lm.model.layers.0"] == "split_sequence_input"
    swap_sparse_blocks(task, ep=2)  # in the workers: the swapped layers are found as such
    assert hf_plan(task, sequence_parallel=True) == plan
    with pytest.raises(ConfigError, match=r"lm.model.layers.0.mlp.experts.*'moe_tp_experts'"):
        hf_plan(Holder(transformers.Qwen3MoeForCausalLM(qwen3_moe_config())), (), True)


def test_sequence_parallel_names_the_module_and_the_style_it_has_no_form_for():
    from framework.integrations.hf.plans import tensor_plan as hf_plan

    config = transformers.Phi3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    task = Holder(transformers.Phi3ForCausalLM(config))
    with pytest.raises(ConfigError) as refusal:
        hf_plan(task, sequence_parallel=True)
    text = str(refusal.value)
    assert text.startswith("strategy.sequence_parallel=True: "), text
    named = "module lm.model.layers.0.self_attn.o_proj has the style 'rowwise_split_input'"
    assert named in text and "(the framework's rowwise_from_replicated)" in text, text
