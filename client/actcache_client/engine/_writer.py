"""Puts what the frozen prefix computed into the daemon, in the codec chosen for its entries.

An AutoEncoding picks the codec per (fingerprint, depth) from the first
entries written (actcache_client.engine._codec_choice), on the connection's writer
thread, and tells the planner; ``CachedForward`` documents the other values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable

from actcache.codec import Encoding
from actcache.errors import ConfigError, ConfigTypeError, InvalidRequest
from actcache_client.engine._codec_choice import AutoEncoding, EncodingChoice, choose_encoding, choose_unmeasured
from actcache_client.engine._epoch_plan import EpochPlan
from actcache_client.engine._frozen import FrozenPrefix, WrittenFingerprints
from actcache_client.transport._connection import connected
from actcache_client.transport._put_group import Columns
from actcache_client.transport._state import State, map_state, tensors_of
from actcache_client.transport._tensors import (
    StorePrecision,
    VarLen,
    check_fixed_length,
    encode_samples,
    sample_columns,
)

if TYPE_CHECKING:
    from actcache_client.engine._planner import CachePlanner
    from actcache_client.transport._connection import Connection

__all__ = ["EntryWriter", "check_encoding"]

log = logging.getLogger("actcache_client")


@dataclass(eq=False, kw_only=True)
class EntryWriter:
    """Stores a depth's computed states for a batch's samples, asynchronously (``Connection.store``):
    under ``frozen``'s fingerprints, in the stored ``precision`` and ``varlen`` layout, marked in ``written``;
    the ``planner`` (if any) is told the codec chosen and asks for read-speed probes."""

    frozen: FrozenPrefix
    written: WrittenFingerprints
    connection: Connection | None
    planner: CachePlanner | None
    precision: StorePrecision
    varlen: VarLen | None
    encoding: str | AutoEncoding
    epoch: EpochPlan
    # fingerprint -> codec chosen; whether a read-speed probe was sent this epoch; depth -> shapes of its first put
    _encodings: dict[bytes, EncodingChoice] = field(default_factory=dict, init=False)
    _probed: bool = field(default=False, init=False)
    _entry_shapes: dict[int, list[tuple[int, ...]]] = field(default_factory=dict, init=False)

    def new_epoch(self) -> None:
        self._probed = False

    def choice(self, fingerprint: bytes) -> EncodingChoice | None:
        """The codec an AutoEncoding chose for ``fingerprint``'s entries, if any yet."""
        return self._encodings.get(fingerprint)

    def store(self, depth: int, ids: list[int], variant: int, state: State) -> None:
        """Put ``state`` (the batch rows of ``ids`` at ``depth``) under the current fingerprint of ``depth``."""
        # A private copy: the suffix may modify its input in place (e.g. ReLU(inplace=True)).
        snapshot = self.precision.to_stored(map_state(state, lambda t: t.detach().clone()))
        varlen, fingerprint = self.varlen, self.frozen.fingerprints[depth]
        if varlen is None:  # a padded text state must fail here, not when an epoch's entries are collated
            check_fixed_length(snapshot, self._entry_shapes, depth)
        self.written.mark(fingerprint, depth, ids, written=self.frozen.data)
        # Without a read-speed measurement yet, read one put back (once per epoch until it is measured): a slow
        # network then shows during the write epoch, before the cache is relied upon. Over shared memory a Get
        # times another path than the stream's, latency-bound on small entries: the stream's own rate is used.
        connection = connected(self.connection)
        probe = (self.planner is not None and not self.planner.has_fetch_rate() and not self._probed
                 and not connection.streams_shared_memory)
        self._probed = self._probed or probe
        nbytes = sum(t.numel() * t.element_size() for t in tensors_of(snapshot))
        connection.store(
            fingerprint, depth, ids, [variant] * len(ids),
            lambda: encode_samples(snapshot, varlen=varlen), probe=probe, encoding=self._encoding_for(depth),
            columns=self._columns(snapshot, depth, nbytes / max(len(ids), 1)), nbytes=nbytes,
        )

    def _columns(self, snapshot: State, depth: int, sample_bytes: float) -> Columns | None:
        """How ``snapshot``'s samples go as tensor columns (the daemon encodes them, over shared memory), or None:
        as encoded entries, until the codec is chosen (choosing it measures them unless they fit in the page
        cache) or when samples differ in shape. On the CPU the columns are views made here, so that the writer
        thread makes no torch call beside the step; from a device, the copy to the host runs on the writer."""
        fingerprint = self.frozen.fingerprints[depth]
        if self.varlen is not None:
            return None
        if isinstance(self.encoding, AutoEncoding) and fingerprint not in self._encodings:
            try:
                choice = choose_unmeasured(sample_bytes, samples=self.epoch.samples(), config=self.encoding)
            except Exception:  # psutil failing: the measuring path says so, on the writer thread
                return None
            if choice is None:
                return None
            self._chose(fingerprint, depth, choice)
        if all(t.device.type == "cpu" for t in tensors_of(snapshot)):
            laid = sample_columns(snapshot)
            return lambda: laid
        return partial(sample_columns, snapshot)

    def _chose(self, fingerprint: bytes, depth: int, choice: EncodingChoice) -> None:
        """Keep the codec chosen for ``fingerprint``'s entries (at ``depth``) and say it."""
        self._encodings[fingerprint] = choice
        if self.planner is not None:
            self.planner.record_encoding(depth, choice)  # logs it with the plan
        else:
            log.info("actcache encoding for depth %d: %s", depth, choice.reason)

    def _encoding_for(self, depth: int) -> Callable[[list[bytes | memoryview]], str] | None:
        """How the daemon stores depth ``depth``'s entries; an AutoEncoding measures the first ones
        (on the connection's writer thread) and keeps its choice per fingerprint."""
        if not isinstance(self.encoding, AutoEncoding):
            fixed = self.encoding
            return None if fixed == "daemon" else (lambda entries: fixed)
        fingerprint, config, samples = self.frozen.fingerprints[depth], self.encoding, self.epoch.samples()

        def choose(entries: list[bytes | memoryview]) -> str:
            choice = self._encodings.get(fingerprint)
            if choice is None:
                try:
                    choice = choose_encoding(entries, samples=samples, config=config)
                except Exception as exc:  # a failed measurement must not stop the writes
                    choice = EncodingChoice("", f"the daemon's --encoding: measuring the codecs failed ({exc!r})", {})
                self._chose(fingerprint, depth, choice)
            return choice.encoding

        return choose


def check_encoding(encoding: str | AutoEncoding) -> str | AutoEncoding:
    """``encoding`` as CachedForward keeps it: an AutoEncoding, "daemon" or a valid ``--encoding`` value."""
    if not isinstance(encoding, (str, AutoEncoding)):
        raise ConfigTypeError(f"encoding must be a str or an AutoEncoding, got {type(encoding).__name__} "
                              f"{encoding!r}")
    if encoding == "auto":
        return AutoEncoding()
    if isinstance(encoding, str) and encoding != "daemon":
        try:
            Encoding.parse(encoding)
        except InvalidRequest:
            raise ConfigError(f"encoding={encoding!r}: use 'auto' (or an AutoEncoding), 'daemon', 'raw', 'lz4', "
                              "'zstd' or 'zstd:LEVEL' (-7..22)") from None
    return encoding
