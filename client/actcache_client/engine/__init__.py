"""Engine: the cached forward and its parts (frozen prefix, epoch plan, assembly, writer, audit, planner)."""

__all__: list[str] = []
