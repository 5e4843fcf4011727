"""Plan keys: dotted module names whose parts may use * wildcards (`layers.*.attn.qkv`), as the
tensor-parallel plans of framework.nn and transformers write them."""

from __future__ import annotations

import fnmatch


def matches(pattern: str, name: str) -> bool:
    """Whether a plan key (dotted, each part may use * wildcards) names this module."""
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(
        fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms, strict=True)
    )
