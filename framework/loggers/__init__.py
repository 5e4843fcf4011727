"""Logger plugins: one package per plugin, its light config half in `__init__.py` and its
Lightning logger in `logger.py`. `KINDS` lists them."""

KINDS = ("csv", "wandb", "tensorboard", "mlflow")
