"""LMDB's B-tree pages read directly from the memory map: where a value's overflow pages start, the
nodes of a whole leaf page, and which keys are stored, a leaf page at a time.

LMDB's on-disk format: a page starts with a 16-byte header (``pgno`` u64, ``pad``, ``flags``,
``lower``, ``upper`` u16; ``P_LEAF`` = 2, ``P_OVERFLOW`` = 4), then on a leaf ``(lower - 16) / 2``
u16 offsets of its nodes, in key order. A node is ``lo, hi, flags, ksize`` (four u16), its key, then
its data: for a value too large for the leaf (flag ``F_BIGDATA`` = 1), the number of its first
overflow page; the value then is ``lo | hi << 16`` bytes at file offset ``pgno * page_size + 16``.
A positioned cursor's ``key()`` is a view into its leaf (``buffers=True``), so its node header sits
just before it, and the map is page-aligned, so its page starts at that address rounded down to the
page size. Everything here checks what it reads and answers "not recognized" otherwise: callers then
take LMDB's own way (a layout this module does not know costs speed, never bytes).

Why read pages at all: positioning a cursor on a cold value reads that value's first page (LMDB
checks its header), one random read per lookup; a whole leaf page answers for about 80 keys.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Sequence

import numpy as np

__all__ = ["PAGE_HEADER_BYTES", "is_overflow_page", "leaf_nodes", "overflow_node", "present_keys", "stored_length"]

PAGE_HEADER_BYTES = 16
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_F_BIGDATA = 0x01
_F_SUBDATA_OR_DUP = 0x02 | 0x04
_P_LEAF = 0x02
_P_OVERFLOW = 0x04
_PGNO = struct.Struct("<Q")
_PAGE_HEAD = struct.Struct("<QHH")  # pgno, pad, flags
_PAGE_BOUNDS = struct.Struct("<QHHHH")  # pgno, pad, flags, lower (end of the node offsets), upper


def is_overflow_page(header: bytes | memoryview, offset: int, page_size: int) -> bool:
    """Whether ``header`` (a page's first bytes) is the overflow page at file ``offset``."""
    pgno, _, flags = _PAGE_HEAD.unpack_from(header)
    return pgno * page_size == offset and bool(flags & _P_OVERFLOW)


def overflow_node(cursor, key: bytes) -> tuple[int, int] | None:
    """(first overflow page, value size) from the leaf node the cursor sits on, or None if not recognized."""
    key_view = cursor.key()
    ksize = len(key_view)
    head = ctypes.string_at(_address(key_view) - _NODE.size, _NODE.size + ksize + _PGNO.size)
    lo, hi, flags, node_ksize = _NODE.unpack_from(head)
    if node_ksize != ksize or head[_NODE.size : _NODE.size + ksize] != key:
        return None
    if not flags & _F_BIGDATA or flags & _F_SUBDATA_OR_DUP:
        return None
    (pgno,) = _PGNO.unpack_from(head, _NODE.size + ksize)
    return pgno, lo | hi << 16


def leaf_nodes(cursor, page_size: int) -> list[tuple[bytes, int, int]]:
    """``(key, data size, first overflow page or -1)`` of every node, in key order, on the B-tree
    leaf page the cursor sits on, read from the page itself: [] if the page is not recognized."""
    node = _address(cursor.key()) - _NODE.size
    base = node - node % page_size
    page = ctypes.string_at(base, page_size)
    _, _, flags, lower, upper = _PAGE_BOUNDS.unpack_from(page)
    if not flags & _P_LEAF or not PAGE_HEADER_BYTES <= lower <= upper <= page_size:
        return []
    offsets = struct.unpack_from(f"<{(lower - PAGE_HEADER_BYTES) // 2}H", page, PAGE_HEADER_BYTES)
    if node - base not in offsets:
        return []
    out = []
    for at in offsets:
        if at + _NODE.size > page_size:
            return []
        lo, hi, node_flags, ksize = _NODE.unpack_from(page, at)
        end = at + _NODE.size + ksize
        if end > page_size:
            return []
        big = node_flags & _F_BIGDATA and not node_flags & _F_SUBDATA_OR_DUP and end + _PGNO.size <= page_size
        out.append((page[at + _NODE.size : end], lo | hi << 16, _PGNO.unpack_from(page, end)[0] if big else -1))
    keys = [key for key, _, _ in out]
    return out if all(a < b for a, b in zip(keys, keys[1:])) else []


def present_keys(cursor, keys: Sequence[bytes], page_size: int) -> list[bool]:
    """Whether each of ``keys`` is stored, reading no value past its first page.

    A lookup of a cold value waits for a random read of its first page (LMDB reads it), so keys are
    looked up in order, and each lookup's whole leaf page answers for every key in its range: one
    random read per leaf page (about 80 entries) instead of one per key. A page not recognized
    answers for its own key only.
    """
    order = sorted(range(len(keys)), key=keys.__getitem__)
    out = [False] * len(keys)
    i = 0
    while i < len(order):
        key = keys[order[i]]
        if not cursor.set_range(key):  # nothing at or after it: the rest are absent
            break
        # set_range lands on the smallest stored key >= key, so every key from `key` to the page's
        # last one is stored exactly if it is on the page
        page = [node[0] for node in leaf_nodes(cursor, page_size)]
        if not page:
            out[order[i]] = bytes(cursor.key()) == key
            i += 1
            continue
        last, on_page = page[-1], set(page)
        while i < len(order) and keys[order[i]] <= last:
            out[order[i]] = keys[order[i]] in on_page
            i += 1
    return out


def stored_length(cursor, key: bytes) -> int | None:
    """Size of the value under ``key`` (None if absent) without reading the value's pages past the first."""
    if not cursor.set_key(key):
        return None
    node = overflow_node(cursor, key)
    return node[1] if node is not None else len(cursor.value())


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).__array_interface__["data"][0]  # .ctypes.data builds a ctypes object
