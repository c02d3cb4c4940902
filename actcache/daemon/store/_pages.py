"""LMDB's B-tree leaf pages, read from ``data.mdb`` by page number: where a value's overflow pages
start, the nodes of a whole leaf page, and which keys are stored, a leaf page at a time.

Why: positioning a cursor on a cold value reads that value's first page, one random read per
lookup; a whole leaf page answers for about 80 keys.

LMDB's on-disk format: a page starts with a 16-byte header (``pgno`` u64, ``pad``, ``flags``,
``lower``, ``upper`` u16), then on a leaf ``(lower - 16) / 2`` u16 offsets of its nodes, in key
order, each at or above ``upper``. A node is ``lo, hi, flags, ksize`` (four u16), its key, then its
data: with ``F_BIGDATA``, the number of its first overflow page; the value then is ``lo | hi << 16``
bytes at file offset ``pgno * page_size + 16``.

A positioned cursor's ``key()`` is a view into its leaf page in the map (``buffers=True``): its
address minus the start of the mapping (``/proc/self/maps``) gives the page number and the node's
offset. The page is then read with ``pread``, never through the address, and checked (its page
number, type, bounds, node offsets, the node holding the cursor's key). Whatever does not match is
"not recognized" and callers take LMDB's own way: an unknown layout costs speed, never bytes. The
store checks at open that this LMDB's layout is read (``check_layout``) and turns the reader off
otherwise.
"""

from __future__ import annotations

import os
import struct
from typing import Sequence

import numpy as np

__all__ = ["LeafPages", "PAGE_HEADER_BYTES", "check_layout", "is_overflow_page"]

PAGE_HEADER_BYTES = 16
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_F_BIGDATA = 0x01
_F_SUBDATA_OR_DUP = 0x02 | 0x04
_P_LEAF = 0x02
_P_OVERFLOW = 0x04
_P_TYPES = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40  # branch, leaf, overflow, meta, leaf2, subpage
_PGNO = struct.Struct("<Q")
_PAGE_HEAD = struct.Struct("<QHH")  # pgno, pad, flags
_PAGE_BOUNDS = struct.Struct("<QHHHH")  # pgno, pad, flags, lower (end of the node offsets), upper

# Keys check_layout writes into the meta table and deletes again: a value in overflow pages, one in its leaf.
_PROBE_BIG = b"\xffpage-layout-check:overflow".ljust(32, b"\0")
_PROBE_SMALL = b"\xffpage-layout-check:inline".ljust(32, b"\0")


def is_overflow_page(header: bytes | memoryview, offset: int, page_size: int) -> bool:
    """Whether ``header`` (a page's first bytes) is the overflow page at file ``offset``."""
    pgno, _, flags = _PAGE_HEAD.unpack_from(header)
    return pgno * page_size == offset and flags & _P_TYPES == _P_OVERFLOW


