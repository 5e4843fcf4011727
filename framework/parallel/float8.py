"""Float8 training of a task's linear layers (`trainer.float8`), through torchao.

`convert` swaps the chosen `nn.Linear` modules for torchao's `Float8Linear`, in place, before
tensor parallelism and FSDP (framework/parallel/parallelize.py; torchao's order), or before
DDP / DeepSpeed wrap a whole model (the same `ModelTransforms`, framework/parallel/transforms.py).
A `Float8Linear` keeps the module's `weight` and `bias` parameters as they are (ordinary
tensors in the model's own dtype): no module or parameter is renamed, so checkpoints of a float8
run hold ordinary weights, read back by name into any layout with or without float8. Only the
matmuls of forward and backward run in float8, on scales computed from each tensor every step
(dynamic scaling): the recipe says how finely (tensorwise: one scale per tensor; rowwise: one
per row, rounded to a power of two; rowwise_with_gw_hp: rowwise, with the weight gradient's
matmul kept in high precision).

Which layers (the documented rule, `rule` below): a module is converted when
1. its class is exactly `torch.nn.Linear` (a subclass, such as framework.nn's LMHead, has a role
   of its own; routed experts' grouped 3-D weights are no Linear: they stay in high precision);
2. its name matches none of `trainer.float8_skip` (fnmatch patterns; by default the output head
   and the routers of mixture-of-experts layers: `*head`, `*output`, `*router*`, `*gate`);
3. both its dimensions are multiples of 16 (float8 matmuls on the GPU need them) and at least
   MIN_FEATURES (below that the casts cost more than the float8 matmul saves);
4. its weight is its own (a weight tied to an embedding stays with the embedding's precision).

On a CPU, or anywhere torchao is asked to emulate, the same float8 numbers are computed with
ordinary matmuls on float8-rounded operands (`Float8LinearConfig(emulate=True)`): every layout is
tested that way here. A GPU runs float8 matmuls from compute capability 8.9 (Ada, Hopper) on;
older GPUs are refused before launch (`check_device`).

Under FSDP2 the tensorwise recipe all-gathers the weights already cast to float8 (torchao's
`enable_fsdp_float8_all_gather`: half the bytes of bf16), each shard's cast on the scale of
the whole weight (its amax all-reduced over the shard group), the same numbers as a cast of the
whole weight; the rowwise recipes gather high-precision weights (torchao supports the float8
gather for tensorwise scaling only).
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("framework.float8")

RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp")
DEFAULT_SKIP = ("*head", "*output", "*router*", "*gate")
MULTIPLE = 16  # float8 matmuls need both dimensions of the weight to be multiples of 16
MIN_FEATURES = 64
MIN_CAPABILITY = (8, 9)  # Ada Lovelace (sm_89) and Hopper (sm_90) on: float8 tensor cores


@dataclass(frozen=True)
class Float8Settings:
    """What `trainer.float8` and `trainer.float8_skip` ask for, and whether to emulate."""

    recipe: str = "none"
    skip: tuple[str, ...] = DEFAULT_SKIP
    emulate: bool = False  # float8 numbers from ordinary matmuls (the CPU)

    @property
    def on(self) -> bool:
        return self.recipe != "none"


def settings_for(trainer_cfg, cuda: bool) -> Float8Settings:
    """The float8 settings of a `trainer` config node, emulated unless the job runs on CUDA."""
    recipe = str(trainer_cfg.get("float8", "none") or "none")
    skip = trainer_cfg.get("float8_skip")
    return Float8Settings(recipe, tuple(DEFAULT_SKIP if skip is None else skip), not cuda)


def tied_weights(task: nn.Module) -> set[int]:
    """Ids of parameters held by more than one module (tied weights)."""
    holders: dict[int, int] = {}
    for module in task.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    return {pid for pid, count in holders.items() if count > 1}


def rule(module: nn.Module, name: str, skip: tuple[str, ...], tied: set[int]) -> bool:
    """Whether the module called `name` is converted (the module docstring's four points)."""
    from torch import nn

    if type(module) is not nn.Linear:
        return False
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in skip):
        return False
    dims = (module.in_features, module.out_features)
    if any(d % MULTIPLE or d < MIN_FEATURES for d in dims):
        return False
    return id(module.weight) not in tied


def chosen(task: nn.Module, skip: tuple[str, ...]) -> list[str]:
    """Names of the modules of `task` that float8 converts, by `rule`."""
    tied = tied_weights(task)
    return [n for n, m in task.named_modules() if rule(m, n, skip, tied)]


