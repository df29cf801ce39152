"""Abstract resources (``{"GPU": 2}``): the one check of a map of them, for the wire,
the worker, the cluster and the client."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["resources_problem", "check_resources", "language_problem", "LANGUAGE_CHARS"]

#: the characters of a payload language's name ("python", "js", "c++", "r")
LANGUAGE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_+-.")


def language_problem(language: Any) -> str | None:
    """Why ``language`` is not the name of a payload language, or ``None``: 1 to 32
    characters of lower-case letters, digits and ``_+-.``."""
    if type(language) is not str or not 1 <= len(language) <= 32 or not set(language) <= LANGUAGE_CHARS:
        return f"a language is 1 to 32 characters of a-z, 0-9 and _+-., got {language!r:.60}"
    return None


def resources_problem(resources: dict[str, float] | None) -> str | None:
    """Why ``resources`` (name -> amount) is not a valid map of abstract resources, or
    ``None``: amounts are finite and not negative, names are non-empty, at most 64."""
    if not resources:
        return None
    if len(resources) > 64:
        return f"{len(resources)} resources (at most 64)"
    for name, amount in resources.items():
        if not name or len(name) > 200:
            return f"a resource name must have 1 to 200 characters, got {name!r:.60}"
        if not math.isfinite(amount) or amount < 0:
            return f"resource {name!r}: amount {amount!r} is not a finite number >= 0"
    return None


def check_resources(resources: Any, what: str = "resources") -> dict[str, float]:
    """``resources`` (a mapping of names to amounts; None: none) as ``{name: float}``.
    Raises ``TypeError`` for what is not a mapping of strings to numbers and
    ``ValueError`` for what :func:`resources_problem` finds; ``what`` names the
    argument in the message."""
    if resources is None:
        return {}
    if not isinstance(resources, Mapping):
        raise TypeError(f"{what} takes a mapping of names to amounts, e.g. {{'GPU': 2}}, got {resources!r:.100}")
    out: dict[str, float] = {}
    for name, amount in resources.items():
        if not isinstance(name, str):
            raise TypeError(f"{what}: names are strings, got {name!r:.60}")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise TypeError(f"{what}: amounts are numbers, got {amount!r:.60} for {name!r}")
        out[name] = float(amount)
    problem = resources_problem(out)
    if problem is not None:
        raise ValueError(f"{what}: {problem}")
    return out