class LeafPages:
    """Leaf pages of one ``data.mdb``, read by ``pread`` on ``fd``; thread-safe. ``enabled`` False (the
    layout check failed) makes every answer "not recognized". Call ``remapped()`` after LMDB moved its
    map (``set_mapsize``), while no transaction is open in the process."""

    def __init__(self, fd: int, page_size: int) -> None:
        self._fd = fd
        self.page_size = page_size
        self.enabled = True
        self._map: tuple[int, int] | None = None  # [start, end) of data.mdb's mapping; None: look it up

    def remapped(self) -> None:
        self._map = None

    def overflow_node(self, cursor, key: bytes) -> tuple[int, int] | None:
        """(first overflow page, value size) of ``key``, on whose node the cursor sits, or None if not
        recognized (a small value inside its leaf included)."""
        found = self._cursor_page(cursor)
        if found is None or found[1][0] != key or found[1][2] < 0:
            return None
        return found[1][2], found[1][1]

    def leaf_nodes(self, cursor) -> list[tuple[bytes, int, int]]:
        """``(key, data size, first overflow page or -1)`` of every node, in key order, on the leaf
        page the cursor sits on: [] if the page is not recognized."""
        found = self._cursor_page(cursor)
        parsed = [] if found is None else [_node(found[0], at) for at in found[2]]
        nodes = [node for node in parsed if node is not None]
        if len(nodes) < len(parsed) or any(a[0] >= b[0] for a, b in zip(nodes, nodes[1:])):
            return []
        return nodes

    def present_keys(self, cursor, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` is stored, reading no value past its first page: keys are looked up in
        order, and each lookup's whole leaf page answers for every key in its range, one random read per
        leaf page (about 80 entries) instead of one per key. Keys of whose range nothing is stored (an epoch
        that writes) cost one lookup and no sort."""
        out = [False] * len(keys)
        if not keys or not cursor.set_range(min(keys)) or bytes(cursor.key()) > max(keys):
            return out
        order = sorted(range(len(keys)), key=keys.__getitem__)
        i = 0
        while i < len(order):
            key = keys[order[i]]
            if not cursor.set_range(key):  # nothing at or after it: the rest are absent
                break
            # set_range lands on the smallest stored key >= key: keys up to the page's last are stored iff on it
            page = [node[0] for node in self.leaf_nodes(cursor)] or [bytes(cursor.key())]
            last, on_page = page[-1], set(page)
            while i < len(order) and keys[order[i]] <= last:
                out[order[i]] = keys[order[i]] in on_page
                i += 1
        return out

    def stored_length(self, cursor, key: bytes) -> int | None:
        """Size of the value under ``key`` (None if absent) without reading its pages past the first."""
        if not cursor.set_key(key):
            return None
        node = self.overflow_node(cursor, key)
        return node[1] if node is not None else len(cursor.value())

    def _cursor_page(self, cursor) -> tuple[bytes, tuple[bytes, int, int], tuple[int, ...]] | None:
        """``(page, the cursor's node as _node reads it, every node offset)`` of the leaf the cursor sits on,
        read and checked (its header, its node offsets, the node holding the cursor's key); None if anything
        is not recognized."""
        if not self.enabled:
            return None
        key_view = cursor.key()
        if self._map is None:
            self._map = _mapping_of(self._fd)
        start, end = self._map
        node_address = _address(key_view) - _NODE.size
        if not start <= node_address < end:
            return None
        pgno, at = divmod(node_address - start, self.page_size)
        try:
            page = os.pread(self._fd, self.page_size, pgno * self.page_size)
        except OSError:
            return None
        bounds = _leaf_bounds(page, pgno, self.page_size)
        if bounds is None:
            return None
        offsets = struct.unpack_from(f"<{(bounds[0] - PAGE_HEADER_BYTES) // 2}H", page, PAGE_HEADER_BYTES)
        if at not in offsets or min(offsets) < bounds[1] or max(offsets) > self.page_size - _NODE.size:
            return None
        node = _node(page, at)
        return None if node is None or node[0] != key_view else (page, node, offsets)


def _leaf_bounds(page: bytes, pgno: int, page_size: int) -> tuple[int, int] | None:
    """``(lower, upper)`` of leaf page ``pgno``, or None unless its header says it is that leaf page,
    with its node offsets (16 to ``lower``) below its nodes (``upper`` to the end)."""
    if len(page) != page_size:
        return None
    own, _, flags, lower, upper = _PAGE_BOUNDS.unpack_from(page)
    if own != pgno or flags & _P_TYPES != _P_LEAF or not PAGE_HEADER_BYTES <= lower <= upper <= page_size:
        return None
    return None if (lower - PAGE_HEADER_BYTES) % 2 else (lower, upper)


def _node(page: bytes, at: int) -> tuple[bytes, int, int] | None:
    """``(key, data size, first overflow page or -1)`` of the node at ``at`` (an offset checked to lie
    inside the page's node area), or None if it runs past the page."""
    lo, hi, flags, ksize = _NODE.unpack_from(page, at)
    end = at + _NODE.size + ksize
    big = flags & _F_BIGDATA and not flags & _F_SUBDATA_OR_DUP
    if end + (_PGNO.size if big else 0) > len(page):
        return None
    return page[at + _NODE.size : end], lo | hi << 16, _PGNO.unpack_from(page, end)[0] if big else -1


def _mapping_of(fd: int) -> tuple[int, int]:
    """``[start, end)`` of this process's one mapping of ``fd``'s file from offset 0; ``(0, 0)`` if
    there is none, or several, or the system does not say (no ``/proc``)."""
    st = os.fstat(fd)
    found: list[tuple[int, int]] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 5 or fields[4] != str(st.st_ino) or int(fields[2], 16) != 0:
                    continue
                if os.makedev(*(int(x, 16) for x in fields[3].split(":"))) == st.st_dev:
                    start, end = fields[0].split("-")
                    found.append((int(start, 16), int(end, 16)))
    except (OSError, ValueError):
        return 0, 0
    return found[0] if len(found) == 1 else (0, 0)


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).__array_interface__["data"][0]  # .ctypes.data builds a ctypes object


def check_layout(env, db, pages: LeafPages) -> str | None:
    """Whether ``pages`` reads this LMDB's layout: writes two known values into ``db`` (the store's
    meta table), finds them through ``pages``, reads the large one back with ``pread`` and deletes
    both. None if everything matched, else what did not."""
    size = pages.page_size
    big, small = (bytes(range(251)) * (size // 251 + 1))[:size], b"small value"
    with env.begin(write=True, db=db) as txn:
        txn.put(_PROBE_BIG, big)
        txn.put(_PROBE_SMALL, small)
    try:
        with env.begin(db=db, buffers=True) as txn:
            cursor = txn.cursor()
            node = pages.overflow_node(cursor, _PROBE_BIG) if cursor.set_key(_PROBE_BIG) else None
            if node is None:
                return "its leaf node was not found"
            pgno, length = node
            nodes = {key: (length, first) for key, length, first in pages.leaf_nodes(cursor)}
            if nodes.get(_PROBE_BIG) != (length, pgno) or nodes.get(_PROBE_SMALL) != (len(small), -1):
                return f"its leaf page read as {sorted(nodes.items())[:4]}"
            start = pgno * size
            read = os.pread(pages._fd, PAGE_HEADER_BYTES + length, start)
            if length != len(big) or not is_overflow_page(read, start, size) or read[PAGE_HEADER_BYTES:] != big:
                return f"page {pgno} ({length} bytes) does not hold the value written"
        return None
    finally:
        with env.begin(write=True, db=db) as txn:
            txn.delete(_PROBE_BIG)
            txn.delete(_PROBE_SMALL)