def torchao_config(settings: Float8Settings, fsdp_all_gather: bool):
    """torchao's Float8LinearConfig for the recipe (the float8 all-gather only where torchao
    supports it: tensorwise scaling)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(settings.recipe)
    gather = fsdp_all_gather and settings.recipe == "tensorwise"
    return dataclasses.replace(
        config, emulate=settings.emulate, enable_fsdp_float8_all_gather=gather
    )


def convert(task: nn.Module, settings: Float8Settings, fsdp_all_gather: bool = False) -> int:
    """Swap the layers `rule` chooses for torchao's Float8Linear, in place; returns how many.
    `fsdp_all_gather`: FSDP2 will shard them (float8 all-gather under tensorwise scaling).
    Layers already converted are left as they are (the rule takes plain nn.Linear only)."""
    if not settings.on:
        return 0
    names = set(chosen(task, settings.skip))
    if not names:
        return 0
    quiet_torchao()
    from torchao.float8 import convert_to_float8_training

    config = torchao_config(settings, fsdp_all_gather)
    convert_to_float8_training(task, config=config, module_filter_fn=lambda m, n: n in names)
    if config.enable_fsdp_float8_all_gather:
        for name in names:
            task.get_submodule(name).register_state_dict_post_hook(ordinary_weight)
    if first_rank():
        log.info("float8 (%s): %d linear layers in float8", settings.recipe, len(names))
    return len(names)


def first_rank() -> bool:
    """Rank 0 of the job, or no job of several processes (the one that says what was done)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def ordinary_weight(module: nn.Module, state: dict, prefix: str, metadata) -> None:
    """A state-dict hook: the weight torchao wraps for the float8 all-gather
    (WeightWithDynamicFloat8CastTensor, a DTensor's local part under FSDP2) as the plain tensor
    it holds (sharing its storage), so a checkpoint holds ordinary weights, and a reader that
    fills the state dict's tensors fills the parameter."""
    key = prefix + "weight"
    weight = state.get(key)
    if weight is None:
        return
    inner = weight.to_local() if hasattr(weight, "device_mesh") else weight
    if not hasattr(inner, "_tensor") or type(inner).__name__ != "WeightWithDynamicFloat8CastTensor":
        return
    if inner is weight:
        state[key] = inner._tensor
        return
    from torch.distributed.tensor import DTensor

    state[key] = DTensor.from_local(
        inner._tensor, weight.device_mesh, weight.placements, shape=weight.shape,
        stride=weight.stride(), run_check=False,
    )  # fmt: skip


def quiet_torchao() -> None:
    """torchao's import warns about its CUDA kernels' libraries on a machine without them and
    about an enum it registers with torch.compile: noise for a float8 training job."""
    import warnings

    logging.getLogger("torchao").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*is an Enum subclass.*")


def is_float8(module: nn.Module) -> bool:
    """Whether `module` is torchao's Float8Linear (without importing torchao)."""
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith(
        "torchao."
    )


def converted(task: nn.Module) -> list[str]:
    """Names of the task's float8 layers."""
    return [n for n, m in task.named_modules() if is_float8(m)]


def check_device(capability: tuple[int, int] | None, key: str = "trainer.float8", recipe=None):
    """Refuse float8 on a CUDA device without float8 matmuls (capability below 8.9); None: no
    CUDA device is known (the CPU emulates)."""
    from framework.errors import ConfigError

    if capability is None or tuple(capability) >= MIN_CAPABILITY:
        return
    major, minor = capability
    raise ConfigError(
        key,
        recipe,
        f"this GPU (compute capability {major}.{minor}) has no float8 matmuls; float8 training "
        "needs capability 8.9 or newer (Ada Lovelace, Hopper, Blackwell)",
        ["none"],
        hint="Train in bf16 (trainer.float8=none, trainer.precision=bf16-mixed) on this GPU.",
    )


def check(trainer_cfg, world, here: bool = True) -> None:
    """Before launch: torchao installed when float8 is asked for, and on this machine's CUDA
    devices (`here`, the ones the job's local ranks use) float8 matmuls (capability 8.9+)."""
    import importlib.util

    from framework.errors import ConfigError

    recipe = str(trainer_cfg.get("float8", "none") or "none")
    if recipe == "none":
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "trainer.float8",
            recipe,
            "float8 training needs torchao, which is not installed",
            ["none"],
            hint="Install it with `pip install 'framework[float8]'`.",
        )
    if here and world.is_cuda:
        import torch

        if torch.cuda.is_available():
            count = min(world.devices, torch.cuda.device_count())
            lowest = min(torch.cuda.get_device_capability(i) for i in range(max(1, count)))
            check_device(lowest, recipe=recipe)
