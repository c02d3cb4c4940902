"""The freeze timeline: one JSON object per line for every evaluation, reference build and cache plan.

Each record's ``event`` is ``evaluation``, ``reference`` or ``plan``; docs/guides/freeze-policies.md lists the fields.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import IO, Any

__all__ = ["Timeline", "read_timeline"]


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class Timeline:
    """Appends records to ``path`` (flushed per line, so a crash keeps them) and keeps them in ``records``.

    Non-finite numbers are written as null (JSON has no NaN).

    Args:
        path: The JSON-lines file (None: records are only kept).
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.records: list[dict[str, Any]] = []
        self._file: IO[str] | None = None

    def write(self, record: dict[str, Any]) -> None:
        """Append a record.

        Args:
            record: The record, JSON-serialisable.
        """
        record = _clean(record)
        self.records.append(record)
        if self.path is None:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_timeline(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a timeline file, in order.

    Args:
        path: The JSON-lines file ``FreezeController(timeline=...)`` wrote.
    """
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
