"""Logger plugins: one package per plugin, its light config half in `__init__.py` and its
Lightning logger in `logger.py`. `KINDS` lists them."""

KINDS = ("csv", "wandb", "tensorboard", "mlflow")


def installed(package: str) -> bool:
    """Whether `package` can be imported here (found, not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:
        return False
