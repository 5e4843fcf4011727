"""trainer.float8: which layers torchao's float8 takes (the documented rule and its override),
names and checkpoints left as they were, the swap through the one ModelTransforms every strategy
applies, and the refusal of a GPU without float8 before launch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from framework.parallel import float8
from framework.parallel.transforms import ModelTransforms
from recipes.gpt.model import GPT
from tests.conftest import refused

TENSORWISE = float8.Float8Settings("tensorwise", float8.DEFAULT_SKIP, emulate=True)


class WithHeads(nn.Module):
    """Linear layers of every kind the rule decides on."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.up = nn.Linear(64, 256)  # converted
        self.odd = nn.Linear(64, 100)  # 100 is no multiple of 16
        self.small = nn.Linear(64, 32)  # below MIN_FEATURES
        self.router = nn.ModuleDict({"gate": nn.Linear(64, 64)})  # an MoE router, by name
        self.head = nn.Linear(64, 128)  # the output head, by name
        self.tied = nn.Linear(64, 100, bias=False)
        self.tied.weight = self.embed.weight  # a weight shared with the embedding


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)


def test_the_rule_takes_hidden_linears_and_leaves_heads_routers_and_odd_shapes():
    model = WithHeads()
    assert float8.chosen(model, float8.DEFAULT_SKIP) == ["up"]
    # the module-name filter replaces the default: the head and the router are taken too
    assert float8.chosen(model, ()) == ["up", "router.gate", "head"]
    assert float8.chosen(gpt(), float8.DEFAULT_SKIP) == [
        f"blocks.{i}.{m}" for i in (0, 1) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    ]  # framework.nn's LMHead (tied to the token embedding) is not a plain nn.Linear


def test_the_swap_keeps_every_name_and_a_checkpoint_reads_into_either_model():
    plain, converted = gpt(), gpt()
    assert ModelTransforms(float8=TENSORWISE).apply(converted) == 0  # no AC/compile blocks
    assert len(float8.converted(converted)) == 8
    assert [n for n, _ in converted.named_parameters()] == [n for n, _ in plain.named_parameters()]
    state = converted.state_dict()
    assert all(type(t) is torch.Tensor for t in state.values())  # ordinary weights
    again = gpt()
    again.load_state_dict(state)  # into a model without float8, by name
    ModelTransforms(float8=TENSORWISE).apply(plain)
    plain.load_state_dict(copy.deepcopy(again.state_dict()))  # and into float8 again


def test_float8_numbers_are_torchaos_emulated_ones_and_repeat_bitwise():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    x = torch.randint(0, 256, (2, 32))
    ours, theirs = gpt(), gpt()
    ModelTransforms(float8=TENSORWISE).apply(ours)
    names = set(float8.chosen(theirs, float8.DEFAULT_SKIP))
    convert_to_float8_training(
        theirs, config=Float8LinearConfig(emulate=True), module_filter_fn=lambda m, n: n in names
    )
    assert torch.equal(ours(x), theirs(x))
    assert torch.equal(ours(x), ours(x))
    assert not torch.equal(ours(x), gpt()(x))  # float8 rounding changes the numbers


def test_a_second_swap_converts_nothing_more():
    model = gpt()
    transforms = ModelTransforms(float8=TENSORWISE)
    assert transforms.convert_float8(model) == 8
    assert transforms.convert_float8(model) == 0  # parallelize's swap, then apply's
    assert ModelTransforms().convert_float8(gpt()) == 0  # trainer.float8=none


def test_the_float8_all_gather_is_asked_for_tensorwise_only():
    assert float8.torchao_config(TENSORWISE, True).enable_fsdp_float8_all_gather
    assert not float8.torchao_config(TENSORWISE, False).enable_fsdp_float8_all_gather
    rowwise = float8.Float8Settings("rowwise", (), emulate=True)
    assert not float8.torchao_config(rowwise, True).enable_fsdp_float8_all_gather
    assert float8.torchao_config(rowwise, True).emulate


def pretend_gpus(monkeypatch, capability):
    """This process sees CUDA devices of `capability` (none is touched)."""
    from framework.config import validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    monkeypatch.setattr(validate, "cuda_device_count", lambda: 2)


def test_a_gpu_without_float8_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    pretend_gpus(monkeypatch, (8, 0))  # an A100
    args = ["experiment=gpt_tiny", "trainer.accelerator=gpu", "trainer.float8=tensorwise"]
    err = refused(args, tmp_path, monkeypatch, capsys)
    assert err.startswith(
        "error: trainer.float8=tensorwise: this GPU (compute capability 8.0) has no float8 "
        "matmuls; float8 training needs capability 8.9 or newer"
    ), err


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_ada_hopper_and_blackwell_pass(monkeypatch, capability):
    from omegaconf import OmegaConf

    from framework.world import World

    pretend_gpus(monkeypatch, capability)
    trainer = OmegaConf.create({"float8": "tensorwise"})
    float8.check(trainer, World(2, 2, 1, "cuda"))  # no error


def test_float8_without_torchao_is_refused_with_the_extra_to_install(monkeypatch):
    import importlib.util

    from omegaconf import OmegaConf

    from framework.errors import ConfigError
    from framework.world import World

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'framework\[float8\]'"):
        float8.check(OmegaConf.create({"float8": "rowwise"}), World(1, 1, 1, "cpu"))
