"""The one rule both integrations share: freeze by hand (``depth``) or let a FreezeController decide, not both."""

from __future__ import annotations

from typing import Any

from actcache.errors import ConfigError

__all__ = ["check_freeze_choice"]


def check_freeze_choice(api: str, *, depth: object, at_name: str, at: Any, policy: Any,
                        eval_every: int | None) -> None:
    """ConfigError naming the fix: a freeze time without ``depth``, or ``depth`` with controller settings."""
    if depth is None and at is not None:
        raise ConfigError(f"{api}({at_name}={at!r}) needs depth=: the stages to freeze by hand "
                          "(without depth a FreezeController decides when and what to freeze)")
    if depth is not None and (policy is not None or eval_every is not None):
        raise ConfigError(f"{api}(depth=...) freezes by hand, policy= and eval_every= set the FreezeController "
                          f"that decides instead: pass depth= (and {at_name}=) or policy= (and eval_every=), not both")
