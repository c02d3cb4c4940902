"""Consecutive batches of one (fingerprint, depth) put together: one wake of the writer thread and one put
for several batches, each of which costs the training thread a share of the GIL."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from actcache.codec import TensorSpec

__all__ = ["Columns", "Encode", "Encoding", "PutGathering", "PutGroup"]

Encode = Callable[[], list[bytes | memoryview]]
Encoding = Callable[[list[bytes | memoryview]], str]
Columns = Callable[[], tuple[list[TensorSpec], list[np.ndarray]]]


@dataclass(eq=False)
class PutGroup:
    """Batches waiting to be put together (``Connection.store``'s arguments, batch by batch)."""

    fingerprint: bytes
    depth: int
    encoding: Encoding | None
    ids: list[int] = field(default_factory=list)
    variants: list[int] = field(default_factory=list)
    nbytes: int = 0  # of the batches' tensors
    last_added: float = 0.0  # time.monotonic() of the last batch added
    _encodes: list[Encode] = field(default_factory=list)
    _columns: list[Columns] = field(default_factory=list)

    def add(self, ids: Sequence[int], variants: Sequence[int], encode: Encode, columns: Columns, nbytes: int,
            now: float) -> None:
        self.last_added = now
        self.ids += ids
        self.variants += variants
        self.nbytes += nbytes
        self._encodes.append(encode)
        self._columns.append(columns)

    def encode(self) -> list[bytes | memoryview]:
        """The entries of every batch, in order."""
        return [entry for encode in self._encodes for entry in encode()]

    def columns(self) -> tuple[list[TensorSpec], list[list[np.ndarray]]] | None:
        """The batches' tensors as ``(specs, parts)``: ``parts[k][j]`` is tensor j of batch k (as
        ``RpcClient.put_columns`` takes them); None if their per-sample layouts differ."""
        laid = [columns() for columns in self._columns]
        specs = laid[0][0]
        if any(other != specs for other, _ in laid[1:]):
            return None
        return specs, [arrays for _, arrays in laid]


class PutGathering:
    """The puts gathered on the training thread: one group at a time, queued by whichever thread takes it
    (thread-safe).

    Args:
        max_bytes: A group of this many bytes of tensors is due at once.
        linger_s: A group nothing was added to for this long is due (an epoch's last batches).
    """

    def __init__(self, max_bytes: int, linger_s: float) -> None:
        self.max_bytes, self.linger_s = max_bytes, linger_s
        self._lock = threading.Lock()
        self._group: PutGroup | None = None

    def add(self, fingerprint: bytes, depth: int, encoding: Encoding | None, ids: Sequence[int], variants: Sequence[int],
            encode: Encode, columns: Columns, nbytes: int) -> list[PutGroup]:
        """Add a batch; returns the groups now due, in order: another fingerprint's gathered before, and
        this one once it holds ``max_bytes``."""
        with self._lock:
            group, due = self._group, []
            if group is None or (group.fingerprint, group.depth) != (fingerprint, depth):
                due = [group] if group is not None else []
                group = PutGroup(fingerprint, depth, encoding)
            group.add(ids, variants, encode, columns, nbytes, time.monotonic())
            group.encoding = encoding
            full = group.nbytes >= self.max_bytes
            self._group = None if full else group
        return due + [group] if full else due

    def holding(self) -> bool:
        """Whether a group is being gathered."""
        return self._group is not None

    def take(self, *, idle: bool = False) -> PutGroup | None:
        """The group gathered, if any; ``idle``: only once nothing was added to it for ``linger_s``."""
        with self._lock:
            group = self._group
            if group is None or (idle and time.monotonic() - group.last_added < self.linger_s):
                return None
            self._group = None
            return group
