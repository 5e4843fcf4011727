"""Checkpoints of the parallel strategy: DCP directories, written by parameter name.

Without a pipeline they are Lightning's DCP layout (`dcp`). Under a pipeline each stage saves
only its own parameters, so the optimizer state is keyed per parameter name (`dcp_flat`): any
split, any pp, or no pipeline at all reads it back. Every checkpoint, of this layout or another,
is read back through the framework's readers (framework/checkpoint/load.py): each rank reads the
boxes of its own shards; a tied weight is found under whichever of its names the checkpoint has.
"""

from __future__ import annotations

from typing import Any

FLAT = {"flatten_optimizer_state_dict": True}


def flat_optimizer_state(model, optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(cpu_offload=True, **FLAT)
    return get_optimizer_state_dict(model, optimizer, options=options)


def restore(strategy, source) -> None:
    """This rank's shards of the model, and of the optimizers when they exist, from `source`."""
    from framework.checkpoint.load import load_model, load_optimizers, measured, same

    aliases = strategy.ties.aliases if strategy.ties is not None else same
    try:
        with measured(source, *strategy.report_to(), "model and optimizers") as figures:
            figures["held"] = load_model(strategy.model, source, aliases)
            if strategy.optimizers:
                names = strategy.parameter_names()
                figures["held"] += load_optimizers(strategy.optimizers, source, names, aliases)
    finally:
        source.close()
