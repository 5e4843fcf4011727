"""ZeRO's per-rank model states for `fw check`, from the figures of one whole replica.

Each rank steps the task's optimizer on its 1/N partition: 1/N of the replica's step temporaries,
none on the device when the optimizer is offloaded. Under mixed precision DeepSpeed's own
estimators give the model states; in fp32 the formulas the memory benchmark verified
(benchmarks/memory.py). Imports DeepSpeed only for the mixed-precision estimate.

A Muon optimizer (framework/optim/muon.py) keeps one fp32 momentum for its matrices where Adam,
whom DeepSpeed's estimator assumes, keeps two moments: 4 bytes an element of them less, over N.
Each rank orthogonalises every N-th matrix of its partitions (1/N of the replica's Newton-Schulz
FLOPs) and sends its stretches of them to their owners and the results back (twice its 1/N).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any


def zero_states(replica: Any, cfg: Any, precision: str, world: Any) -> tuple[Any, str]:
    """(the rank's memory, a note on how it was estimated); `replica` is a RankMemory."""
    n = world.world_size
    params, states = replica.params, replica.optimizer
    offload_opt = cfg.offload_optimizer != "none"
    offload_params = cfg.stage == 3 and cfg.offload_params != "none"
    step = 0 if offload_opt else replica.optimizer_step // n
    replica = replace(
        replica,
        optimizer_flops={k: v / n for k, v in replica.optimizer_flops.items()},
        optimizer_matmuls=-(-replica.optimizer_matmuls // n),
        optimizer_sent=2 * replica.muon_bytes / n if n > 1 else 0.0,
    )
    if precision in ("bf16-mixed", "16-mixed"):
        return deepspeed_estimate(replica, cfg, world, offload_opt, offload_params, step)
    # fp32, as benchmarks/memory.py measured: stages 1-2 keep an fp32 copy of their partition
    row = replace(
        replica,
        role=f"zero{cfg.stage}, every rank",
        params=0 if offload_params else (params // n if cfg.stage == 3 else params),
        grads=params // n,
        optimizer=0 if offload_opt else states // n + (params // n if cfg.stage < 3 else 0),
        optimizer_step=step,
        note="optimizer offloaded" if offload_opt else "",
    )
    return row, "ZeRO model states: the fp32 formulas the memory benchmark verified."


def deepspeed_estimate(replica, cfg, world, offload_opt: bool, offload_params: bool, step: int):
    psi = replica.params // 4
    if cfg.stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _, device, _ = estimate_zero3_model_states_mem_needs(
            psi, psi, world.devices, world.num_nodes, offload_opt, offload_params
        )
    else:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, device = estimate_zero2_model_states_mem_needs(
            psi, world.devices, world.num_nodes, offload_opt
        )
    params = 2 * psi // (world.world_size if cfg.stage == 3 else 1)
    # Muon's matrices: one fp32 moment where the estimator counts Adam's two
    muon = 0 if offload_opt else replica.muon_bytes // world.world_size
    row = replace(
        replica,
        role=f"zero{cfg.stage}, every rank",
        params=params,
        grads=0,
        optimizer=max(0, device - params - muon),
        optimizer_step=step,
        note="grads in optimizer column",
    )
    return row, (
        "ZeRO model states: DeepSpeed's estimator (16-bit params and grads, fp32 master and "
        "Adam states); its largest-layer term uses the whole model, an upper bound."
    )
