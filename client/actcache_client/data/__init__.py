"""Data: the cached loader, the identity of a dataset, per-sample seeds, and the checks of a wrapped loader."""

__all__: list[str] = []
