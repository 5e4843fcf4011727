"""The plans the parallel core reads from transformers models (framework.integrations.hf.plans): tensor-parallel
entries at their path in the task, styles it cannot apply refused, config entries replacing
the model's own, FSDP units from `_no_split_modules`."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from framework.errors import ConfigError
from framework.integrations.hf.plans import tensor_plan as hf_plan
from framework.parallel.fsdp import units
from framework.parallel.transforms import ModelTransforms, blocks


class Holder(nn.Module):
    """A task's module tree: the transformers model one level down, as in a LightningModule."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.lm = model


def tiny(cls, config_cls, **kw) -> Holder:
    torch.manual_seed(0)
    return Holder(cls(config_cls(vocab_size=64, **kw)))


def llama() -> Holder:
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2}
    return tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig, **shape, **heads)


def test_llama_plan_at_its_path_in_the_task():
    plan = hf_plan(llama())
    assert plan["lm.model.layers.1.self_attn.q_proj"] == "colwise"
    assert plan["lm.model.layers.0.mlp.down_proj"] == "rowwise"
    assert plan["lm.model.embed_tokens"] == "rowwise_embedding"
    assert plan["lm.lm_head"] == "colwise_gather"
    # the attention and the MLP take their input once, as a replicated DTensor (one all-reduce
    # of its gradient per module in backward, not one per column-split linear)
    assert plan["lm.model.layers.0.self_attn"] == plan["lm.model.layers.1.mlp"] == "replicate_input"
    assert len(plan) == 2 + 2 * (7 + 2)  # embedding, head, per layer 7 projections + 2 inputs


def test_a_config_entry_replaces_the_model_entry_for_its_module_only():
    plan = hf_plan(llama(), skip=["lm.model.layers.0.mlp.up_proj"])
    assert "lm.model.layers.0.mlp.up_proj" not in plan
    assert plan["lm.model.layers.1.mlp.up_proj"] == "colwise"


def qwen3_moe() -> Holder:
    return tiny(
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )


def test_a_style_the_framework_cannot_apply_is_refused_naming_it_and_its_module():
    with pytest.raises(ConfigError, match=r"lm.model.layers.0.mlp.experts.*'moe_tp_experts'"):
        hf_plan(qwen3_moe())


def test_under_expert_parallel_tp_splits_the_attention_and_leaves_the_experts_to_ep():
    plan = hf_plan(qwen3_moe(), experts=["lm.model.layers.0.mlp"])
    assert not [name for name in plan if ".mlp." in name], plan
    assert plan["lm.model.layers.0.self_attn.o_proj"] == "rowwise"
    # Qwen3's per-head norms: weights whole, gradients summed over the ranks
    assert plan["lm.model.layers.0.self_attn.q_norm"] == "replicated_grad_sum"
    assert plan["lm.model.layers.0.self_attn.k_norm"] == "replicated_grad_sum"


def test_sequence_parallel_splits_the_residual_stream_between_the_decoder_layers():
    plan = hf_plan(llama(), sequence_parallel=True)
    layer = "lm.model.layers.1."
    assert plan["lm.model.layers.0"] == "split_sequence_input"  # the first layer only
    assert "lm.model.layers.1" not in plan
    assert plan[layer + "input_layernorm"] == plan[layer + "post_attention_layernorm"] == "sequence"
    assert plan[layer + "self_attn"] == plan[layer + "mlp"] == "gather_sequence_input"
    assert plan[layer + "self_attn.q_proj"] == plan[layer + "mlp.up_proj"] == "colwise"
    assert plan[layer + "self_attn.o_proj"] == "rowwise_scatter_sequence"
    assert plan[layer + "mlp.down_proj"] == "rowwise_scatter_sequence"
    assert plan["lm.model.norm"] == "sequence"
    assert plan["lm.model.embed_tokens"] == "rowwise_embedding"  # before the split
    assert plan["lm.lm_head"] == "colwise_gather_from_sequence"
    both = hf_plan(llama(), sequence_parallel=True, loss_parallel=True)
    assert both["lm.lm_head"] == "colwise_sharded_logits_from_sequence"
    assert hf_plan(llama(), loss_parallel=True)["lm.lm_head"] == "colwise_sharded_logits"


def test_sequence_parallel_is_refused_where_a_module_would_see_only_its_positions():
    with pytest.raises(ConfigError, match=r"lm.lm_head is a head its plan does not split"):
        hf_plan(llama(), skip=["lm.lm_head"], sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"layers.0.mlp holds weights that its plan does not"):
        hf_plan(llama(), skip=["lm.model.layers.0.mlp.*"], sequence_parallel=True)
    gpt2 = tiny(
        transformers.GPT2LMHeadModel, transformers.GPT2Config, n_embd=16, n_layer=1, n_head=2
    )
    with pytest.raises(ConfigError, match=r"module lm has no tensor-parallel plan of its own"):
        hf_plan(gpt2, sequence_parallel=True)


def test_fsdp_and_checkpointing_units_are_the_no_split_blocks_not_every_module_list_member():
    # T5's blocks hold a ModuleList of their sublayers: the ModuleList rule alone made those units
    t5 = tiny(
        transformers.T5ForConditionalGeneration,
        transformers.T5Config,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
    )
    assert names(units(t5)) == ["T5Block", "T5Block", "T5ForConditionalGeneration"]
    assert names(blocks(t5)) == ["T5Block", "T5Block"]  # checkpointed and compiled one by one


def names(modules: list[nn.Module]) -> list[str]:
    return [type(m).__name__ for m in modules]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_checkpointed_llama_gives_the_gradients_of_the_plain_one(mode):
    """A recomputed decoder layer must not add its keys and values to the cache its forward
    filled (transformers keeps one by default): selective checkpointing then failed in the first
    backward, its recompute running other operations than the forward."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for transform in (None, ModelTransforms(mode)):
        task = llama()
        assert task.lm.config.use_cache  # transformers' default
        if transform is not None:
            assert transform.apply(task) == 2
        task.lm(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad for p in task.parameters()])
    for plain, checkpointed in zip(*grads, strict=True):
        torch.testing.assert_close(checkpointed, plain)
