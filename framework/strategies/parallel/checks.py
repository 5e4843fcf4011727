"""Checks of the parallel strategy that run before launch, in the `fw` process.

The ones that need the task build it on the meta device (no memory, no weights) and look at
it as the workers will: its modules against `tp_plan`, its shapes against `tp`, its layers
against the pipeline's stages.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from typing import Any

from framework.errors import ConfigError
from framework.parallel.dims import ParallelDims

log = logging.getLogger("framework.parallel")
MESH_PRECISIONS = ("bf16-mixed", "32-true", "bf16-true", "16-true", "32")  # "32" is 32-true


def plan_syntax(tp_plan: list[str]) -> None:
    from framework.parallel.tensor import STYLES  # here, not at import: framework.nn imports torch

    for entry in tp_plan:
        name, _, style = str(entry).rpartition(":")
        if not name:
            raise ConfigError(
                "strategy.tp_plan", entry, "an entry is 'module:style', e.g. 'net.0:colwise'"
            )
        if style not in STYLES:
            raise ConfigError("strategy.tp_plan", entry, f"'{style}' is not a known style", STYLES)


def tensor_parallel(cfg: Any, dims: ParallelDims, job: Any) -> None:
    """tp > 1: transforms torch gets wrong, plan names, shapes that must split."""
    trainer = job.trainer
    if cfg.sequence_parallel and dims.pp > 1:
        raise ConfigError(
            "strategy.sequence_parallel",
            True,
            "is not supported under a pipeline (pp > 1): stages send whole activations",
            ["false"],
        )
    if (
        cfg.sequence_parallel
        and trainer.compile
        and trainer.activation_checkpointing == "selective"
    ):
        raise ConfigError(
            "trainer.activation_checkpointing",
            "selective",
            "with trainer.compile=true and strategy.sequence_parallel=true it trains wrong "
            "gradients in the installed torch (measured: losses off by 1e-2 within 10 steps)",
            ["full", "none"],
            hint="Use full, or turn off compile or sequence_parallel.",
        )
    model = model_of(job)
    if cfg.tp_plan:
        plan_names(cfg.tp_plan, model)
    declared, families, authored = declared_plans(cfg, model, dims)
    if not cfg.tp_plan:
        some_plan(model, dims.tp, declared, families, authored, cfg.sequence_parallel)
    tensor_dims(job.task, dims.tp, cfg.sequence_parallel)


def declared_plans(cfg: Any, model, dims: ParallelDims) -> tuple[dict[str, Any], list[str], bool]:
    """The plans the task's model families declare apply as the workers will apply them
    (framework/parallel/model.py): every style known (but where strategy.tp_plan replaces it,
    and inside the MoE blocks that ep > 1 splits instead), a sequence-parallel form for every
    module when sequence_parallel is on, shapes (e.g. heads) that split evenly. Returns them,
    the families the task holds besides the declared protocol, and whether a family declares
    its models' own plans (else the plans are standard layers', the rest inferred)."""
    from framework.parallel.model import adapter_for

    adapter = adapter_for(model)
    skip = [str(e).rpartition(":")[0] for e in cfg.tp_plan]
    experts = [b.path for b in adapter.expert_blocks(model, dims.ep)] if dims.ep > 1 else []
    options = {
        "skip": skip,
        "sequence_parallel": cfg.sequence_parallel,
        "loss_parallel": cfg.loss_parallel,
        "experts": experts,
    }
    plan = adapter.tensor_plan(model, **options)
    adapter.check_tensor(model, dims.tp)
    authored = bool(plan) and adapter.declares_plan(model, **options)
    return plan, [a.name for a in adapter.adapters[1:]], authored


def some_plan(
    model,
    tp: int,
    declared: dict[str, Any],
    families: list[str],
    authored: bool,
    sequence_parallel: bool = False,
) -> None:
    """tp > 1 must split something: the plans the model's families declare (logged when a
    family's, e.g. a transformers model's, as nobody wrote them in the task), else a plan
    inferred from its structure beside the known plans of torch's layers (logged as a
    strategy.tp_plan override the user can copy, with why linears were left whole)."""
    from framework.parallel.infer import describe, plan_for, whole_reasons

    name = type(model).__name__
    if authored:
        if families:
            log.info(
                "Tensor parallel: %s split by the plans of its %s models: %s",
                name,
                " and ".join(families),
                ", ".join(collapsed(declared)),
            )
        return
    inferred = plan_for(model, tp)
    if not declared and not inferred.plan:
        raise ConfigError(
            "strategy.tp",
            tp,
            f"{name} declares no tensor-parallel plan, and none could be inferred from its "
            "structure (no linears feeding linears through an MLP or attention, no embedding "
            "whose rows divide by it), so every weight would stay whole on every rank",
            hint="Build the model from framework.nn blocks, give a module a tp_plan() method, "
            "or list the splits in strategy.tp_plan (e.g. 'strategy.tp_plan=[net.0:colwise,"
            "net.2:rowwise]'); see docs/model_parallel.md."
            + "".join(f" {why}." for why in whole_reasons(inferred)),
        )
    if sequence_parallel and inferred.plan:
        raise ConfigError(
            "strategy.sequence_parallel",
            True,
            f"{name} declares no tensor-parallel plan, and the plan inferred from its structure "
            "has no sequence-parallel form",
            ["false"],
        )
    if declared:
        log.info(
            "Tensor parallel: %s's torch layers split by their known plans: %s",
            name,
            ", ".join(collapsed(declared)),
        )
    if inferred.plan:
        log.info(
            "Tensor parallel: %s declares no plan; inferred from its structure (copy it to "
            "keep or change it): %s",
            name,
            describe(inferred, model),
        )
    for why in whole_reasons(inferred):
        log.info("Tensor parallel: left whole: %s", why)


def collapsed(plan: dict[str, Any]) -> list[str]:
    """'module:style' entries with layer numbers as * (one entry for every layer alike)."""
    found = {re.sub(r"\.\d+(?=\.|$)", ".*", k): v for k, v in plan.items() if isinstance(v, str)}
    return [f"{k}:{v}" for k, v in found.items()]


def tensor_dims(task: Any, tp: int, sequence_parallel: bool) -> None:
    """The sizes the task says tensor parallelism splits (its `tensor_parallel_dims`) divide
    by `tp`."""
    from framework.config.validate import import_target

    dims = getattr(import_target("task._target_", task._target_), "tensor_parallel_dims", None)
    if dims is None:
        return
    for key, value in dims(dict(task.model), sequence_parallel=sequence_parallel).items():
        if value % tp:
            raise ConfigError(
                f"task.model.{key}",
                value,
                f"must be divisible by the tensor-parallel degree strategy.tp={tp}",
                hint=f"Choose a multiple of {tp}, or another strategy.tp.",
            )


def model_of(job: Any):
    """The task built on the meta device (by the dry build, or here when it could not be)."""
    if job.model is not None:
        return job.model
    import torch

    from framework.instantiate import build_task

    with torch.device("meta"):
        return build_task(job.task)


def plan_names(tp_plan: list[str], task) -> None:
    """Every `strategy.tp_plan` entry names modules of the task."""
    from framework.parallel.tensor import matches

    names = [n for n, _ in task.named_modules() if n]
    for entry in tp_plan:
        pattern = str(entry).rpartition(":")[0]
        if not any(matches(pattern, n) for n in names):
            raise ConfigError(
                "strategy.tp_plan",
                entry,
                f"'{pattern}' names no module of {type(task).__name__}",
                hint=f"Its modules include: {', '.join(names[:8])}.",
            )


def pipeline_settings(cfg: Any, dims: ParallelDims, job: Any) -> None:
    """pp > 1: the schedule against its stages and microbatches, then the task's layers."""
    v, m, pp = cfg.virtual_stages, cfg.microbatches, dims.pp
    needs, fits = {
        "gpipe": ("== 1", v == 1),
        "1f1b": ("== 1", v == 1),
        "zbv": ("== 2", v == 2),
    }.get(cfg.schedule, (">= 2", v >= 2))
    if not fits:
        raise ConfigError(
            "strategy.virtual_stages",
            v,
            f"schedule {cfg.schedule} needs virtual_stages {needs} (stages per process)",
            hint="gpipe and 1f1b run one stage per process; interleaved_1f1b and zero_bubble "
            "two or more; zbv exactly two.",
        )
    if m < 1:
        raise ConfigError("strategy.microbatches", m, "must be at least 1")
    if cfg.schedule != "gpipe" and m < pp:
        raise ConfigError(
            "strategy.microbatches",
            m,
            f"schedule {cfg.schedule} needs at least as many microbatches as pipeline ranks "
            f"(pp={pp})",
        )
    rounds = max(1, m // pp)
    if cfg.schedule in ("interleaved_1f1b", "zero_bubble") and m % rounds:
        raise ConfigError(
            "strategy.microbatches",
            m,
            f"schedule {cfg.schedule} needs a multiple of pp={pp} microbatches (or fewer than "
            f"{2 * pp})",
        )
    if cfg.trace and cfg.trace_step < 1:
        raise ConfigError("strategy.trace_step", cfg.trace_step, "must be at least 1")
    if (
        cfg.schedule in ("zero_bubble", "zbv")
        and job.trainer.activation_checkpointing == "selective"
    ):
        raise ConfigError(
            "trainer.activation_checkpointing",
            "selective",
            f"schedule {cfg.schedule} runs each backward in two passes (input, then weight "
            "gradients), and torch's selective checkpointing allows only one",
            ["full", "none"],
            hint="Use full, or another schedule.",
        )
    batch = job.task.get("data", {}).get("batch_size")
    if isinstance(batch, int) and batch % m:
        raise ConfigError(
            "strategy.microbatches",
            m,
            f"must divide the batch of each data-parallel rank, task.data.batch_size={batch}",
            [d for d in range(1, batch + 1) if batch % d == 0][:12],
        )
    if cfg.trace and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(
            "strategy.trace",
            True,
            "drawing the schedule needs matplotlib, which is not installed",
            hint="pip install matplotlib (the project's `bench` extra), or leave trace off.",
        )
    layers(cfg, dims, job)


def precision(value: str) -> None:
    """The precisions Lightning's ModelParallelStrategy, this strategy's base, takes: it refuses
    the others in every worker, after launch. Were 16-mixed let through, a pipeline's backward
    would skip its fp16 loss scaling (gradients 65536x too small)."""
    if value in MESH_PRECISIONS:
        return
    problem = (
        "fp16 loss scaling is not applied by the parallel strategies (FSDP2, tensor and "
        "pipeline parallel; under a pipeline the gradients would be 65536x too small)"
        if value == "16-mixed"
        else "not offered by the parallel strategies (Lightning's ModelParallelStrategy)"
    )
    raise ConfigError("trainer.precision", value, problem, MESH_PRECISIONS[:-1], near="")


def layers(cfg: Any, dims: ParallelDims, job: Any) -> None:
    """Cut the meta-device task as the workers will: a loss, enough layers, valid split points,
    and no weight FSDP would have to shard twice."""
    from framework.parallel import pipeline
    from framework.parallel.model import adapter_for

    task = model_of(job)
    task_cfg = job.task
    name = type(task).__name__
    n_stages = dims.pp * cfg.virtual_stages
    if pipeline.objective(task) is None:
        raise ConfigError(
            "task._target_",
            task_cfg._target_,
            f"{name} defines no loss(output, target) and holds no transformers causal LM: "
            "pipeline parallel computes the loss on the last stage with it",
            hint="Add a loss method (and pipeline_batch, if a batch is not (input, target)).",
        )
    adapter_for(task).check_pipeline(task, dims.pp)  # e.g. a loss the stages would drop
    try:
        chain = pipeline.layers(task)
        pipeline.check_covered(task, chain)
    except ValueError as err:
        raise ConfigError("strategy", "pipeline", str(err)) from None
    if n_stages > len(chain):
        found = pipeline.find_model(task)
        made_of = adapter_for(task).describe_layers(*found) if found else None
        raise ConfigError(
            "strategy.pp",
            dims.pp,  # the degree in force (cfg.pp is -1 when derived from the devices)
            f"{n_stages} stages (pp x virtual_stages) is more than the {len(chain)} layers of "
            + (made_of or f"{name} ({', '.join(layer.name for layer in chain[:6])}, ...)"),
            hint=f"Use at most {len(chain)} stages, or a model with more layers.",
        )
    if cfg.schedule == "zbv" and dims.data_size > 1 and pipeline.tied_across_layers(task, chain):
        raise ConfigError(
            "strategy.schedule",
            "zbv",
            f"{name} ties a weight between its first and last layers, which zbv places on the "
            "same process; FSDP (dp x fsdp > 1) cannot shard one weight in two stages there",
            ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"],
            hint="Use another schedule, or no data parallelism inside the pipeline.",
        )
    if cfg.split_points:
        split_points(cfg, chain, n_stages, name)


def split_points(cfg: Any, chain: list, n_stages: int, name: str) -> None:
    from framework.parallel import pipeline

    if len(cfg.split_points) != n_stages - 1:
        raise ConfigError(
            "strategy.split_points",
            list(cfg.split_points),
            f"{n_stages} stages need {n_stages - 1} split points (where stages 2, 3, ... begin)",
        )
    try:
        pipeline.starts_at(chain, list(cfg.split_points))
    except KeyError as err:
        raise ConfigError(
            "strategy.split_points",
            err.args[0],
            f"is not where a layer of {name} begins",
            [layer.name for layer in chain][:16],
        ) from None
    except ValueError as err:
        raise ConfigError("strategy.split_points", list(cfg.split_points), str(err)) from None


def experts(cfg: Any, dims: ParallelDims, job: Any) -> None:
    """ep > 1 needs mixture-of-experts layers whose experts split evenly (framework.nn.MoE, or the
    sparse MoE blocks a transformers model's ep plan names, which must be ones the framework
    applies); MoE losses and sequence parallel are checked against the layout."""
    from framework.parallel.experts import moe_layers
    from framework.parallel.model import adapter_for

    model = model_of(job) if (dims.ep > 1 or dims.pp > 1 or cfg.sequence_parallel) else None
    layers = moe_layers(model) if model is not None else []
    # swapped into framework layers by the workers under ep > 1 (by their model family)
    blocks = adapter_for(model).expert_blocks(model, dims.ep) if dims.ep > 1 else []
    if dims.ep > 1 and not layers and not blocks:
        raise ConfigError(
            "strategy.ep",
            cfg.ep,
            f"{type(model).__name__} has no mixture-of-experts layer "
            "(framework.nn.MoE, or a transformers MoE model's experts in its ep_plan), so there "
            "are no experts to split",
            [1],
            hint="Build the model's MLPs from framework.nn.MoE (see recipes/moe_gpt), or use ep=1.",
        )
    for block in blocks:
        if block.num_experts % dims.ep:
            raise ConfigError(
                "strategy.ep",
                dims.ep,
                f"the {block.kind} {block.path} has {block.num_experts} experts, which "
                "do not split evenly over it",
                [d for d in range(1, block.num_experts + 1) if block.num_experts % d == 0],
            )
    for layer in layers:
        if dims.ep > 1 and layer.num_experts % dims.ep:
            raise ConfigError(
                "strategy.ep",
                dims.ep,
                f"the model's {layer.num_experts} experts per layer do not split evenly over it",
                [d for d in range(1, layer.num_experts + 1) if layer.num_experts % d == 0],
            )
        router = layer.router
        if dims.pp > 1 and (router.aux_loss_coeff or router.z_loss_coeff):
            raise ConfigError(
                "strategy.pp",
                dims.pp,
                "the routers' auxiliary losses (aux_loss_coeff, z_loss_coeff) are added to the "
                "task's loss, which under a pipeline sees only the last stage",
                hint="Set the coefficients to 0 (the expert bias balances the load), or pp=1.",
            )
    if layers and cfg.sequence_parallel:
        raise ConfigError(
            "strategy.sequence_parallel",
            True,
            "mixture-of-experts layers run on whole sequences: their experts are not split over "
            "the tensor-parallel ranks",
            ["false"],
        )
