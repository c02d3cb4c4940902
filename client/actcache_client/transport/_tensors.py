"""Stage states <-> cache entries: one entry per sample, collated back into batches.

A batch state is a tensor ``(B, ...)`` or a tuple of them; each sample's slice is one entry
(actcache.codec). With a ``VarLen`` layout only a sample's real tokens are stored, and the attention mask
is rebuilt when batches are collated (right padding to the batch's longest sample). A ``StorePrecision``
stores floating-point outputs in 16 bits (their keys carry ``key_tag``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from actcache.codec import DType, EntryHeader, TensorSpec, decode_entry, encode_batch, encode_entry
from actcache.entries import ColumnEntry, ColumnRun, entry_bytes
from actcache.errors import ConfigError, InvalidRequest
from actcache.served import uniform_layout, uniform_rows
from actcache.shm import SlotRun
from actcache_client.transport._state import State, map_state, tensors_of

__all__ = ["RowCopier", "StorePrecision", "VarLen", "check_fixed_length", "collate_entries", "column_state",
           "copy_rows", "encode_samples", "run_layout", "sample_columns", "split_rows"]

_TO_CODEC = {getattr(torch, d.name): d for d in DType}  # DType names are torch dtype names
_TO_TORCH = {v: k for k, v in _TO_CODEC.items()}


@dataclass(frozen=True)
class VarLen:
    """A ``(hidden (B, L, ...), mask (B, L))`` state whose padding is not stored.

    Padding must be on the right (a sample's mask is ones then zeros).

    Attributes:
        mask_index: The position of the 0/1 attention mask in the state tuple.
        mask_dtype: The dtype the served mask is cast to.
    """

    mask_index: int = 1
    mask_dtype: torch.dtype = torch.int64


class StorePrecision:
    """``store_dtype`` (None: as computed) and ``compute_dtype`` (the stages'), and casts between them."""

    def __init__(self, store_dtype: torch.dtype | None, compute_dtype: torch.dtype) -> None:
        if store_dtype not in (None, torch.float16, torch.bfloat16):
            raise ConfigError(f"store_dtype must be torch.float16, torch.bfloat16 or None, got {store_dtype}")
        self.store_dtype = store_dtype
        self.compute_dtype = compute_dtype
        self.key_tag = b"" if store_dtype is None else f"store:{store_dtype}".encode()

    def to_stored(self, state: State) -> State:
        """``state`` as it is stored (computed outputs cast to ``store_dtype``)."""
        return state if self.store_dtype is None else _cast(state, self.compute_dtype, self.store_dtype)

    def to_compute(self, state: State) -> State:
        """A served ``state`` back in the precision the stages compute in."""
        return state if self.store_dtype is None else _cast(state, self.store_dtype, self.compute_dtype)


def _cast(state: State, source: torch.dtype, target: torch.dtype) -> State:
    return map_state(state, lambda t: t.to(target) if t.dtype == source else t)


def _state(tensors: list[Tensor]) -> State:
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


RowCopy = Callable[[Sequence[tuple[np.ndarray, np.ndarray]]], None]


def copy_rows(rows: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """``dst[:] = src`` for each pair, on this thread."""
    for dst, src in rows:
        dst[:] = src


class RowCopier:
    """Copies a batch's rows on ``threads`` threads (numpy copies without the GIL), each a share of the rows,
    when the batch holds at least ``min_bytes`` (below it, handing work to threads costs more than it saves)."""

    def __init__(self, threads: int, *, min_bytes: int = 4 << 20) -> None:
        self.threads = max(1, threads)
        self.min_bytes = min_bytes
        self._pool: ThreadPoolExecutor | None = None  # made on first use

    def __call__(self, rows: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        if self.threads == 1 or sum(src.nbytes for _, src in rows) < self.min_bytes:
            copy_rows(rows)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="actcache-copy")
        list(self._pool.map(copy_rows, [rows[k::self.threads] for k in range(self.threads)]))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def encode_samples(state: State, *, zstd_level: int = 0, varlen: VarLen | None = None) -> list[bytes | memoryview]:
    """Encode each sample of a batch state as one entry (on CPU; a copy is made off-device)."""
    tensors = _cpu_tensors(state)
    batch = tensors[0].shape[0]
    lengths = _lengths(tensors, varlen) if varlen else None
    stored = [t for j, t in enumerate(tensors) if not (varlen and j == varlen.mask_index)]
    _check_dtypes(stored)
    if lengths is None and not zstd_level:  # rows of one shape: the header laid out once, one copy per entry
        return [memoryview(row).toreadonly() for row in encode_batch(*_uint8_columns(stored))]
    out: list[bytes | memoryview] = []
    for i in range(batch):
        parts = [(t[i] if lengths is None else t[i, : lengths[i]]).contiguous() for t in stored]
        specs = [TensorSpec(_TO_CODEC[p.dtype], tuple(p.shape)) for p in parts]
        data = [p.reshape(-1).view(torch.uint8).numpy().data.cast("B") for p in parts]
        out.append(encode_entry(specs, data, zstd_level=zstd_level))
    return out


def sample_columns(state: State) -> tuple[list[TensorSpec], list[np.ndarray]]:
    """The tensors of a batch state of one shape per sample as ``(specs, columns)``: ``columns[j]`` holds
    tensor j of every sample, a ``(batch, bytes)`` uint8 row each, on the CPU (what ``encode_batch`` and a
    shared-memory put of columns take). Raises InvalidRequest as ``encode_samples`` does."""
    tensors = _cpu_tensors(state)
    _check_dtypes(tensors)
    return _uint8_columns(tensors)


def _cpu_tensors(state: State) -> list[Tensor]:
    """The tensors of a batch state on the CPU (a copy is made off-device), checked to share the batch dimension."""
    tensors = [t.detach().to("cpu") for t in tensors_of(state)]
    batch = tensors[0].shape[0]
    if any(t.dim() == 0 or t.shape[0] != batch for t in tensors):
        raise InvalidRequest(f"every tensor of a state needs the batch dimension {batch}; "
                             f"shapes {[tuple(t.shape) for t in tensors]}")
    return tensors


def _check_dtypes(tensors: Sequence[Tensor]) -> None:
    unsupported = next((t.dtype for t in tensors if t.dtype not in _TO_CODEC), None)
    if unsupported is not None:
        supported = ", ".join(str(d) for d in _TO_CODEC)
        raise InvalidRequest(f"cannot cache tensors of dtype {unsupported}; supported: {supported}")


def _uint8_columns(tensors: Sequence[Tensor]) -> tuple[list[TensorSpec], list[np.ndarray]]:
    batch = tensors[0].shape[0]
    specs = [TensorSpec(_TO_CODEC[t.dtype], tuple(t.shape[1:])) for t in tensors]
    return specs, [t.contiguous().reshape(batch, -1).view(torch.uint8).numpy() for t in tensors]


def check_fixed_length(state: State, seen: dict[int, list[tuple[int, ...]]], depth: int) -> None:
    """Raise if ``state`` (stored without VarLen) holds padded sequences: a 0/1 integer ``(B, L)`` tensor with
    zeros beside a ``(B, L, ...)`` one, or per-sample shapes other than depth ``depth``'s first (in ``seen``)."""
    tensors = tensors_of(state)
    shapes = [tuple(t.shape[1:]) for t in tensors]
    first = seen.setdefault(depth, shapes)
    masks = [t for t in tensors if t.dim() == 2 and not t.is_floating_point() and bool(((t == 0) | (t == 1)).all())]
    padded = next((m for m in masks if any(u.dim() > 2 and u.shape[:2] == m.shape for u in tensors)
                   and not bool(m.all())), None)
    if padded is None and shapes == first:
        return
    found = ", ".join(f"{t.dtype}{list(t.shape)}".replace("torch.", "") for t in tensors)
    why = (f"its sequences are padded to the batch's longest ({int(padded.sum(1).min())} to {padded.shape[1]} tokens)"
           if padded is not None else f"its per-sample shapes changed from {first} to {shapes}")
    raise ConfigError(
        f"the frozen prefix's output at depth {depth} ({found}) cannot be cached one fixed shape per sample: {why}; "
        "pass varlen=VarLen() (ActCache(net, stages=..., varlen=VarLen()), or CachedForward(..., varlen=VarLen())) "
        "so that each sample is stored at its own length"
    )


def _lengths(tensors: Sequence[Tensor], varlen: VarLen) -> list[int]:
    mask = tensors[varlen.mask_index]
    if mask.dim() != 2:
        raise InvalidRequest(f"VarLen mask must be (batch, length), got shape {tuple(mask.shape)}")
    lengths = mask.ne(0).sum(dim=1)
    positions = torch.arange(mask.shape[1])
    if not torch.equal(mask.ne(0), positions[None, :] < lengths[:, None]):
        raise InvalidRequest("VarLen needs right padding: each mask row must be ones followed by zeros")
    return lengths.tolist()


def collate_entries(entries: Sequence[bytes | memoryview | ColumnEntry], *, varlen: VarLen | None = None,
                    alloc: Callable[[tuple[int, ...], torch.dtype], Tensor] | None = None, verify: bool = True,
                    run: SlotRun | None = None, columns: ColumnRun | None = None, copy: RowCopy = copy_rows,
                    length: int | None = None) -> State:
    """Decode one entry per sample and stack them into a batch state in tensors ``alloc`` returns (default: host
    memory). ``verify=False`` skips the checksums (entries the daemon verified); ``run``: the entries'
    consecutive slots in one buffer (one copy per tensor); ``columns``: the entries written as columns (one
    copy per tensor); ``copy``: how sample rows are copied (a RowCopier spreads a large batch over threads);
    ``length``: with ``varlen``, pad to at least this many positions (the batch's input length, so that the
    next module takes the state as it is)."""
    alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
    count = len(entries)
    if columns is not None and not verify and not varlen and columns.count == count:
        return column_state(columns, alloc)[0]
    if not verify and not varlen and entries and all(isinstance(e, ColumnEntry) for e in entries):
        gathered = _gather_columns(entries, alloc)  # type: ignore[arg-type]  # all ColumnEntry
        if gathered is not None:
            return gathered
    if run is not None and not verify and not varlen:
        in_ring = _rows(run, count)
        header = uniform_rows(in_ring)
        if header is not None:
            return _columns(header, in_ring, alloc)
    buffers = [entry_bytes(e) for e in entries]  # a ColumnEntry is rebuilt
    layout = None if verify or varlen else uniform_layout(buffers)
    if layout is not None:
        return _columns(layout, buffers, alloc)
    decoded = [decode_entry(e, verify=verify) for e in buffers]
    lengths = [h.specs[0].shape[0] for h, _ in decoded] if varlen else None
    width = max(max(lengths), length or 0) if lengths else 0
    out: list[Tensor] = []
    rows: list[tuple[np.ndarray, np.ndarray]] = []  # (destination, source) per sample and tensor
    for j, spec in enumerate(decoded[0][0].specs):
        inner = spec.shape[1:] if varlen else spec.shape
        batch = alloc((count, width, *inner) if varlen else (count, *inner), _TO_TORCH[spec.dtype])
        target = _bytes_view(batch, count)
        for i, (header, raw) in enumerate(decoded):
            s = header.specs[j]
            if s.dtype != spec.dtype or (s.shape[1:] if varlen else s.shape) != inner:
                raise InvalidRequest(f"sample {i} tensor {j} is {s.dtype.name}{list(s.shape)}, "
                                     f"batch expects {spec.dtype.name}{list(spec.shape)}")
            if varlen:
                target[i, s.nbytes:] = 0  # the padding only: each byte is written once
            rows.append((target[i, : s.nbytes], np.frombuffer(raw, np.uint8, s.nbytes, header.offsets[j])))
        out.append(batch)
    copy(rows)
    if varlen:
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        out.insert(varlen.mask_index, mask.to(varlen.mask_dtype))
    return _state(out)


def column_state(columns: ColumnRun, alloc: Callable[[tuple[int, ...], torch.dtype], Tensor] | None = None
                 ) -> tuple[State, np.ndarray | None]:
    """The batch state of ``columns``: copied into tensors ``alloc`` returns, or without ``alloc`` the
    tensors as they lie in the segment, with the array they all view (alive as long as one of them or a
    tensor viewing them is: the caller holds the segment with it, ``ClientSegment.hold``)."""
    specs, count = columns.layout.specs, columns.count
    first = columns.starts[0] if specs else 0
    span = max((at + count * s.nbytes for at, s in zip(columns.starts, specs)), default=first) - first
    base = np.frombuffer(columns.segment.view, np.uint8, span, first)
    ring = torch.from_numpy(base) if alloc is None else None
    make = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
    out: list[Tensor] = []
    for at, spec in zip(columns.starts, specs):
        dtype, nbytes = _TO_TORCH[spec.dtype], count * spec.nbytes
        if ring is not None and nbytes:
            out.append(ring[at - first : at - first + nbytes].view(dtype).view(count, *spec.shape))
            continue
        batch = make((count, *spec.shape), dtype)
        if nbytes:
            _bytes_view(batch, count).reshape(-1)[:] = base[at - first : at - first + nbytes]
        out.append(batch)
    return _state(out), base if ring is not None else None


def _gather_columns(entries: Sequence[ColumnEntry], alloc: Callable[[tuple[int, ...], torch.dtype], Tensor]
                    ) -> State | None:
    """A batch of entries lying in columns (of one layout, from one frame or several): one copy per tensor
    and run of consecutive entries; None if their layouts differ."""
    specs = entries[0].run.layout.specs
    if any(e.run.layout.specs != specs for e in entries):
        return None
    count = len(entries)
    groups: list[tuple[ColumnRun, int, int]] = []  # (run, first index, entries)
    for e in entries:
        if groups and groups[-1][0] is e.run and groups[-1][1] + groups[-1][2] == e.index:
            groups[-1] = (e.run, groups[-1][1], groups[-1][2] + 1)
        else:
            groups.append((e.run, e.index, 1))
    out: list[Tensor] = []
    for j, spec in enumerate(specs):
        batch = alloc((count, *spec.shape), _TO_TORCH[spec.dtype])
        if spec.nbytes:
            target, row = _bytes_view(batch, count), 0
            for run, first, n in groups:
                source = np.frombuffer(run.segment.view, np.uint8, n * spec.nbytes, run.starts[j] + first * spec.nbytes)
                target[row : row + n] = source.reshape(n, spec.nbytes)
                row += n
        out.append(batch)
    return _state(out)


def run_layout(run: SlotRun, count: int) -> EntryHeader | None:
    """The layout of ``count`` entries in consecutive slots when they share one, uncompressed (else None)."""
    return uniform_rows(_rows(run, count))


def split_rows(rows: Tensor, header: EntryHeader) -> State:
    """The batch state held by ``rows`` (uint8, one entry of ``header``'s layout per row), on rows' device."""
    return _state([rows[:, part].contiguous().view(_TO_TORCH[spec.dtype]).view(len(rows), *spec.shape) if spec.nbytes
                   else torch.empty((len(rows), *spec.shape), dtype=_TO_TORCH[spec.dtype], device=rows.device)
                   for spec, part in _tensor_columns(header)])


def _tensor_columns(header: EntryHeader) -> list[tuple[TensorSpec, slice]]:
    """Each tensor of ``header``'s layout and the bytes of an entry that hold it."""
    starts = [header.header_len + at for at in header.offsets]
    return [(spec, slice(start, start + spec.nbytes)) for spec, start in zip(header.specs, starts)]


def _rows(run: SlotRun, count: int) -> np.ndarray:
    return np.frombuffer(run.segment.view, np.uint8, count * run.size, run.offset).reshape(count, run.size)


def _bytes_view(batch: Tensor, count: int) -> np.ndarray:
    flat = batch.view(count, -1).view(torch.uint8) if batch.numel() else batch.view(torch.uint8)
    return flat.numpy().reshape(count, -1)


def _columns(header: EntryHeader, entries: np.ndarray | Sequence[bytes | memoryview], alloc: Callable) -> State:
    """A batch of entries of ``header``'s layout (the rows of a uint8 array, or buffers): one copy per tensor
    from the array, one per entry and tensor from buffers."""
    count = len(entries)
    out: list[Tensor] = []
    for spec, part in _tensor_columns(header):
        batch = alloc((count, *spec.shape), _TO_TORCH[spec.dtype])
        target = _bytes_view(batch, count) if spec.nbytes else None
        if target is not None and isinstance(entries, np.ndarray):
            target[:] = entries[:, part]
        elif target is not None:
            for i, entry in enumerate(entries):
                target[i] = np.frombuffer(entry, np.uint8, spec.nbytes, part.start)
        out.append(batch)
    return _state(out)
