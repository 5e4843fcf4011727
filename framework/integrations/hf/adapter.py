"""transformers models as one model family of the parallel core (framework/parallel/model.py).

The adapter only routes: the plans are read in plans.py, the pipeline chain and loss in
pipelining.py, context parallel in context_parallel.py, the sparse MoE swap in sparse_moe.py,
pretrained weights in pretrained.py. Nothing here imports transformers: a task that holds one of
its models has imported it already (`plans.models` looks only then).
"""

from __future__ import annotations

import json
from typing import Any

from torch import nn

from framework.integrations.hf import plans
from framework.parallel.model import ExpertBlock, FamilyAdapter, Objective, RoutedWeights


class TransformersAdapter(FamilyAdapter):
    """The transformers `PreTrainedModel`s a task holds (outermost ones: a base model inside a
    causal LM is covered by its outer model)."""

    name = "transformers"

    def claims(self, task: nn.Module) -> bool:
        return bool(plans.models(task))

    def tensor_plan(
        self, task: nn.Module, *, skip=(), sequence_parallel=False, loss_parallel=False, experts=()
    ) -> dict[str, Any]:
        return plans.tensor_plan(task, skip, sequence_parallel, loss_parallel, experts)

    def check_tensor(self, task: nn.Module, tp: int) -> None:
        plans.check_heads(task, tp)

    def blocks(self, task: nn.Module) -> list[nn.Module] | None:
        names = plans.no_split_classes(task)
        if not names:
            return None
        return [m for m in task.modules() if type(m).__name__ in names]

    def before_checkpointing(self, task: nn.Module) -> None:
        """No key/value cache in training (`use_cache` off in their config, as transformers'
        own checkpointing does): a recomputed layer would add its keys and values to the cache
        its forward already filled, attend over twice the keys, and under selective
        checkpointing fail, its operations no longer those of the forward."""
        for _, model in plans.models(task):
            if getattr(model.config, "use_cache", False):
                model.config.use_cache = False

    def pipeline_model(self, task: nn.Module) -> tuple[str, nn.Module] | None:
        from framework.integrations.hf import pipelining

        return pipelining.find(task)

    def pipeline_layers(self, model: nn.Module):
        from framework.integrations.hf import pipelining

        return pipelining.pipeline_layers(model)

    def pipeline_loss(self, task: nn.Module, split) -> Objective | None:
        """A causal LM's own loss on its token batches (`split`: the task's own
        `pipeline_batch`, else transformers' input_ids/labels)."""
        from framework.integrations.hf import pipelining

        found = pipelining.find(task)
        if found is None or not pipelining.is_causal_lm(found[1]):
            return None
        loss = pipelining.CausalLMLoss(found[1])
        return Objective(split or pipelining.split_batch, loss, loss.begin)

    def check_pipeline(self, task: nn.Module, pp: int) -> None:
        from framework.integrations.hf import pipelining

        found = pipelining.find(task)
        if found is not None and pipelining.is_causal_lm(found[1]):
            pipelining.check_loss(*found, pp)  # a loss the stages would drop

    def describe_layers(self, path: str, model: nn.Module) -> str | None:
        from framework.integrations.hf import pipelining

        return pipelining.describe(path, model)

    def attach_context(self, task: nn.Module, plan: Any) -> None:
        from framework.integrations.hf import context_parallel

        context_parallel.attach(task, plan)

    def check_context(self, task: nn.Module, cp: int, mode: str, tp: int) -> bool:
        from framework.integrations.hf import context_parallel

        context_parallel.check(task, cp, mode, tp)
        return True

    def expert_blocks(self, task: nn.Module, ep: int) -> list[ExpertBlock]:
        from framework.integrations.hf.sparse_moe import sparse_blocks

        kind = "transformers MoE block"
        return [ExpertBlock(b.path, b.num_experts, kind) for b in sparse_blocks(task, ep)]

    def swap_experts(self, task: nn.Module, ep: int) -> None:
        from framework.integrations.hf.sparse_moe import swap_sparse_blocks

        swap_sparse_blocks(task, ep)

    def routed_weights(self, task: nn.Module) -> list[RoutedWeights]:
        """The modules each model's `ep_plan` styles `ep_dispatch_experts`: a token runs through
        `num_experts_per_tok` of their experts."""
        from framework.parallel.keys import matches

        found = []
        for _, model in plans.models(task):
            config = getattr(model, "config", None)
            k = getattr(config, "num_experts_per_tok", None)
            n = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
            keys = [
                key
                for key, style in dict(getattr(model, "ep_plan", None) or {}).items()
                if style == "ep_dispatch_experts"
            ]
            for name, module in model.named_modules():
                if any(matches(key, name) for key in keys):
                    found.append(RoutedWeights(list(module.parameters()), k, n))
        return found

    def load_pretrained(self, task: nn.Module, device: Any, run_dir: Any, rank: int) -> list:
        from framework.integrations.hf import pretrained

        return pretrained.load_pretrained(task, device, run_dir, rank)

    def pretrained_sources(self, task: nn.Module) -> list:
        from framework.integrations.hf import pretrained

        return pretrained.sources(task)

    def export_records(self, task: nn.Module) -> list[dict[str, Any]]:
        return [record(path, model) for path, model in plans.models(task)]


def record(path: str, model: Any) -> dict[str, Any]:
    """What the export needs to know of one transformers model, as data (meta.json)."""
    # the class transformers defines (a task may hold a subclass of its own)
    cls = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))
    return {
        "path": path,
        "class": cls.__name__,
        "config": json.loads(model.config.to_json_string(use_diff=False)),
    }


ADAPTER = TransformersAdapter()
