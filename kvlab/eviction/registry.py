"""Policies by their CLI/server spelling: ``--kv-policy NAME --kv-budget N|RATIO``."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvlab.eviction.base import EvictionPolicy
from kvlab.eviction.policies import H2O, AdaKV, Full, SnapKV, Streaming, Window

_CLASSES: dict[str, type[EvictionPolicy]] = {}


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Make ``cls`` (an ``EvictionPolicy`` subclass) available as ``kv_policy=cls.name``: the
    engine and the plain loop then run it through its hooks, with no edit anywhere else."""
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)) or not cls.name:
        raise ValueError(f"{cls!r} is not an EvictionPolicy subclass with a name")
    if _CLASSES.get(cls.name, cls) is not cls:
        raise ValueError(f"--kv-policy {cls.name} is already {_CLASSES[cls.name].__qualname__}")
    _CLASSES[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Forget a registered policy (the built-in ones stay)."""
    if name not in POLICIES:
        _CLASSES.pop(name, None)


def policy_class(name: str) -> type[EvictionPolicy]:
    """The class of ``--kv-policy name``; a one-line ValueError for an unknown name."""
    try:
        return _CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown --kv-policy {name!r}; choose {', '.join(_CLASSES)}") from None


def make_policy(name: str, budget: int | float | None = None, **settings: Any) -> EvictionPolicy:
    """``--kv-policy name --kv-budget budget``: the policy, or a one-line ValueError. ``settings``
    (``sinks``, ``obs_window``...) go to the policies that take them; the others ignore them, so
    one set of settings serves every policy (the page's eviction view runs them all)."""
    cls = policy_class(name)
    known = {f.name for c in _CLASSES.values() for f in fields(c)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"no eviction policy takes {', '.join(unknown)}")
    own = {f.name for f in fields(cls)}
    return cls(budget, **{k: v for k, v in settings.items() if k in own})


def parse_budget(text: str | int | float | None) -> int | float | None:
    """``--kv-budget``: whole tokens per sequence ("256") or a ratio of the context ("0.25")."""
    if text is None or isinstance(text, (int, float)):
        return text
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--kv-budget takes tokens (256) or a ratio of the context (0.25), "
                         f"not {text!r}") from None


for _cls in (Full, Window, Streaming, H2O, SnapKV, AdaKV):
    register(_cls)
POLICIES = tuple(_CLASSES)  # the built-in policies, in the CLI's order
