"""Whether a spawned process can start from this script: the check behind EgeriaPolicy's construction.

A spawned process (the reference model's) imports the main script again before it runs anything; code at
the script's top level outside ``if __name__ == "__main__":`` runs again there: the training starts over
in the child, which dies at its own first spawn, and the parent goes on without the reference model.
``check_main_guard`` finds the line of the main script that is running now and raises a ConfigError
when it is outside such a block. Interactive sessions, ``python -c`` and notebooks have no script to import
again and are never refused.
"""

from __future__ import annotations

import ast
import inspect
import sys
from types import FrameType

from actcache.errors import ConfigError

__all__ = ["check_main_guard"]


def check_main_guard(what: str) -> None:
    """ConfigError naming the ``__main__`` guard when ``what`` is being set up by the main script's top-level
    code outside ``if __name__ == "__main__":``."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or getattr(main, "__name__", "") != "__main__":
        return
    frame = _top_level_frame(vars(main))
    if frame is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return
    line = frame.f_lineno
    if any(node.lineno <= line <= (node.end_lineno or node.lineno) for node in _guards(tree)):
        return
    raise ConfigError(
        f"{what} starts its reference model in a spawned process, which imports {path} again and would run "
        f"its training again from line {line} (and die there, leaving this run without freezing); put the "
        "script's training under `if __name__ == \"__main__\":` (e.g. `def main(): ...` and, at the end, "
        "`if __name__ == \"__main__\": main()`)"
    )


def _top_level_frame(main_globals: dict) -> FrameType | None:
    """The frame running the main script's top-level code, if it is on this thread's stack."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is main_globals:
            return frame
        frame = frame.f_back
    return None


def _guards(tree: ast.Module) -> list[ast.If]:
    """The script's ``if __name__ == "__main__":`` blocks."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.If) and _is_main_test(node.test)]


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    values = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(values) == 1
