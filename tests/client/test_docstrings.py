"""Every public class and function of ``actcache_client`` documents its parameters in a Google-style section
(``Args:``, or ``Attributes:`` for a dataclass), one entry per parameter, so the API reference renders a table."""

import dataclasses
import inspect
import re

import pytest

import actcache_client

_SECTION = re.compile(r"^(Args|Attributes):\n((?:[ \t]+.*\n|\n)*)", re.MULTILINE)
_ENTRY = re.compile(r"^ {4}(\*{0,2}\w+)(?: \([^)]*\))?:", re.MULTILINE)


def _documented(doc: str) -> set[str]:
    names: set[str] = set()
    for match in _SECTION.finditer(doc + "\n"):
        names |= {name.lstrip("*") for name in _ENTRY.findall(match.group(2))}
    return names


def _parameters(obj: object) -> list[str]:
    if getattr(obj, "_is_protocol", False):
        return []  # an interface: never constructed
    if inspect.isclass(obj) and not dataclasses.is_dataclass(obj) and "__init__" not in vars(obj):
        inits = [c for c in obj.__mro__[1:] if "__init__" in vars(c)]
        if not inits or inits[0] is object or not inits[0].__module__.startswith("actcache_client"):
            return []  # no constructor of its own (an enum, a protocol, a warning)
    return [p for p in inspect.signature(obj).parameters if not p.startswith("_")]


PUBLIC = [name for name in actcache_client.__all__
          if inspect.isclass(getattr(actcache_client, name)) or inspect.isfunction(getattr(actcache_client, name))]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_parameter_is_documented(name):
    obj = getattr(actcache_client, name)
    missing = [p for p in _parameters(obj) if p not in _documented(inspect.getdoc(obj) or "")]
    assert not missing, f"{name}'s docstring has no Args/Attributes entry for {missing}"
