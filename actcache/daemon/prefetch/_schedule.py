"""A pushed sample order: numpy arrays of ids (and variants), assembled from chunks, and its counters.

An order of 10 M ids is 80 MB as uint64 and arrives in chunks of packed
little-endian arrays, so assembling it costs one copy and no Python ints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from actcache._proto import actcache_pb2 as pb
from actcache.daemon._tally import Tally
from actcache.errors import InvalidRequest
from actcache.keys import MAX_DEPTH, check_fingerprint, encode_keys

__all__ = ["MAX_SCHEDULE_LENGTH", "PrefetchCounters", "Schedule", "ScheduleBuilder", "unpack_ids", "unpack_variants"]

MAX_SCHEDULE_LENGTH = 1 << 31
_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass
class PrefetchCounters(Tally):
    """Counters of Fetch serving, per schedule and per namespace; exported by Stats (and metrics).

    Totals since the schedule was pushed (a namespace's: since the daemon
    started), in entries, bytes and seconds. ``add`` and ``snapshot`` (a
    consistent copy) are thread-safe.
    """

    #: Entries served with their bytes.
    hits: int = 0
    #: Entries served as misses (absent, or corrupt and deleted).
    misses: int = 0
    #: Entries that failed verification when read (also counted in ``misses``).
    corrupt: int = 0
    #: Entries that were ready when the consumer asked for them.
    ready_on_ask: int = 0
    #: Times the consumer had to wait for the reader, and for how long in total.
    stalls: int = 0
    stall_seconds: float = 0.0
    #: Value bytes read from the store (from disk when cold).
    read_bytes: int = 0
    #: Entry bytes sent to consumers.
    served_bytes: int = 0
    #: Entries the consumer read from the store itself (warm, over shared memory: _frames.py).
    direct: int = 0

    @staticmethod
    def hit_ratio(snapshot: dict[str, float]) -> float:
        """hits / (hits + misses) of a snapshot; 0.0 before anything was served."""
        total = snapshot["hits"] + snapshot["misses"]
        return snapshot["hits"] / total if total else 0.0


@dataclass(eq=False)
class Schedule:
    """One (namespace, schedule_id): the group it reads and its order. Immutable once built."""

    namespace_id: int
    schedule_id: str
    fingerprint: bytes
    depth: int
    sample_ids: np.ndarray  # uint64
    variants: np.ndarray | None  # uint16, or None for all 0
    counters: PrefetchCounters = field(default_factory=PrefetchCounters)

    def __len__(self) -> int:
        return len(self.sample_ids)

    def keys(self, start: int, stop: int) -> list[bytes]:
        """LMDB keys of positions ``start`` to ``stop`` (exclusive)."""
        variants = None if self.variants is None else self.variants[start:stop]
        return encode_keys(self.namespace_id, self.fingerprint, self.depth, self.sample_ids[start:stop], variants)

    def header(self, start: int, lengths: list[int]) -> pb.EntriesHeader:
        """The frame header of the ``len(lengths)`` positions from ``start``, of these served sizes."""
        stop = start + len(lengths)
        variants = [] if self.variants is None else self.variants[start:stop].tolist()
        return pb.EntriesHeader(start=start, sample_ids=self.sample_ids[start:stop].tolist(), variants=variants,
                                lengths=lengths)


def _unpack_packed(repeated, packed: bytes, field: str, dtype: str, what: str) -> np.ndarray | None:
    """A chunk's ``packed_<field>`` as little-endian ``dtype`` (None: not sent), checked against ``<field>``."""
    if packed and len(repeated):
        raise InvalidRequest(f"a ScheduleChunk carries both {field} and packed_{field}; send one of them")
    if not packed:
        return None
    width = np.dtype(dtype).itemsize
    if len(packed) % width:
        raise InvalidRequest(f"packed_{field} holds {len(packed)} bytes, not a multiple of {width} ({what})")
    return np.frombuffer(packed, dtype).astype(dtype.lstrip("<"), copy=False)


def unpack_ids(repeated, packed: bytes) -> np.ndarray:
    """Sample ids of a chunk from its repeated field or its packed little-endian uint64 bytes."""
    ids = _unpack_packed(repeated, packed, "sample_ids", "<u8", "uint64 ids")
    return np.array(repeated, dtype=np.uint64) if ids is None else ids


def unpack_variants(repeated, packed: bytes, count: int) -> np.ndarray | None:
    """Variants of a chunk (None = all 0), checked to be one per id and in 0..65535."""
    variants = _unpack_packed(repeated, packed, "variants", "<u2", "uint16 variants")
    if variants is None and len(repeated):
        wide = np.array(repeated, dtype=np.uint32)
        if wide.max() > 0xFFFF:
            raise InvalidRequest(f"variant {int(wide.max())} is out of range 0..65535")
        variants = wide.astype(np.uint16)
    if variants is not None and len(variants) != count:
        raise InvalidRequest(
            f"a ScheduleChunk has {len(variants)} variants for {count} sample ids; send one per id or none")
    return variants


class ScheduleBuilder:
    """Collects the chunks of one Schedule call and checks they agree."""

    def __init__(self) -> None:
        self._head: tuple[int, bytes, int, str] | None = None
        self._ids: list[np.ndarray] = []
        self._variants: list[np.ndarray | None] = []
        self._length = 0

    def add(self, namespace_id: int, fingerprint: bytes, depth: int, schedule_id: str, ids: np.ndarray,
            variants: np.ndarray | None) -> None:
        if self._head is None:
            if not _ID_RE.fullmatch(schedule_id or ""):
                raise InvalidRequest(
                    f"schedule id {schedule_id!r} is invalid; use 1-128 characters of A-Z a-z 0-9 . _ : -"
                )
            if depth > MAX_DEPTH:
                raise InvalidRequest(f"depth {depth} is out of range 0..{MAX_DEPTH}")
            self._head = (namespace_id, check_fingerprint(fingerprint), depth, schedule_id)
        else:
            ns, fp, dp, sid = self._head
            for name, given, first in (("namespace_id", namespace_id, ns), ("fingerprint", fingerprint, fp),
                                       ("depth", depth, dp), ("schedule_id", schedule_id, sid)):
                if given and given != first:
                    raise InvalidRequest(f"ScheduleChunk changes {name} from {first!r} to {given!r} within one push")
        self._length += len(ids)
        if self._length > MAX_SCHEDULE_LENGTH:
            raise InvalidRequest(
                f"a schedule holds at most {MAX_SCHEDULE_LENGTH} ids; split the order into several schedules")
        self._ids.append(ids)
        self._variants.append(variants)

    def build(self) -> Schedule:
        if self._head is None:
            raise InvalidRequest("the Schedule stream carried no chunk; send at least one naming the schedule")
        namespace_id, fingerprint, depth, schedule_id = self._head
        ids = np.concatenate(self._ids) if len(self._ids) != 1 else self._ids[0].copy()
        variants = None
        if any(v is not None for v in self._variants):
            variants = np.concatenate(
                [np.zeros(len(i), np.uint16) if v is None else v for i, v in zip(self._ids, self._variants)]
            )
            if not variants.any():
                variants = None
        return Schedule(namespace_id, schedule_id, fingerprint, depth, ids, variants)
