"""Optimizers the framework provides (not a plugin family): `Muon`, torch's Muon update for the
hidden 2-D weights and AdamW for the rest, in one optimizer that runs under every layout
(framework/optim/muon.py). Importing this package imports no torch."""

from __future__ import annotations

from typing import Any

__all__ = ["Muon"]


def __getattr__(name: str) -> Any:
    # `task.optimizer._target_=framework.optim.Muon` names it here; torch loads with it
    if name == "Muon":
        from framework.optim.muon import Muon

        return Muon
    raise AttributeError(name)
