"""Fixed-width, big-endian LMDB keys: (namespace, fingerprint, depth, sample id, variant).

Big-endian fields keep a (namespace, fingerprint, depth) group contiguous and ordered by sample id, so a
group is one range scan or drop. Layout (bytes): namespace id 0-4, fingerprint 4-20, depth 20-22, sample
id 22-30, variant 30-32; its prefixes are a namespace (4), a generation (20) and a group (22).
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

from actcache.errors import InvalidRequest

__all__ = ["FINGERPRINT_BYTES", "GENERATION_PREFIX_BYTES", "GROUP_PREFIX_BYTES", "KEY_BYTES", "MAX_DEPTH",
           "MAX_NAMESPACE_ID", "MAX_SAMPLE_ID", "MAX_VARIANT", "check_fingerprint", "encode_key", "encode_keys",
           "fingerprint_of", "generation_of", "group_of", "group_prefix", "namespace_id_of", "namespace_of",
           "sample_id_of", "sample_ids_of", "split_group"]

FINGERPRINT_BYTES = 16
_KEY = struct.Struct(">I16sHQH")
KEY_BYTES = _KEY.size  # 32
MAX_NAMESPACE_ID = 2**32 - 1
MAX_DEPTH = 2**16 - 1
MAX_SAMPLE_ID = 2**64 - 1
MAX_VARIANT = 2**16 - 1
_NAMESPACE = struct.Struct(">I")
_GROUP = struct.Struct(">I16sH")
_NAMESPACE_PREFIX_BYTES = _NAMESPACE.size  # 4
GENERATION_PREFIX_BYTES = _NAMESPACE.size + FINGERPRINT_BYTES  # 20
GROUP_PREFIX_BYTES = _GROUP.size  # 22
_LIMITS = {"namespace_id": MAX_NAMESPACE_ID, "depth": MAX_DEPTH, "sample_id": MAX_SAMPLE_ID, "variant": MAX_VARIANT}


def check_fingerprint(fingerprint: bytes) -> bytes:
    """Return ``fingerprint`` as bytes, or raise InvalidRequest if it is not 16 bytes."""
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise InvalidRequest(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)} bytes")
    return bytes(fingerprint)


def _check_range(**fields: int) -> None:
    for name, value in fields.items():
        limit = _LIMITS[name]
        if not 0 <= value <= limit:
            raise InvalidRequest(f"{name} {value} is out of range 0..{limit}")


def encode_key(namespace_id: int, fingerprint: bytes, depth: int, sample_id: int, variant: int = 0) -> bytes:
    """Pack a key; raises InvalidRequest naming the field that is out of range."""
    _check_range(namespace_id=namespace_id, depth=depth, sample_id=sample_id, variant=variant)
    return _KEY.pack(namespace_id, check_fingerprint(fingerprint), depth, sample_id, variant)


_KEY_DTYPE = np.dtype([("ns", ">u4"), ("fp", "S16"), ("depth", ">u2"), ("sid", ">u8"), ("var", ">u2")])


def encode_keys(
    namespace_id: int, fingerprint: bytes, depth: int, sample_ids: np.ndarray, variants: np.ndarray | None = None
) -> list[bytes]:
    """Vectorized ``encode_key`` of many sample ids (uint64) and ``variants`` (uint16; None: all 0)."""
    _check_range(namespace_id=namespace_id, depth=depth)
    fingerprint = check_fingerprint(fingerprint)
    count = len(sample_ids)
    if variants is not None and len(variants) != count:
        raise InvalidRequest(f"{len(variants)} variants for {count} sample ids; send one per id or none")
    packed = np.empty(count, _KEY_DTYPE)
    packed["ns"], packed["fp"], packed["depth"] = namespace_id, fingerprint, depth
    packed["sid"], packed["var"] = sample_ids, 0 if variants is None else variants
    raw = packed.tobytes()
    return [raw[i : i + KEY_BYTES] for i in range(0, count * KEY_BYTES, KEY_BYTES)]


def sample_ids_of(keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """``(sample ids as uint64, variants as uint16)`` of full keys at once."""
    packed = np.frombuffer(b"".join(keys), _KEY_DTYPE)
    return packed["sid"].astype(np.uint64), packed["var"].astype(np.uint16)


def group_prefix(namespace_id: int, fingerprint: bytes | None = None, depth: int | None = None) -> bytes:
    """Key prefix of a namespace, a (namespace, fingerprint) or a (namespace, fingerprint, depth) group."""
    _check_range(namespace_id=namespace_id)
    prefix = struct.pack(">I", namespace_id)
    if fingerprint is None:
        if depth is not None:
            raise InvalidRequest("a depth can only narrow a drop together with a fingerprint")
        return prefix
    prefix += check_fingerprint(fingerprint)
    if depth is not None:
        _check_range(depth=depth)
        prefix += struct.pack(">H", depth)
    return prefix


def namespace_of(key: bytes) -> bytes:
    """The namespace prefix (4 bytes) of a key or of any of its prefixes."""
    return key[:_NAMESPACE_PREFIX_BYTES]


def generation_of(key: bytes) -> bytes:
    """The generation prefix (namespace, fingerprint) of a key, a group prefix or a generation prefix."""
    return key[:GENERATION_PREFIX_BYTES]


def group_of(key: bytes) -> bytes:
    """The group prefix (namespace, fingerprint, depth) of a key."""
    return key[:GROUP_PREFIX_BYTES]


def namespace_id_of(key: bytes) -> int:
    """The namespace id of a key or of any of its prefixes."""
    return _NAMESPACE.unpack_from(key)[0]


def fingerprint_of(key: bytes) -> bytes:
    """The fingerprint of a key, a group prefix or a generation prefix."""
    return bytes(key[_NAMESPACE_PREFIX_BYTES:GENERATION_PREFIX_BYTES])


def split_group(prefix: bytes) -> tuple[int, bytes, int]:
    """``(namespace id, fingerprint, depth)`` of a group prefix (or of a key)."""
    return _GROUP.unpack_from(prefix)


def sample_id_of(key: bytes) -> int:
    """The sample id of a key."""
    return struct.unpack_from(">Q", key, GROUP_PREFIX_BYTES)[0]
