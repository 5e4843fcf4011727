"""framework.optim.Muon in one process: torch's Muon on the hidden 2-D weights and torch's AdamW
on the rest, bitwise; which parameters go where (the documented rule); `task.optimizer` naming
it (or torch's Muon) with one override; its state in the parameters' shapes."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from framework.optim.muon import Muon, hidden_matrices, split_groups
from framework.parallel import float8
from framework.parallel.transforms import ModelTransforms
from recipes.gpt.task import GPTTask

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32}


def task(**optimizer) -> GPTTask:
    torch.manual_seed(0)
    made = GPTTask(**TINY)
    config = {"_target_": "framework.optim.Muon", "lr": 0.02, "weight_decay": 0.1, **optimizer}
    made.configure_from(config, {"name": "constant"})
    return made


def step(model, optimizers, batch, steps: int = 3) -> None:
    x, y = batch
    for _ in range(steps):
        for o in optimizers:
            o.zero_grad()
        model.loss(model(x), y).backward()
        for o in optimizers:
            o.step()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g)


def test_the_rule_gives_muon_the_hidden_matrices_and_adamw_the_rest():
    model = task()
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[i] for i in hidden_matrices(model))
    assert muon == sorted(
        f"model.blocks.{i}.{m}.weight"
        for i in (0, 1)
        for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    )  # not the embeddings, the head (tied to the token embedding), norms or biases
    groups = split_groups(model, model.param_groups())
    assert [(g["use_muon"], g.get("weight_decay")) for g in groups] == [
        (True, None),  # the task's decay group: its hidden weights
        (False, None),  # its embeddings (and the tied head)
        (False, 0.0),  # the task's no-decay group keeps its setting
    ]
    # a head by name, or by a weight tied to an embedding, whatever its class
    other = torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(10, 16),
            "hidden": torch.nn.Linear(16, 16),
            "decoder": torch.nn.Linear(16, 10),
            "lm_head": torch.nn.Linear(16, 10),
            "output": torch.nn.Linear(16, 10),
        }
    )
    other.decoder.weight = other.embed.weight
    assert hidden_matrices(other) == {id(other.hidden.weight)}
    # float8's layers are linear layers too
    ModelTransforms(float8=float8.Float8Settings("tensorwise", emulate=True)).apply(model)
    assert len(hidden_matrices(model)) == 8


def test_one_process_equals_torch_muon_and_adamw_bitwise():
    ours = task(adjust_lr_fn="original", betas=[0.9, 0.95])
    optimizer = ours.make_optimizer()
    assert isinstance(optimizer, Muon)
    theirs = task()
    hidden = hidden_matrices(theirs)
    params = list(theirs.parameters())
    torch_muon = torch.optim.Muon(
        [p for p in params if id(p) in hidden], lr=0.02, weight_decay=0.1, adjust_lr_fn=None
    )
    decay = [p for p in params if id(p) not in hidden and p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    adamw = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.02,
        weight_decay=0.1,
        betas=(0.9, 0.95),
    )
    data = batch()
    step(ours, [optimizer], data)
    step(theirs, [torch_muon, adamw], data)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b), name
    # state: torch's Muon's momentum in each matrix's shape, torch's AdamW's for the rest
    for p in ours.parameters():
        state = optimizer.state[p]
        keys = (
            {"momentum_buffer"}
            if id(p) in hidden_matrices(ours)
            else {"step", "exp_avg", "exp_avg_sq"}
        )
        assert set(state) == keys
        assert all(t.shape in (p.shape, ()) for t in state.values())


def test_torch_muon_named_in_the_config_runs_with_torchs_defaults():
    model = task()
    model.configure_from({"_target_": "torch.optim.Muon", "lr": 0.02, "eps": 1e-6}, {})
    optimizer = model.make_optimizer()
    assert isinstance(optimizer, Muon)
    muon = next(g for g in optimizer.param_groups if g["use_muon"])
    assert (muon["adjust_lr_fn"], muon["ns_eps"], muon["lr"]) == (None, 1e-6, 0.02)


def test_float32_newton_schulz_is_the_same_iteration():
    from framework.optim.muon import newton_schulz

    g = torch.randn(48, 80, generator=torch.Generator().manual_seed(0))
    group = {"ns_coefficients": (3.4445, -4.7750, 2.0315), "ns_steps": 5, "ns_eps": 1e-7}
    bf16 = newton_schulz(g, {**group, "ns_dtype": "bfloat16"})
    fp32 = newton_schulz(g, {**group, "ns_dtype": "float32"})
    assert (bf16 - fp32).abs().max() < 0.02  # bf16's rounding apart, the same result
    assert (newton_schulz(g.T, {**group, "ns_dtype": "float32"}) - fp32.T).abs().max() < 1e-5


def test_a_muon_group_of_other_than_matrices_is_refused():
    with pytest.raises(ValueError, match="Muon steps 2-D weights only"):
        Muon([{"params": [torch.zeros(3, requires_grad=True)], "use_muon": True}])


@pytest.mark.parametrize("target", ["framework.optim.Muon", "torch.optim.Muon"])
def test_muon_is_one_override_of_the_gpt_recipe(target):
    from framework.config.compose import compose_config
    from framework.config.validate import check_task

    overrides = ["experiment=gpt_tiny", f"task.optimizer._target_={target}"]
    if target == "torch.optim.Muon":  # torch's takes none of AdamW's arguments the recipe sets
        overrides.append("~task.optimizer.betas")
    cfg = compose_config(overrides)
    check_task(cfg.task)  # the recipe's lr, weight_decay (and betas) are Muon's arguments too
    model = task()
    model.configure_from(OmegaConf.to_container(cfg.task.optimizer), {})
    assert isinstance(model.make_optimizer(), Muon)
