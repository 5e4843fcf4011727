"""A corpus of bad command lines, each refused before anything starts: exit code 2, one line
naming the key and the value, no traceback, nothing written. They go through `fw`'s own entry
point (`framework.cli.main`) in this process, one after another; tests/configs/test_cli_errors.py
runs a few of the same kind as separate `fw` processes."""

from __future__ import annotations

import pytest

from framework.cli import main

PLAIN = ["task._target_=tests.tasks.PlainDigits", "~task.model.dropout"]
PLAIN_DATA = ["task.data._target_=tests.tasks.PlainDigitsData", "~task.data.val_fraction"]
CASES = {
    # ranges of the trainer's fields
    "negative max_steps": (["trainer.max_steps=-3"], "trainer.max_steps=-3: must be at least -1"),
    "no accumulation": (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0"),
    "negative val interval": (["trainer.val_check_interval=-2"], "trainer.val_check_interval=-2"),
    "negative clip": (
        ["trainer.gradient_clip_val=-1"],
        "trainer.gradient_clip_val=-1.0: must be greater than 0",
    ),
    "zero log interval": (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps=0"),
    "negative max_epochs": (["trainer.max_epochs=-2"], "trainer.max_epochs=-2"),
    "zero devices": (["trainer.devices=0"], "trainer.devices=0: must be at least 1"),
    "negative limit": (["trainer.limit_train_batches=-1"], "trainer.limit_train_batches=-1"),
    "unknown precision": (["trainer.precision=fp8"], "trainer.precision=fp8: not a valid choice"),
    "negative seed": (["seed=-1"], "seed=-1: must be at least 0"),
    # keys that do not exist
    "+key in a typed group": (
        ["+trainer.max_stepz=1"],
        "trainer.max_stepz=1: no such key. Did you mean 'max_steps'?",
    ),
    "new top-level key": (["+unknown_top=1"], "unknown_top=1: no such key"),
    "+key in a callback": (
        ["+callbacks.checkpoint.every=5"],
        "callbacks.checkpoint.every=5: no such key",
    ),
    "+key in a strategy": (
        ["strategy=fsdp", "+strategy.shards=2"],
        "strategy.shards=2: no such key",
    ),
    # other groups' ranges
    "keep no checkpoint": (
        ["callbacks.checkpoint.keep_last=0"],
        "callbacks.checkpoint.keep_last=0",
    ),
    "zero save interval": (
        ["callbacks.checkpoint.every_n_steps=0"],
        "callbacks.checkpoint.every_n_steps=0",
    ),
    "zero throughput window": (["callbacks.throughput.window=0"], "callbacks.throughput.window=0"),
    "no W&B timeout": (
        ["logger.wandb.init_timeout=0"],
        "logger.wandb.init_timeout=0.0: must be greater than 0",
    ),
    "unknown W&B checkpoint upload": (
        ["logger.wandb.log_model=true"],
        "logger.wandb.log_model=True: not a valid choice. Valid choices: none, last, best, all",
    ),
    "best checkpoint upload without a metric": (
        ["logger.wandb.log_model=best"],
        "logger.wandb.log_model=best: 'best' ranks checkpoints by callbacks.checkpoint.monitor",
    ),
    "checkpoint upload without checkpoints": (
        ["logger.wandb.log_model=last", "~callbacks.checkpoint"],
        "logger.wandb.log_model=last: no checkpoints are saved to upload",
    ),
    "zero processes per core": (["launcher.processes_per_core=0"], "launcher.processes_per_core=0"),
    "negative restarts": (["launcher.max_restarts=-1"], "launcher.max_restarts=-1"),
    "async saves of a non-DCP layout": (
        ["callbacks.checkpoint.async_save=true", "strategy=zero2", "trainer.devices=2"],
        "callbacks.checkpoint.async_save=True: the deepspeed strategies write 'deepspeed' checkpoints",
    ),
    "negative hang timeout": (["launcher.hang_timeout_s=-5"], "launcher.hang_timeout_s=-5"),
    "straggler threshold below 1": (
        ["callbacks.stragglers.threshold=0.5"],
        "callbacks.stragglers.threshold=0.5",
    ),
    "zero microbatches": (
        ["strategy=pipeline", "strategy.microbatches=0"],
        "strategy.microbatches=0",
    ),
    "zero timeout": (["strategy=ddp", "strategy.timeout_s=0"], "strategy.timeout_s=0"),
    "warm-up below zero": (["task.scheduler.warmup_steps=-5"], "task.scheduler.warmup_steps=-5"),
    "final lr above peak": (
        ["task.scheduler.min_lr_ratio=2"],
        "task.scheduler.min_lr_ratio=2.0: must be at most 1",
    ),
    # the dry build: task, data, optimizer and schedule built before launch
    "negative lr": (
        ["task.optimizer.lr=-1"],
        "task.optimizer.lr=-1: torch.optim.AdamW raised ValueError: Invalid learning rate: -1",
    ),
    "negative weight decay": (
        ["task.optimizer.weight_decay=-0.1"],
        "task.optimizer.weight_decay=-0.1",
    ),
    "betas out of range": (
        ["task.optimizer._target_=torch.optim.Adam", "+task.optimizer.betas=[0.9,2.0]"],
        "task.optimizer.betas=[0.9, 2.0]: torch.optim.Adam raised ValueError",
    ),
    "negative width": (
        ["task.model.hidden=-5"],
        "task.model.hidden=-5: recipes.digits.task.DigitsTask raised RuntimeError",
    ),
    "dropout above one": (["task.model.dropout=1.5"], "task.model.dropout=1.5"),
    "zero gpt layers": (
        ["task=gpt", "task.model.n_layer=0"],
        "task.model.n_layer=0: must be at least 1",
    ),
    "plain module's lr": (
        [*PLAIN, "+task.model.lr=-1"],
        "task.model.lr=-1: PlainDigits.configure_optimizers raised ValueError: Invalid learning rate: -1",
    ),
    "data module rejects its argument": (
        [*PLAIN, *PLAIN_DATA, "task.data.batch_size=0"],
        "task.data.batch_size=0",
    ),
    "user __init__ raises": (
        ["task._target_=tests.tasks.TokenDigits", *PLAIN[1:], "+task.model.api_token=***"],
        "task.model",
    ),
    "argument of the wrong type": (
        ["task.model.hidden=wide"],
        "task.model.hidden=wide: expected int",
    ),
    "unknown optimizer argument": (
        ["+task.optimizer.momentum=0.9"],
        "task.optimizer.momentum=0.9: not an argument of AdamW",
    ),
    # parallel settings
    "tensor parallel with nothing to split": (
        [
            "task._target_=tests.tasks.PlainTwoLayer",
            "~task.model.dropout",
            "strategy=tensor",
            "trainer.devices=2",
        ],
        "strategy.tp=2: PlainTwoLayer declares no tensor-parallel plan, and none could be "
        "inferred from its structure",
    ),
    "expert parallel without experts": (
        ["strategy=fsdp", "strategy.ep=2", "trainer.devices=2"],
        "strategy.ep=2: DigitsTask has no mixture-of-experts layer",
    ),
    "ep not dividing fsdp": (
        [
            "experiment=moe_gpt_tiny",
            "strategy=fsdp",
            "strategy.tp=2",
            "strategy.ep=2",
            "trainer.devices=2",
        ],
        "strategy.ep=2: expert parallel borrows its ranks from the fsdp degree (1)",
    ),
    "experts not dividing by ep": (
        [
            "experiment=moe_gpt_tiny",
            "task.model.num_experts=3",
            "strategy=expert",
            "trainer.devices=2",
        ],
        "strategy.ep=2: the model's 3 experts per layer do not split evenly over it",
    ),
    "top_k above the experts": (
        ["experiment=moe_gpt_tiny", "task.model.top_k=5"],
        "task.model.top_k=5: must be between 1 and num_experts=4",
    ),
    "expert parallel under ZeRO": (
        ["experiment=moe_gpt_tiny", "strategy=zero2", "strategy.ep=2", "trainer.devices=2"],
        "strategy.ep=2: expert parallel is not offered on DeepSpeed ZeRO",
    ),
    "fp16 autocast under a pipeline": (
        ["strategy=pipeline", "trainer.devices=2", "trainer.precision=16-mixed"],
        "trainer.precision=16-mixed: fp16 loss scaling is not applied by the parallel strategies "
        "(FSDP2, tensor and pipeline parallel; under a pipeline the gradients would be 65536x too "
        "small). Valid choices: bf16-mixed, 32-true, bf16-true, 16-true.",
    ),
    "fp64 under FSDP2": (
        ["strategy=fsdp", "trainer.devices=2", "trainer.precision=64-true"],
        "trainer.precision=64-true: not offered by the parallel strategies",
    ),
    "aux loss under a pipeline": (
        [
            "experiment=moe_gpt_tiny",
            "task.model.aux_loss_coeff=0.01",
            "strategy=pipeline",
            "trainer.devices=2",
        ],
        "strategy.pp=2: the routers' auxiliary losses",
    ),
    "unknown schedule": (
        ["strategy=pipeline", "strategy.schedule=pipedream"],
        "strategy.schedule=pipedream",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_before_anything_starts(case, tmp_path, monkeypatch, capsys):
    args, expected = CASES[case]
    monkeypatch.chdir(tmp_path)
    code = main(["train", *args, "run.dir=run"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert expected in err, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == [], "nothing written"
