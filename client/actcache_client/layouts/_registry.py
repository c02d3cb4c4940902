"""The registry of layout families: which networks each takes, and how it stages them.

Families are consulted in order: those a user registered (the latest first), then the built-in ones, by
type, then the guesses by attribute names, last. A family's layout is checked against the network's own
forward on the first batch (``layouts._check``), so a wrong guess is an error, never another computation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Union

from torch import nn

from actcache.errors import ConfigError
from actcache_client.layouts._base import Layout

__all__ = ["Family", "Match", "find_layout", "layout_families", "register_layout", "unregister_layout"]

Match = Union[type, tuple[type, ...], Callable[[nn.Module], bool]]


@dataclass(frozen=True)
class Family:
    """A registered family: ``name``, the networks it takes (``matches``) and how it stages one (``build``).

    Attributes:
        name: The family's name.
        matches: Whether the family takes a network.
        build: Stages a network it takes.
        guess: It matches by attribute names rather than by type (consulted after every family that
            matches by type).
        builtin: One of actcache's own families.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    build: Callable[[nn.Module], Layout]
    guess: bool = False
    builtin: bool = False


_FAMILIES: list[Family] = []


def _predicate(match: Match) -> Callable[[nn.Module], bool]:
    if isinstance(match, type) or (isinstance(match, tuple) and all(isinstance(t, type) for t in match)):
        return lambda net: isinstance(net, match)
    if callable(match):
        return match
    raise ConfigError(f"register_layout(match=...) is a type, a tuple of types or a predicate net -> bool, "
                      f"got {type(match).__name__}")


def register_layout(name: str, match: Match, build: Callable[[nn.Module], Layout], *, guess: bool = False,
                    replace: bool = False, _builtin: bool = False) -> None:
    """Register a family: networks that ``match`` (a type, types, or a predicate) are staged by ``build(net)``.

    A user's family is consulted before the built-in ones (the latest registered first), so it may take
    over a built-in type.

    Args:
        name: The family's name.
        match: A type, a tuple of types, or a predicate ``net -> bool``.
        build: ``build(net)`` returns the network's Layout.
        guess: It matches by attribute names rather than by type: consulted after every family that
            matches by type.
        replace: Replace a family of the same name.

    Raises:
        ConfigError: An empty name, ``build`` or ``match`` of the wrong kind, or the name is taken without
            ``replace``.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"register_layout needs a non-empty name, got {name!r}")
    if not callable(build):
        raise ConfigError(f"register_layout({name!r}, build=...) is a callable net -> Layout, "
                          f"got {type(build).__name__}")
    family = Family(name, _predicate(match), build, guess, _builtin)
    existing = [f.name for f in _FAMILIES]
    if name in existing:
        if not replace:
            raise ConfigError(f"a layout family named {name!r} is registered already; pass replace=True to "
                              "replace it, or choose another name")
        _FAMILIES.pop(existing.index(name))
    if _builtin:
        _FAMILIES.append(family)
    else:
        _FAMILIES.insert(0, family)


def unregister_layout(name: str) -> None:
    """Remove a family (a built-in one too).

    Args:
        name: The family's name.

    Raises:
        ConfigError: No family has that name.
    """
    names = [f.name for f in _FAMILIES]
    if name not in names:
        raise ConfigError(f"no layout family named {name!r}; registered: {names}")
    _FAMILIES.pop(names.index(name))


def layout_families() -> list[str]:
    """The registered families' names, in the order they are consulted."""
    return [f.name for f in _ordered()]


def _ordered() -> list[Family]:
    return [f for f in _FAMILIES if not f.guess] + [f for f in _FAMILIES if f.guess]


def find_layout(net: nn.Module) -> Layout:
    """The layout of the first family that takes ``net``.

    Args:
        net: The network.

    Raises:
        ConfigError: No family takes it (the message names the fixes), or a family built no Layout.
    """
    for family in _ordered():
        if family.matches(net):
            layout = family.build(net)
            if not isinstance(layout, Layout):
                raise ConfigError(f"layout family {family.name!r} built a {type(layout).__name__}, not a Layout")
            return layout if layout.family else replace(layout, family=family.name)
    raise ConfigError(
        f"actcache cannot tell the stages of a {type(net).__name__}: no registered layout family takes it "
        f"({', '.join(layout_families())}); if its blocks are an nn.ModuleList or nn.Sequential, pass "
        "blocks=\"<dotted path>\" (ActCache(net, blocks=\"encoder.layers\")); or register a family "
        "(actcache_client.layouts.register_layout); or pass stages=StagedModel([...]) built from the network's "
        "own modules, in the order it calls them"
    )
