"""Strategy plugins: one package per plugin, its light config half in `__init__.py` and its
Lightning strategy in `strategy.py` (see framework.plugins for the contract). `KINDS` lists them:
the YAML options of conf/strategy/ are presets of these (zero1..3 of `deepspeed`; fsdp, tensor,
fsdp_tp, pipeline, expert of `parallel`)."""

KINDS = ("ddp", "deepspeed", "diloco", "hogwild", "parallel")
