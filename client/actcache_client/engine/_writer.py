"""Puts what the frozen prefix computed into the daemon, in the codec chosen for its entries.

An AutoEncoding picks the codec per (fingerprint, depth) from the first
entries written (actcache_client.engine._codec_choice), on the connection's writer
thread, and tells the planner; ``CachedForward`` documents the other values.

A put needs the output as the prefix returned it, yet the step goes on with that very tensor (the suffix may
change its input in place: ``ReLU(inplace=True)``). Where a CachedLoader feeds the model, the put is held, not
copied, until the loop asks for its next batch (``steps_ended``: no step is running then), and is sent only if
the tensor's version counter did not move; once one moved, every later output is copied as it is stored.
Elsewhere (no loader tells when steps end) each output is copied as it is stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, NamedTuple

from torch import Tensor

from actcache.codec import Encoding
from actcache.errors import ConfigError, ConfigTypeError, InvalidRequest
from actcache_client.engine._codec_choice import AutoEncoding, EncodingChoice, choose_encoding, choose_unmeasured
from actcache_client.engine._epoch_plan import EpochPlan
from actcache_client.engine._frozen import FrozenPrefix, WrittenFingerprints
from actcache_client.transport._connection import connected
from actcache_client.transport._put_group import Columns
from actcache_client.transport._state import State, map_state, state_bytes, tensors_of
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

# The bytes of the puts held at once (a loop accumulating gradients runs several batches between two of its
# loader's batches, whose outputs the step would have freed); past it, outputs are copied as they are stored.
_MAX_HELD_BYTES = 256 << 20


class _Held(NamedTuple):
    """A put holding the network's own output tensors, sent once its step is over if they did not change."""

    fingerprint: bytes
    depth: int
    ids: list[int]
    variant: int
    snapshot: State
    versions: tuple[int, ...]

    def changed(self) -> bool:
        return tuple(t._version for t in tensors_of(self.snapshot)) != self.versions


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
    _choosers: dict[bytes, Callable[[list[bytes | memoryview]], str]] = field(default_factory=dict, init=False)
    _probed: bool = field(default=False, init=False)
    _entry_shapes: dict[int, list[tuple[int, ...]]] = field(default_factory=dict, init=False)
    # puts held until their step ends; whether a loader says when steps end; whether outputs are copied at once
    _held: list[_Held] = field(default_factory=list, init=False)
    _steps_told: bool = field(default=False, init=False)
    _copy_outputs: bool = field(default=False, init=False)

    def new_epoch(self) -> None:
        self._probed = False

    def choice(self, fingerprint: bytes) -> EncodingChoice | None:
        """The codec an AutoEncoding chose for ``fingerprint``'s entries, if any yet."""
        return self._encodings.get(fingerprint)

    def store(self, depth: int, ids: list[int], variant: int, state: State) -> None:
        """Put ``state`` (the batch rows of ``ids`` at ``depth``) under the current fingerprint of ``depth``:
        held until the step ends, or copied and queued now (the module docstring says when)."""
        stored = self.precision.to_stored(map_state(state, lambda t: t.detach()))
        varlen, fingerprint = self.varlen, self.frozen.fingerprints[depth]
        if varlen is None:  # a padded text state must fail here, not when an epoch's entries are collated
            check_fixed_length(stored, self._entry_shapes, depth)
        self.written.mark(fingerprint, depth, ids, written=self.frozen.data)
        # the tensors the step goes on with (a store precision's cast is a copy already)
        shared = tuple(t for t, given in zip(tensors_of(stored), tensors_of(state)) if t.data_ptr() == given.data_ptr())
        if not shared:
            self._put(fingerprint, depth, ids, variant, stored)
        elif self._may_hold(shared):
            self._held.append(_Held(fingerprint, depth, ids, variant, stored,
                                    tuple(t._version for t in tensors_of(stored))))
        else:
            copied = map_state(stored, lambda t: t.clone() if any(t is s for s in shared) else t)
            self._put(fingerprint, depth, ids, variant, copied)

    def _may_hold(self, shared: tuple[Tensor, ...]) -> bool:
        """Whether a put of ``shared`` (tensors the step goes on with) may wait for its step's end uncopied."""
        if not self._steps_told or self._copy_outputs or any(t.is_inference() for t in shared):
            return False
        return sum(state_bytes(put.snapshot) for put in self._held) + state_bytes(shared) <= _MAX_HELD_BYTES

    def steps_ended(self) -> None:
        """The loop asks its loader for a batch, or stopped asking: no step is running. From now on puts are
        held until then; those held are sent (``release``)."""
        self._steps_told = True
        self.release()

    def release(self) -> None:
        """No step is running: the puts held are sent, but those whose tensors the step changed in place (those
        are dropped, and outputs are copied as they are stored from then on)."""
        held, self._held = self._held, []
        for put in held:
            if put.changed():
                self._dropped_changed(put)
            else:
                self._put(put.fingerprint, put.depth, put.ids, put.variant, put.snapshot)

    def _dropped_changed(self, put: _Held) -> None:
        if not self._copy_outputs:
            log.warning("actcache: the step changed the frozen prefix's output (depth %d) in place after it was "
                        "computed (e.g. ReLU(inplace=True) on it, or `out /= T` in the loss); the entries of that "
                        "batch are not stored, and each output is copied before it is stored from now on", put.depth)
        self._copy_outputs = True

    def _put(self, fingerprint: bytes, depth: int, ids: list[int], variant: int, snapshot: State) -> None:
        """Queue the put of ``snapshot``, a state no step will change; what can wait for the writer thread
        (laying out the columns, encoding) does."""
        # Without a read-speed measurement yet, read one put back (once per epoch until it is measured): a slow
        # network then shows during the write epoch, before the cache is relied upon. Over shared memory a Get
        # times another path than the stream's, latency-bound on small entries: the stream's own rate is used.
        connection = connected(self.connection)
        probe = (not self._probed and self.planner is not None and not self.planner.has_fetch_rate()
                 and not connection.streams_shared_memory)
        self._probed = self._probed or probe
        nbytes = state_bytes(snapshot)
        connection.store(
            fingerprint, depth, ids, [variant] * len(ids), partial(encode_samples, snapshot, varlen=self.varlen),
            probe=probe, encoding=self._encoding_for(fingerprint, depth),
            columns=self._columns(snapshot, fingerprint, depth, nbytes / max(len(ids), 1)), nbytes=nbytes,
        )

    def _columns(self, snapshot: State, fingerprint: bytes, depth: int, sample_bytes: float) -> Columns | None:
        """How ``snapshot``'s samples go as tensor columns (the daemon encodes them, over shared memory), laid
        out on the writer thread (from a device, with the copy to the host), or None: as encoded entries, until
        the codec is chosen (choosing it measures them unless they fit in the page cache) or when samples differ
        in shape."""
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
        return partial(sample_columns, snapshot)

    def _chose(self, fingerprint: bytes, depth: int, choice: EncodingChoice) -> None:
        """Keep the codec chosen for ``fingerprint``'s entries (at ``depth``) and say it."""
        self._encodings[fingerprint] = choice
        if self.planner is not None:
            self.planner.record_encoding(depth, choice)  # logs it with the plan
        else:
            log.info("actcache encoding for depth %d: %s", depth, choice.reason)

    def _encoding_for(self, fingerprint: bytes, depth: int) -> Callable[[list[bytes | memoryview]], str] | None:
        """How the daemon stores depth ``depth``'s entries; an AutoEncoding measures the first ones
        (on the connection's writer thread) and keeps its choice per fingerprint."""
        if not isinstance(self.encoding, AutoEncoding):
            fixed = self.encoding
            return None if fixed == "daemon" else (lambda entries: fixed)
        choose = self._choosers.get(fingerprint)
        if choose is None:
            choose = self._choosers[fingerprint] = partial(self._choose, fingerprint, depth, self.encoding,
                                                           self.epoch.samples())
        return choose

    def _choose(self, fingerprint: bytes, depth: int, config: AutoEncoding, samples: int | None,
                entries: list[bytes | memoryview]) -> str:
        """The codec of ``fingerprint``'s entries: chosen once, measuring ``entries`` (on the writer thread)."""
        choice = self._encodings.get(fingerprint)
        if choice is None:
            try:
                choice = choose_encoding(entries, samples=samples, config=config)
            except Exception as exc:  # a failed measurement must not stop the writes
                choice = EncodingChoice("", f"the daemon's --encoding: measuring the codecs failed ({exc!r})", {})
            self._chose(fingerprint, depth, choice)
        return choice.encoding


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
