"""Online measurements for the cost model, and the plan CachedForward follows.

The planner keeps a moving median of the last ``window`` readings of each measurement (the configured
priors until measured) and asks ``cost_model.plan`` on every freeze change, at every epoch start, and when
a measurement drifted by more than ``replan_drift``. Within an epoch, a re-plan that keeps caching at the
same depth keeps the cached fraction (a new one would re-push the rest of the epoch's stream). Every
decision is logged and passed to the ``listeners``.

Device work is timed as the device runs it (CUDA events, read once complete). The fetch speed is timed
on reads seen whole (stream frames the step waited for, as for the one before; Gets; before the stream
serves, one Get of a write epoch's entries over a network); without one, the prior, capped by the frames
the step waited for (the stream was still reading them); never below the rate the step actually received.
The model is then checked against what was measured: at the start of the epoch after one whose steps were
served from the cache, their period (as the loop saw it) is compared with that of steps that recomputed
the prefix (measured, else the model's), and the faster one is kept for that frozen depth, caching every
sample (``check_measured``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable, NamedTuple, overload

from actcache.errors import ConfigError
from actcache_client.cost_model import Measurements, Plan, PlanMode, plan, should_replan
from actcache_client.transport._state import State, state_bytes, tensors_of

if TYPE_CHECKING:
    from actcache_client.engine._codec_choice import EncodingChoice
    from actcache_client.transport._connection import ClientStats

__all__ = ["CachePlanner", "PlannerConfig"]

log = logging.getLogger("actcache_client.planner")  # named in the README: it logs every plan

_MIN_STEPS = 3  # steps of a kind measured before the measured check trusts their median


class _Transfers(NamedTuple):
    """A connection's cumulative transfer counts (ClientStats), read at one ``observe``."""

    read_bytes: int = 0  # fetched by timed lookups, and their seconds
    read_s: float = 0.0
    written_bytes: int = 0
    write_s: float = 0.0
    received_bytes: int = 0  # received from the stream
    received_s: float = 0.0
    waited_bytes: int = 0  # of the stream's frames the step waited for, and those waits
    waited_s: float = 0.0

    @classmethod
    def of(cls, stats: ClientStats) -> _Transfers:
        return cls(stats.timed_bytes, stats.timed_seconds, stats.bytes_written, stats.write_seconds,
                   stats.received_bytes, stats.received_seconds, stats.waited_bytes, stats.waited_seconds)


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """Knobs of the online cost model.

    Attributes:
        total_epochs: Epochs of the whole run; None: assume ``assume_remaining_epochs`` remain.
        assume_remaining_epochs: The remaining epochs assumed when ``total_epochs`` is None.
        budget_bytes: Storage available to this job (bytes); the daemon's budgets also apply.
        replan_drift: Re-plan when any measurement moved by more than this fraction.
        min_gain: The share of the step time caching must save to be chosen (``cost_model.plan``).
        window: Readings kept per measurement for the moving median.
        prior_fetch_bytes_per_s: The fetch speed assumed until one is measured.
        prior_fetch_latency_s: The fetch latency assumed until one is measured.
        prior_write_bytes_per_s: The write speed assumed until one is measured.
        prior_decode_bytes_per_s: The decode speed assumed until one is measured.

    Raises:
        ConfigError: A field is out of range.
    """

    #: Epochs of the whole run; None: assume ``assume_remaining_epochs`` remain.
    total_epochs: float | None = None
    assume_remaining_epochs: float = 10.0
    #: Storage available to this job (bytes); the daemon's budgets also apply.
    budget_bytes: float = math.inf
    #: Re-plan when any measurement moved by more than this fraction.
    replan_drift: float = 0.25
    min_gain: float = 0.02
    #: Readings kept per measurement for the moving median.
    window: int = 20
    prior_fetch_bytes_per_s: float = 1e9
    prior_fetch_latency_s: float = 1e-3
    prior_write_bytes_per_s: float = 5e8
    prior_decode_bytes_per_s: float = 2e9

    def __post_init__(self) -> None:
        if self.total_epochs is not None and self.total_epochs <= 0:
            raise ConfigError(f"PlannerConfig.total_epochs must be > 0 (None: unknown), got {self.total_epochs}")
        if self.window < 1:
            raise ConfigError(f"PlannerConfig.window must be >= 1 reading, got {self.window}")
        for name in ("prior_fetch_bytes_per_s", "prior_write_bytes_per_s", "prior_decode_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"PlannerConfig.{name} must be > 0, got {getattr(self, name)}")


class _Median:
    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        if math.isfinite(value) and value >= 0:
            self.values.append(value)

    def rate(self, nbytes: float, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            self.add(nbytes / seconds)

    @overload
    def get(self) -> float | None: ...
    @overload
    def get(self, default: float) -> float: ...
    def get(self, default: float | None = None) -> float | None:
        return statistics.median(self.values) if self.values else default


class CachePlanner:
    """Moving medians of what CachedForward observes, and the current Plan.

    Args:
        config: The cost model's knobs; default: ``PlannerConfig()``.
    """

    def __init__(self, config: PlannerConfig | None = None) -> None:
        self.config = config or PlannerConfig()
        w = self.config.window
        self._stage_s: dict[int, _Median] = {}
        self._stage_bytes: dict[int, _Median] = {}  # output bytes per sample of stage d-1, i.e. at depth d
        self._fetch_rate, self._fetch_latency = _Median(w), _Median(w)
        self._write_rate, self._decode_rate, self._h2d_rate = _Median(w), _Median(w), _Median(w)
        self._suffix_s = _Median(w)
        self.epoch, self.num_samples, self.batch_size = 0, 1, 1
        self._written: dict[int, int] = {}  # depth -> samples known to be stored for the current weights
        self.current: Plan | None = None
        self._in_epoch = False  # begin_epoch was called: plans follow a loader's epochs
        self._epoch_plan: int | None = None  # the frozen depth planned for since begin_epoch, if any
        self._basis: Measurements | None = None
        self.listeners: list[Callable[[int, Plan], None]] = []
        self._encodings: dict[int, EncodingChoice] = {}  # depth -> codec chosen for its current entries
        self._seen = _Transfers()  # the connection's counts at the last ``observe``
        self._received = _Median(w)  # bytes/s the step received from the stream: a floor for the fetch speed
        self._streamed = False  # the stream has served the step (its readings replace the write epoch's probe)
        self._waited = _Median(w)  # bytes/s of the frames the step waited for, over the waits: a ceiling
        self._steps: dict[tuple[int, str], _Median] = {}  # (frozen depth, step kind) -> step seconds per sample
        self._verdicts: dict[int, tuple[PlanMode, str]] = {}  # frozen depth -> what the measured check chose

    def record_stage(self, stage: int, seconds: float, samples: int, out_bytes_per_sample: float) -> None:
        """Time one stage's forward and the size of its output.

        Args:
            stage: The stage's index.
            seconds: Its forward time for the batch.
            samples: The batch's samples.
            out_bytes_per_sample: Stored bytes per sample of its output (the entries at depth ``stage + 1``).
        """
        self._stage_s.setdefault(stage, _Median(self.config.window)).add(seconds / max(samples, 1))
        self._stage_bytes.setdefault(stage + 1, _Median(self.config.window)).add(out_bytes_per_sample)

    def stage_reading(self, stage: int, output: State) -> Callable[[float], None]:
        """What takes the seconds of stage ``stage``'s forward, which returned ``output`` (a timer's payload)."""
        tensors = tensors_of(output)
        samples = max(len(tensors[0]), 1)
        nbytes = state_bytes(tensors) / samples
        return partial(self.record_stage, stage, samples=samples, out_bytes_per_sample=nbytes)

    def record_fetch(self, nbytes: int, seconds: float) -> None:
        """A lookup that returned ``nbytes``: a rate (latency included), or with no bytes a latency reading.

        Args:
            nbytes: The bytes returned.
            seconds: The lookup's time.
        """
        self._fetch_rate.rate(nbytes, seconds)
        if nbytes == 0:
            self._fetch_latency.add(seconds)

    def expect_epochs(self, total: float) -> None:
        """The run's length in epochs, where the loop knows it; a ``total_epochs`` configured is kept.

        Args:
            total: The run's epochs (the write epoch is weighed against those left).
        """
        if self.config.total_epochs is None and total > 0:
            self.config = dataclasses.replace(self.config, total_epochs=float(total))

    def has_fetch_rate(self) -> bool:
        """Whether the daemon's read speed has been measured, or shown by the stream (else the prior is used)."""
        return bool(self._fetch_rate.values) or self._streamed

    def observe(self, stats: ClientStats) -> None:
        """Record the fetch and write throughput the connection measured since the last call.

        Args:
            stats: The connection's counters.
        """
        last, now = self._seen, _Transfers.of(stats)
        self._seen = now
        if not self._streamed and now.received_bytes > last.received_bytes:
            # The write epoch's probe timed a Get of a few entries, its latency included: on small entries far
            # below the stream. From the stream's first frames on, only its waits (and Gets) time the fetch;
            # a stream that keeps up leaves the prior in place, floored by the rate the step received.
            self._streamed = True
            self._fetch_rate = _Median(self.config.window)
        if now.read_s > last.read_s:
            self.record_fetch(now.read_bytes - last.read_bytes, now.read_s - last.read_s)
        self._write_rate.rate(now.written_bytes - last.written_bytes, now.write_s - last.write_s)
        self._received.rate(now.received_bytes - last.received_bytes, now.received_s - last.received_s)
        self._waited.rate(now.waited_bytes - last.waited_bytes, now.waited_s - last.waited_s)

    def record_step(self, seconds: float, samples: int, kind: str, depth: int) -> None:
        """A training step's period (its prefix's start to the next one's).

        Args:
            seconds: The period.
            samples: The step's samples.
            kind: ``"served"`` (every row from the cache) or ``"recomputed"`` (every row computed, nothing
                stored).
            depth: The frozen depth.
        """
        self._steps.setdefault((depth, kind), _Median(self.config.window)).add(seconds / max(samples, 1))

    def check_measured(self, k: int) -> None:
        """At an epoch start: keep whichever of caching and recomputing the steps measured faster.

        Once steps were served; recomputing is measured if it was, else the model's.

        Args:
            k: The frozen depth.
        """
        served = self._measured(k, "served")
        if served is None:
            return
        recomputed = self._measured(k, "recomputed")
        m = self.measurements(k)
        if recomputed is None and m is None:
            return
        how = "measured"
        if recomputed is None:
            assert m is not None  # returned above otherwise
            recomputed, how = sum(m.stage_forward_s_per_sample[:k]) + m.suffix_step_s_per_sample, "predicted"
        b = self.batch_size
        numbers = (f"{served * b * 1e3:.3g} ms per step served from the cache vs {recomputed * b * 1e3:.3g} ms "
                   f"recomputing ({how})")
        if served * (1.0 + self.config.min_gain) <= recomputed:
            verdict = (PlanMode.CACHE, f"cache depth {k} for every sample: measured {numbers}")
        else:
            verdict = (PlanMode.RECOMPUTE, f"recompute stages 0..{k - 1}: measured {numbers}")
        self._verdicts[k] = verdict

    def _measured(self, k: int, kind: str) -> float | None:
        median = self._steps.get((k, kind))
        return median.get() if median is not None and len(median.values) >= _MIN_STEPS else None

    def record_decode(self, nbytes: int, seconds: float) -> None:
        """Time a decode of entries.

        Args:
            nbytes: The bytes decoded.
            seconds: The decode's time.
        """
        self._decode_rate.rate(nbytes, seconds)

    def record_h2d(self, nbytes: int, seconds: float) -> None:
        """A host-to-device copy (CUDA only; without readings the cost model counts no copy time).

        Args:
            nbytes: The bytes copied.
            seconds: The copy's time.
        """
        self._h2d_rate.rate(nbytes, seconds)

    def record_suffix(self, seconds: float, samples: int) -> None:
        """Time of the rest of the step (suffix forward, backward, optimizer).

        Args:
            seconds: That time.
            samples: The step's samples.
        """
        self._suffix_s.add(seconds / max(samples, 1))

    def set_written(self, depth: int, samples: int) -> None:
        """Record how many distinct samples are stored at ``depth`` for the current frozen weights.

        Args:
            depth: The depth of the entries.
            samples: The distinct samples stored.
        """
        self._written[depth] = samples

    def record_encoding(self, depth: int, choice: EncodingChoice) -> None:
        """The codec chosen for the entries at ``depth`` (called from the connection's writer thread).

        Args:
            depth: The depth of the entries.
            choice: The codec and why.
        """
        self._encodings[depth] = choice
        log.info("actcache encoding for depth %d: %s", depth, choice.reason)
        current = self.current
        if current is not None and current.cache_depth == depth:
            self.current = dataclasses.replace(current, encoding=choice.encoding)

    def begin_epoch(self, epoch: int, num_samples: int, batch_size: int) -> None:
        """An epoch starts: plans follow the loader's epochs.

        Args:
            epoch: The epoch.
            num_samples: The epoch's samples.
            batch_size: The batch size.
        """
        self.epoch, self.num_samples, self.batch_size = epoch, max(num_samples, 1), max(batch_size, 1)
        self._in_epoch, self._epoch_plan = True, None

    def measurements(self, k: int) -> Measurements | None:
        """Current measurements for frozen depth k, or None until every stage of the prefix was timed.

        Args:
            k: The frozen depth.
        """
        stage_s = [s for d in range(k) if d in self._stage_s and (s := self._stage_s[d].get()) is not None]
        if k == 0 or len(stage_s) < k:
            return None
        c = self.config
        remaining = c.assume_remaining_epochs if c.total_epochs is None else max(c.total_epochs - self.epoch, 0.0)
        return Measurements(
            stage_forward_s_per_sample=stage_s,
            entry_bytes_per_sample=[0.0] + [self._stage_bytes[d].get(0.0) for d in range(1, k + 1)],
            fetch_bytes_per_s=self._fetch_bytes_per_s(),
            # A measured rate already includes the per-call latency; until then use miss-only calls.
            fetch_latency_s=0.0 if self._fetch_rate.get() else self._fetch_latency.get(c.prior_fetch_latency_s),
            write_bytes_per_s=self._write_rate.get(c.prior_write_bytes_per_s),
            h2d_bytes_per_s=self._h2d_rate.get(),
            suffix_step_s_per_sample=self._suffix_s.get(0.0),
            batch_size=self.batch_size,
            num_samples=self.num_samples,
            remaining_epochs=remaining,
            budget_bytes=c.budget_bytes,
            decode_bytes_per_s=self._decode_rate.get(c.prior_decode_bytes_per_s),
            written_fraction=[min(self._written.get(d, 0) / self.num_samples, 1.0) for d in range(k + 1)],
        )

    def needs_replan(self, k: int) -> bool:
        """Whether depth ``k`` is measured and has no plan yet, or moved by more than ``replan_drift`` since it.

        Args:
            k: The frozen depth.
        """
        now = self.measurements(k)
        return now is not None and (self._basis is None or self.current is None
                                    or should_replan(self._basis, now, self.config.replan_drift))

    def _fetch_bytes_per_s(self) -> float:
        """The fetch speed: timed reads, else the prior below the ceiling of the frames the step waited for;
        never below the rate the step received (module docstring)."""
        fetch = self._fetch_rate.get()
        if fetch is None:
            fetch = min(self.config.prior_fetch_bytes_per_s, self._waited.get(math.inf))
        return max(fetch, self._received.get(0.0))

    def plan_for(self, k: int) -> Plan | None:
        """Plan for frozen depth k (None until the prefix was measured); logged and sent to listeners.

        Args:
            k: The frozen depth.
        """
        m = self.measurements(k)
        if m is None:
            return None
        new = self._follow_verdict(k, plan(k, m, min_gain=self.config.min_gain))
        current = self.current
        if (self._in_epoch and self._epoch_plan == k and current is not None and new.mode is PlanMode.CACHE
                and (current.mode, current.cache_depth) == (new.mode, new.cache_depth)):
            new = current  # mid-epoch: keep the fraction (module docstring)
        self._epoch_plan = k if self._in_epoch else None
        if new.cache_depth in self._encodings:
            new = dataclasses.replace(new, encoding=self._encodings[new.cache_depth].encoding)
        changed = self.current is None or (new.mode, new.cache_depth, round(new.cached_fraction, 3)) != (
            self.current.mode, self.current.cache_depth, round(self.current.cached_fraction, 3))
        self.current, self._basis = new, m
        if changed:
            log.info("actcache plan for frozen depth %d: %s", k, new.reason)
        for listener in self.listeners:
            listener(k, new)
        return new

    def _follow_verdict(self, k: int, modelled: Plan) -> Plan:
        """``modelled``, unless the measured check chose the other mode for depth ``k``."""
        verdict = self._verdicts.get(k)
        if verdict is None:
            return modelled
        mode, reason = verdict
        if mode is modelled.mode and (mode is PlanMode.RECOMPUTE or
                                      (modelled.cache_depth, modelled.cached_fraction) == (k, 1.0)):
            return dataclasses.replace(modelled, reason=f"{reason}; the model agrees: {modelled.reason}")
        if mode is PlanMode.RECOMPUTE:
            return dataclasses.replace(modelled, mode=mode, cache_depth=None, recompute_stages=(0, k),
                                       cached_fraction=0.0, expected_step_s=modelled.baseline_step_s,
                                       write_epoch_extra_s=0.0, reason=reason)
        # caching: every sample at depth k, as measured (the model's partial plans can be far off on a busy host)
        return dataclasses.replace(modelled, mode=mode, cache_depth=k, recompute_stages=(k, k), cached_fraction=1.0,
                                   reason=reason)
