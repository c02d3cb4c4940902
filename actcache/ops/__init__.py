"""Operator tools behind the CLI: ``actcache clean`` and ``actcache bench disk``."""

__all__: list[str] = []
