"""How the daemon stores one (fingerprint, depth)'s entries: raw, lz4 or zstd, from measurements.

Per raw byte served (read the stored bytes, verify and decode them)::

    serve_s(codec) = cold_share / (ratio(codec) x disk_bytes_per_s) + decode_s_per_byte(codec)

``ratio`` and ``decode_s_per_byte`` (checksum included) are measured on the first entries written, each
compressed alone as the daemon stores it and decoded five times, the codecs taking turns (the fastest kept).
The disk's speed is configured (``actcache bench disk`` measures it); ``cold_share`` is the share of the depth's stored entries
that does not fit in the memory available now. A codec must win by ``min_gain``: raw costs nothing to
decode when the guess is wrong. When all of the depth's raw entries fit in that memory, raw is chosen without
measuring: served from memory, a raw byte costs its checksum, while a compressed one costs a checksum and a
decompression that is slower than the checksum (``bench/bench_codec.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import timeit
from collections.abc import Sequence

import psutil

from actcache.codec import Codec, Encoding, compress_entry, decode_entry
from actcache.errors import ConfigError, InvalidRequest

__all__ = ["AutoEncoding", "EncodingChoice", "choose_encoding", "choose_unmeasured", "measure_codecs"]

_DECODE_TURNS = 5  # decodes of the sample per codec, the fastest kept


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoEncoding:
    """Knobs of the per-(fingerprint, depth) codec choice (``CachedForward(encoding=...)``).

    Attributes:
        disk_read_bytes_per_s: The cache disk's read speed; ``actcache bench disk`` measures it (O_DIRECT).
            1 GB/s: NVMe.
        min_gain: A codec must serve this much faster than raw to be chosen.
        sample_bytes: Raw bytes of entries the measurement compresses and decodes (the first entries
            written).
        candidates: Codecs tried against raw, as ``--encoding`` names them.
        page_cache_bytes: Memory the page cache may use for these entries; None: what psutil says is
            available then.

    Raises:
        ConfigError: A field is out of range, or ``candidates`` names raw or an unknown codec.
    """

    #: The cache disk's read speed; ``actcache bench disk`` measures it (O_DIRECT). 1 GB/s: NVMe.
    disk_read_bytes_per_s: float = 1e9
    #: A codec must serve this much faster than raw to be chosen.
    min_gain: float = 0.1
    #: Raw bytes of entries the measurement compresses and decodes (the first entries written).
    sample_bytes: int = 512 << 10
    #: Codecs tried against raw, as ``--encoding`` names them.
    candidates: tuple[str, ...] = ("lz4", "zstd")
    #: Memory the page cache may use for these entries; None: what psutil says is available then.
    page_cache_bytes: float | None = None

    def __post_init__(self) -> None:
        for name, ok, need in (
                ("disk_read_bytes_per_s", self.disk_read_bytes_per_s > 0, "> 0 (measure it with `actcache bench disk`)"),
                ("min_gain", 0 <= self.min_gain < 1, "in [0, 1)"), ("sample_bytes", self.sample_bytes >= 1, ">= 1"),
                ("page_cache_bytes", self.page_cache_bytes is None or self.page_cache_bytes >= 0, ">= 0 or None")):
            if not ok:
                raise ConfigError(f"AutoEncoding.{name} must be {need}, got {getattr(self, name)}")
        for name in self.candidates:
            try:
                codec = Encoding.parse(name).codec
            except InvalidRequest as exc:
                raise ConfigError(f"AutoEncoding.candidates: {exc}") from None
            if codec == Codec.raw:
                raise ConfigError("AutoEncoding.candidates lists raw; raw is always compared, list codecs only")


@dataclasses.dataclass(frozen=True)
class CodecReading:
    """One codec on the sample: raw bytes / stored bytes, and CPU seconds to verify and decode a raw byte."""

    ratio: float
    decode_s_per_byte: float


@dataclasses.dataclass(frozen=True)
class EncodingChoice:
    """The codec chosen (``--encoding`` syntax; "": the daemon's own), why, and the numbers behind it."""

    encoding: str
    reason: str
    numbers: dict[str, float]


def _decode_each(entries: Sequence[bytes | memoryview]) -> list:
    return [decode_entry(e) for e in entries]


def measure_codecs(entries: Sequence[bytes | memoryview], candidates: Sequence[str],
                   sample_bytes: int) -> dict[str, CodecReading]:
    """Ratio and decode cost of raw and each candidate on the first entries, up to ``sample_bytes``."""
    ahead = itertools.accumulate((len(e) for e in entries), initial=0)  # bytes of the entries before each
    sample = [e for e, before in zip(entries, ahead) if before < sample_bytes]
    raw_bytes = sum(len(e) for e in sample)
    names = ("raw", *candidates)
    stored = {name: [compress_entry(e, Encoding.parse(name)) for e in sample] for name in names}  # raw: as they are
    best = dict.fromkeys(names, math.inf)
    for _ in range(_DECODE_TURNS):  # the codecs take turns: a busy spell of the host slows them alike
        for name in names:
            best[name] = min(best[name], timeit.timeit(functools.partial(_decode_each, stored[name]), number=1))
    return {name: CodecReading(raw_bytes / max(sum(len(e) for e in stored[name]), 1), best[name] / max(raw_bytes, 1))
            for name in names}


def _page_cache_bytes(config: AutoEncoding) -> float:
    return config.page_cache_bytes if config.page_cache_bytes is not None else psutil.virtual_memory().available


def choose_unmeasured(entry_bytes: float, *, samples: int | None, config: AutoEncoding | None = None,
                      ) -> EncodingChoice | None:
    """Raw, when the ``samples`` entries of ``entry_bytes`` fit in the page cache (served from memory, nothing
    decodes faster); None when the codecs must be measured (``choose_encoding``)."""
    config = config or AutoEncoding()
    memory = _page_cache_bytes(config)
    if samples is None or samples * entry_bytes > memory:
        return None
    numbers = {"disk_read_bytes_per_s": config.disk_read_bytes_per_s, "page_cache_bytes": memory, "raw_ratio": 1.0,
               "raw_cold_share": 0.0}
    return EncodingChoice("raw", f"raw: the {samples * entry_bytes / 1e9:.3g} GB of entries fit in the page cache "
                                 f"({memory / 1e9:.3g} GB)", numbers)


def choose_encoding(entries: Sequence[bytes | memoryview], *, samples: int | None,
                    config: AutoEncoding | None = None) -> EncodingChoice:
    """The codec that serves these entries fastest; ``samples``: entries the dataset will have at
    this depth (None: unknown, judged as read from disk)."""
    config = config or AutoEncoding()
    entry_bytes = sum(len(e) for e in entries) / max(len(entries), 1)
    unmeasured = choose_unmeasured(entry_bytes, samples=samples, config=config)
    if unmeasured is not None:
        return unmeasured
    memory = _page_cache_bytes(config)
    numbers: dict[str, float] = {"disk_read_bytes_per_s": config.disk_read_bytes_per_s, "page_cache_bytes": memory}
    readings = measure_codecs(entries, config.candidates, config.sample_bytes)
    costs: dict[str, float] = {}
    for name, r in readings.items():
        cold = 1.0
        if samples is not None:  # the share of this depth's stored bytes that does not fit in memory
            stored_total = samples * entry_bytes / r.ratio
            cold = max(0.0, 1.0 - memory / stored_total) if stored_total > 0 else 0.0
        costs[name] = cold / (r.ratio * config.disk_read_bytes_per_s) + r.decode_s_per_byte
        numbers.update({f"{name}_ratio": r.ratio, f"{name}_decode_s_per_gb": r.decode_s_per_byte * 1e9,
                        f"{name}_cold_share": cold, f"{name}_serve_s_per_gb": costs[name] * 1e9})
    best = min(config.candidates, key=costs.__getitem__, default="raw")
    summary = ", ".join(f"{n} {readings[n].ratio:.2f}x {costs[n] * 1e9:.2f} s/GB" for n in readings)
    if best != "raw" and costs[best] < costs["raw"] * (1 - config.min_gain):
        return EncodingChoice(best, f"{best} serves fastest ({summary})", numbers)
    return EncodingChoice("raw", f"raw: no codec serves {config.min_gain:.0%} faster ({summary})", numbers)
