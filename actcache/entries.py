"""A Fetch frame's entries as the client reads them: in the frame's bytes, in slots of the shared-memory
ring, or in columns of it (one block per tensor)."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

from actcache._proto import actcache_pb2 as pb
from actcache.codec import EntryHeader, parse_header_alone
from actcache.errors import ActCacheError
from actcache.rpc import decode_frame, split_payload
from actcache.shm import ClientSegment, SlotRun

__all__ = ["ColumnEntry", "ColumnRun", "EntryBatch", "entry_bytes"]


@dataclasses.dataclass(frozen=True, slots=True)
class ColumnRun:
    """Entries of one layout written as columns in a segment: tensor j of entry i is the ``layout.specs[j]``
    bytes at ``starts[j] + i * nbytes_j`` of ``segment.view``; ``position``: the first entry's in the schedule."""

    segment: ClientSegment
    position: int
    count: int
    starts: tuple[int, ...]
    layout: EntryHeader
    #: The entries' headers, ``layout.header_len`` bytes each.
    headers: memoryview

    def sub(self, skip: int, count: int) -> "ColumnRun":
        """Its entries ``skip .. skip + count - 1``."""
        hlen = self.layout.header_len
        starts = tuple(at + skip * spec.nbytes for at, spec in zip(self.starts, self.layout.specs))
        return ColumnRun(self.segment, self.position + skip, count, starts, self.layout,
                         self.headers[skip * hlen : (skip + count) * hlen])

    def entry(self, i: int) -> bytes:
        """Entry ``i`` rebuilt as one buffer (a copy: for the few a caller decodes one by one)."""
        layout, hlen = self.layout, self.layout.header_len
        out = bytearray(layout.total_len)
        out[:hlen] = self.headers[i * hlen : (i + 1) * hlen]
        view = self.segment.view
        for at, start, spec in zip(layout.offsets, self.starts, layout.specs):
            n = spec.nbytes
            out[hlen + at : hlen + at + n] = view[start + i * n : start + (i + 1) * n]
        return bytes(out)


class ColumnEntry:
    """One entry of a ColumnRun: its size as served (``len``); ``bytes()`` rebuilds it (``entry_bytes``)."""

    __slots__ = ("run", "index")

    def __init__(self, run: ColumnRun, index: int) -> None:
        self.run, self.index = run, index

    def __len__(self) -> int:
        return self.run.layout.total_len

    def __bytes__(self) -> bytes:
        return self.run.entry(self.index)


def entry_bytes(value: "bytes | memoryview | ColumnEntry") -> bytes | memoryview:
    """A served value as one buffer: itself, or a ColumnEntry rebuilt."""
    return bytes(value) if isinstance(value, ColumnEntry) else value


@dataclasses.dataclass(frozen=True, slots=True)
class EntryBatch:
    """The entries of one Fetch frame: positions ``start .. start + len - 1`` of the schedule. ``values[i]``
    is an uncompressed entry (``actcache.codec.decode_entry`` views its tensors; a ColumnEntry in a frame of
    columns: ``entry_bytes``), or None for a miss."""

    start: int
    sample_ids: Sequence[int]
    variants: Sequence[int]
    values: list[memoryview | ColumnEntry | None]
    #: "shared_memory" or "bytes" (the stream's first frame says; later frames repeat the stream's).
    data_plane: str = "bytes"
    #: Shared memory, when every entry is a hit of one size in consecutive slots: where they lie.
    run: SlotRun | None = None
    #: Shared memory, a frame of columns (FetchRequest.columns): where its entries' tensors lie.
    columns: ColumnRun | None = None
    #: Entries that came in the frame's payload on the shared-memory plane (larger than the ring, or the
    #: ring full of frames the client still uses).
    inline: int = 0

    @classmethod
    def from_frame(cls, frame: bytes | memoryview) -> "EntryBatch":
        """Parse one Fetch reply frame (payload views, no copies)."""
        header_bytes, payload = decode_frame(frame)
        return cls.from_bytes(pb.EntriesHeader.FromString(header_bytes), payload)

    @classmethod
    def from_bytes(cls, header: pb.EntriesHeader, payload: memoryview) -> "EntryBatch":
        """The entries of a frame that carries them in its payload."""
        values: list[memoryview | ColumnEntry | None] = [
            view if len(view) else None for view in split_payload(payload, header.lengths)]
        return cls(header.start, header.sample_ids, header.variants, values)

    @classmethod
    def from_slots(cls, header: pb.EntriesHeader, segment: "ClientSegment",
                   payload: bytes | memoryview = b"") -> "EntryBatch":
        """Views into ``segment`` for a frame of slot descriptors (offset 0: the entry is in the payload)."""
        if header.columns:
            return cls._from_columns(header, segment, memoryview(payload))
        if len(header.offsets) != len(header.lengths):
            raise ActCacheError(f"Fetch frame lists {len(header.lengths)} lengths but {len(header.offsets)} offsets")
        view = segment.view
        offsets, lengths = list(header.offsets), list(header.lengths)
        in_payload = [n for o, n in zip(offsets, lengths) if n and not o]
        inline = iter(split_payload(memoryview(payload), in_payload))
        values: list[memoryview | ColumnEntry | None] = [
            (view[o : o + n] if o else next(inline)) if n else None for o, n in zip(offsets, lengths)]
        size = lengths[0] if lengths else 0
        consecutive = size and offsets[0] and lengths.count(size) == len(lengths) and \
            offsets == list(range(offsets[0], offsets[0] + size * len(offsets), size))
        run = SlotRun(segment, offsets[0], size) if consecutive else None
        return cls(header.start, header.sample_ids, header.variants, values, "shared_memory", run,
                   inline=len(in_payload))

    @classmethod
    def _from_columns(cls, header: pb.EntriesHeader, segment: ClientSegment, payload: memoryview) -> "EntryBatch":
        count = len(header.lengths)
        layout = parse_header_alone(payload) if count else None
        if layout is None or len(payload) != count * layout.header_len or len(header.columns) != len(layout.specs):
            raise ActCacheError(f"Fetch frame of {count} entries in {len(header.columns)} columns carries "
                                f"{len(payload)} bytes of headers, which do not match")
        run = ColumnRun(segment, header.start, count, tuple(header.columns), layout, payload)
        values: list[memoryview | ColumnEntry | None] = [
            ColumnEntry(run, i) if n else None for i, n in enumerate(header.lengths)]
        return cls(header.start, header.sample_ids, header.variants, values, "shared_memory", columns=run)

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[tuple[int, int, int, memoryview | ColumnEntry | None]]:
        """(position, sample_id, variant, value) per entry."""
        variants = self.variants or [0] * len(self.values)
        return zip(range(self.start, self.start + len(self.values)), self.sample_ids, variants, self.values)
