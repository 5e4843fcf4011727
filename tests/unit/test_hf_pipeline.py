"""A transformers causal LM cut into pipeline layers from its own pp_plan (one process, tiny
random models): the chain computes the model's logits, owns every parameter under its own name,
and the framework's loss over microbatches is the model's loss of the whole batch."""

from __future__ import annotations

import pytest
import torch
import transformers

from framework.parallel import pipeline


def tiny(family: str, **extra):
    torch.manual_seed(0)
    config_class = getattr(transformers, f"{family}Config")
    config = config_class(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )
    task = torch.nn.Module()
    task.lm = getattr(transformers, f"{family}ForCausalLM")(config)
    return task


def run(chain, x):
    for layer in chain:
        x = layer.run(x)
    return x


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("Llama", {}),
        ("Qwen2", {"tie_word_embeddings": True}),
        # sliding-window layers after the first: each layer gets the mask of its own type
        ("Qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ],
    ids=["llama", "qwen2-tied", "qwen2-sliding"],
)
def test_chain_is_the_model_read_from_its_plan(family, extra):
    task = tiny(family, **extra)
    chain = pipeline.layers(task)
    assert [layer.name for layer in chain] == [
        "lm.model.embed_tokens",
        "lm.model.layers.0",
        "lm.model.layers.1",
        "lm.model.layers.2",
        "lm.model.norm",
    ]
    assert chain[-1].modules == ("lm.model.norm", "lm.lm_head")
    pipeline.check_covered(task, chain)  # every parameter, by its own name, in some layer
    x = torch.randint(0, 64, (2, 12))
    assert torch.equal(run(chain, x), task.lm(input_ids=x).logits)


def test_microbatch_losses_add_up_to_the_model_loss_with_ignored_labels():
    task = tiny("Llama")
    objective = pipeline.objective(task)
    x = torch.randint(0, 64, (4, 12))
    labels = x.clone()
    labels[0, 3:] = -100  # the first microbatch has far fewer labels than the second
    inputs, target = objective.split({"input_ids": x, "labels": labels})
    assert inputs is x and target is labels
    logits = run(pipeline.layers(task), x)
    objective.begin(labels, 2)
    parts = [objective.loss(logits[i : i + 2], labels[i : i + 2]) for i in (0, 2)]
    want = task.lm(input_ids=x, labels=labels).loss
    assert abs((sum(parts) / 2 - want).item()) <= 1e-6
    assert objective.split(x) == (x, x)  # a tensor of ids is its own labels


def test_a_padding_mask_is_refused_and_a_task_loss_wins():
    task = tiny("Llama")
    x = torch.randint(0, 64, (2, 8))
    mask = torch.ones_like(x)
    assert pipeline.objective(task).split({"input_ids": x, "attention_mask": mask})[0] is x
    mask[1, 5:] = 0
    with pytest.raises(ValueError, match="attention_mask masks some positions"):
        pipeline.objective(task).split({"input_ids": x, "attention_mask": mask})

    class Own(torch.nn.Module):
        def loss(self, output, target):
            return output.sum()

    own = Own()
    own.lm = task.lm
    assert pipeline.objective(own).loss == own.loss


def test_a_task_module_holding_the_model_deeper_gets_its_chain_and_loss():
    from framework.task import TaskModule

    class Holder(TaskModule):
        def __init__(self, lm):
            super().__init__()
            self.body = torch.nn.ModuleDict({"lm": lm})

    lm = tiny("Llama").lm
    task = Holder(lm)
    chain = pipeline.layers(task)
    assert chain[0].name == "body.lm.model.embed_tokens"
    assert chain[-1].modules == ("body.lm.model.norm", "body.lm.lm_head")
    x = torch.randint(0, 64, (2, 8))
    objective = pipeline.objective(task)  # TaskModule's default loss raises: the model's is used
    assert objective.split(x) == (x, x)
    objective.begin(x, 1)
    want = lm(input_ids=x, labels=x).loss
    assert abs((objective.loss(run(chain, x), x) - want).item()) <= 1e-6


def test_fw_check_simulates_a_pipelined_transformers_model_with_the_models_loss():
    """`fw check` runs the last stage's loss as `fw train` does: a plain LightningModule holding
    a causal LM (no `loss` of its own) is simulated with the model's loss, one row per stage."""
    from framework.preflight.check import check

    report = check(
        [
            "task=digits",
            "task._target_=tests.hf_tasks.PlainLlama",
            "~task.model.dropout",
            "task.model.hidden=64",
            "task.data._target_=tests.hf_tasks.RandomTokens",
            "~task.data.val_fraction",
            "strategy=pipeline",
            "trainer.devices=2",
        ]
    )
    assert [rank.role for rank in report.ranks] == ["stage 0 (pp0)", "stage 1 (pp1)"]
    assert all(rank.grads > 0 and rank.activations > 0 for rank in report.ranks)
