"""Decide whether caching the frozen prefix pays, at which depth, and for how many samples.

Pure (no torch, no I/O): the caller measures, :func:`plan` decides, the caller logs ``Plan.reason``.

Model, per sample in seconds. k = frozen depth; P(a, b) = forward time of stages
a..b-1; e_j = stored bytes per sample at depth j (state after j stages); c = cached
fraction; B = batch size; R = remaining epochs; 1/h2d is 0 on CPU-only machines::

    baseline       = P(0, k) + suffix                        recompute the prefix every step
    device(j, c)   = c·P(j, k) + (1 - c)·P(0, k) + suffix     hits start at depth j, misses at raw input
    transfer(j, c) = c·e_j·(1/fetch + 1/h2d) + latency/B      daemon read-ahead, side-stream H2D copy
    decode(j, c)   = c·e_j/decode                            bytes -> tensor on the client thread
    steady(j, c)   = max(transfer, device) + decode          one read epoch
    write(j, c)    = (c - w)·e_j·(1/write + 1/h2d)           D2H copy + put of what is not stored yet
    amortized(j,c) = (steady(j, w) + write + (R - 1)·steady) / R    w = share already stored (steady(j, 0) = baseline)

Fetch and H2D overlap the device's work (the daemon reads ahead along the pushed order, the
client copies on a side stream), so the step waits for the slower; decode runs on the client's
thread and is charged serially. Raw-input loading is the same in every plan and left out.
Entries written in epoch e are first read in epoch e+1, so R <= 1 never caches new entries;
entries already written (w = ``written_fraction[j]``) cost nothing more: a plan within them has
no write epoch, a plan beyond them writes only the rest.

Partial caching: c <= c_budget = budget / (num_samples·e_j), members chosen by
:func:`cached_subset`. amortized is convex piecewise linear in c, so its minimum is at c_budget,
at w, or at the balance point c* where transfer = device, taken at a fetch ``fetch_margin``
slower than measured (an overrated fetch makes the step wait; an underrated one only recomputes).
All j in 1..k are tried (deeper j wins ties); CACHE needs strictly faster and
``1 - amortized/baseline >= min_gain``.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from actcache.errors import ConfigError

__all__ = ["Measurements", "Plan", "PlanMode", "cached_subset", "plan", "should_replan"]

_MASK64 = (1 << 64) - 1


def _number(name: str, value: object, *, positive: bool = False, allow_inf: bool = False,
            fix: str = "fix the measurement that produced it") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a real number, got {value!r}; {fix}")
    v = float(value)
    if math.isnan(v) or v < 0 or (positive and v == 0) or (math.isinf(v) and not allow_inf):
        need = ("> 0" if positive else ">= 0") + (" (inf allowed)" if allow_inf else ", finite")
        raise ConfigError(f"{name} must be {need}, got {value!r}; {fix}")
    return v


def _integer(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


_POSITIVE = ("fetch_bytes_per_s", "write_bytes_per_s", "decode_bytes_per_s", "h2d_bytes_per_s")
_NON_NEGATIVE = ("fetch_latency_s", "suffix_step_s_per_sample", "remaining_epochs", "budget_bytes")


class PlanMode(enum.Enum):
    """RECOMPUTE runs stages[0:k] on raw input every step; CACHE serves depth j from the daemon."""

    RECOMPUTE = "recompute"
    CACHE = "cache"


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Validated on construction (``ValueError``): throughputs > 0; times, sizes, epochs >= 0 and
    finite; ``budget_bytes`` may be ``math.inf``.

    Attributes:
        stage_forward_s_per_sample: Forward seconds per sample of each stage (P).
        entry_bytes_per_sample: Stored bytes per sample after d stages, at index d (e_d).
        fetch_bytes_per_s: The daemon's read speed.
        fetch_latency_s: The latency of one read.
        write_bytes_per_s: The daemon's write speed.
        h2d_bytes_per_s: The host-to-device copy speed (None: no copy, CPU only).
        suffix_step_s_per_sample: Seconds per sample of the rest of the step (suffix forward, backward,
            optimizer).
        batch_size: B.
        num_samples: The dataset's samples.
        remaining_epochs: R.
        budget_bytes: Storage available (may be ``math.inf``).
        decode_bytes_per_s: The client's decode speed.
        written_fraction: Share of samples already stored at each depth (index as entry_bytes_per_sample);
            missing = 0.
    """

    stage_forward_s_per_sample: Sequence[float]
    entry_bytes_per_sample: Sequence[float]
    fetch_bytes_per_s: float
    fetch_latency_s: float
    write_bytes_per_s: float
    h2d_bytes_per_s: float | None
    suffix_step_s_per_sample: float
    batch_size: int
    num_samples: int
    remaining_epochs: float
    budget_bytes: float
    decode_bytes_per_s: float
    #: Share of samples already stored at each depth (index as entry_bytes_per_sample); missing = 0.
    written_fraction: Sequence[float] = ()

    def __post_init__(self) -> None:
        if any(not 0.0 <= _number("Measurements.written_fraction", w) <= 1.0 for w in self.written_fraction):
            raise ConfigError(f"Measurements.written_fraction values must be in [0, 1], got {self.written_fraction!r}")
        object.__setattr__(self, "written_fraction", tuple(float(w) for w in self.written_fraction))
        for name in ("stage_forward_s_per_sample", "entry_bytes_per_sample"):
            seq = getattr(self, name)
            if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
                raise ConfigError(f"Measurements.{name} must be a sequence of numbers (one per stage), got {seq!r}")
            object.__setattr__(self, name, tuple(_number(f"Measurements.{name}[{i}]", v) for i, v in enumerate(seq)))
        for name in _POSITIVE + _NON_NEGATIVE:
            if not (name == "h2d_bytes_per_s" and self.h2d_bytes_per_s is None):
                object.__setattr__(self, name, _number(f"Measurements.{name}", getattr(self, name),
                                                       positive=name in _POSITIVE, allow_inf=name == "budget_bytes"))
        for name in ("batch_size", "num_samples"):
            object.__setattr__(self, name, _integer(f"Measurements.{name}", getattr(self, name), 1))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A decision of ``plan``; step times are seconds per step of ``batch_size`` samples.

    Attributes:
        mode: RECOMPUTE or CACHE.
        cache_depth: The depth served from the daemon (None with RECOMPUTE).
        recompute_stages: Half-open range run on a cache hit (misses run ``(0, k)``).
        cached_fraction: The share of samples cached (``cached_subset``).
        expected_step_s: Amortized over the remaining epochs (write epoch included).
        baseline_step_s: Recomputing the prefix every step.
        write_epoch_extra_s: The whole write epoch's extra.
        reason: Why, in words.
        numbers: The values the decision was based on.
        encoding: How the daemon stores the entries at ``cache_depth`` (``--encoding`` syntax), once
            CachedForward(encoding="auto") chose it from the first entries written; else None.
    """

    mode: PlanMode
    cache_depth: int | None
    recompute_stages: tuple[int, int]
    cached_fraction: float
    expected_step_s: float
    baseline_step_s: float
    write_epoch_extra_s: float
    reason: str
    numbers: dict[str, float] = field(default_factory=dict)
    #: How the daemon stores the entries at ``cache_depth`` (``--encoding`` syntax), once
    #: CachedForward(encoding="auto") chose it from the first entries written; else None.
    encoding: str | None = None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _size(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0 if n < 1 or math.isinf(n) else min(int(math.log2(n)) // 10, len(units) - 1)
    return "unlimited" if math.isinf(n) else f"{n / 1024**i:.4g} {units[i]}"


def _evaluate(j: int, c: float, k: int, pre: list[float], m: Measurements) -> dict[str, float]:
    e, inv_h2d = m.entry_bytes_per_sample[j], 0.0 if m.h2d_bytes_per_s is None else 1.0 / m.h2d_bytes_per_s
    baseline = pre[k] + m.suffix_step_s_per_sample

    def reading(x: float) -> tuple[float, float, float, float]:
        """(device, transfer, decode, step) per sample with a share x of the samples read at depth j."""
        device = x * (pre[k] - pre[j]) + (1.0 - x) * pre[k] + m.suffix_step_s_per_sample
        transfer = x * e * (1.0 / m.fetch_bytes_per_s + inv_h2d) + m.fetch_latency_s / m.batch_size
        decode = x * e / m.decode_bytes_per_s
        return device, transfer, decode, max(transfer, device) + decode

    device, transfer, decode, steady = reading(c)
    written = m.written_fraction[j] if j < len(m.written_fraction) else 0.0
    if c <= written:  # already stored: no write epoch, every remaining epoch reads
        write, amortized = 0.0, steady
    else:  # this epoch reads what is stored and writes the rest of the share; later epochs read it all
        write = (c - written) * e * (1.0 / m.write_bytes_per_s + inv_h2d)
        this_epoch = (reading(written)[3] if written else baseline) + write
        amortized = (this_epoch + (m.remaining_epochs - 1.0) * steady) / m.remaining_epochs
    # c* solves transfer(c) = device(c): both are linear in c.
    slope = e * (1.0 / m.fetch_bytes_per_s + inv_h2d) + pre[j]
    balance = (baseline - m.fetch_latency_s / m.batch_size) / slope if slope > 0 else math.inf
    return {"depth": float(j), "cached_fraction": c, "device_s_per_sample": device,
            "transfer_s_per_sample": transfer, "decode_s_per_sample": decode, "steady_s_per_sample": steady,
            "write_s_per_sample": write, "amortized_s_per_sample": amortized, "entry_bytes_per_sample": e,
            "balance_fraction": balance, "gain": 1.0 - amortized / baseline if baseline > 0 else 0.0}


def plan(frozen_depth: int, m: Measurements, *, min_gain: float = 0.02, fetch_margin: float = 0.25) -> Plan:
    """Choose RECOMPUTE or CACHE at depth j <= ``frozen_depth`` (see the module docstring).

    Args:
        frozen_depth: k, the number of frozen stages.
        m: The measurements.
        min_gain: CACHE needs ``1 - amortized/baseline >= min_gain``.
        fetch_margin: The fetch speed is taken this share slower than measured at the balance point.

    Returns:
        The plan, with its reason and numbers.

    Raises:
        ConfigError: ``m`` lacks stage times or entry sizes for ``frozen_depth``, or an argument is not a
            number.
    """
    k = _integer("plan: frozen_depth", frozen_depth, 0)
    if k > len(m.stage_forward_s_per_sample) or k >= len(m.entry_bytes_per_sample):
        raise ConfigError(f"frozen depth {k} needs {k} stage times and {k + 1} entry sizes, got "
                         f"{len(m.stage_forward_s_per_sample)} and {len(m.entry_bytes_per_sample)}; measure them")
    min_gain = _number("plan: min_gain", min_gain, fix="pass a share of the step time such as 0.02")
    fetch_margin = _number("plan: fetch_margin", fetch_margin, fix="pass a share of the fetch speed such as 0.25")
    slower = dataclasses.replace(m, fetch_bytes_per_s=m.fetch_bytes_per_s / (1.0 + fetch_margin))
    pre = list(itertools.accumulate(m.stage_forward_s_per_sample[:k], initial=0.0))
    b, r = m.batch_size, m.remaining_epochs
    baseline = pre[k] + m.suffix_step_s_per_sample
    base = {"baseline_s_per_sample": baseline, "remaining_epochs": r, "min_gain": min_gain}

    def recompute(reason: str, numbers_: dict[str, float]) -> Plan:
        return Plan(mode=PlanMode.RECOMPUTE, cache_depth=None, recompute_stages=(0, k), cached_fraction=0.0,
                    expected_step_s=baseline * b, baseline_step_s=baseline * b, write_epoch_extra_s=0.0,
                    reason=reason, numbers=numbers_)

    if k == 0:
        return recompute("nothing is frozen (frozen depth 0): there is no prefix to cache", base)
    if r <= 1.0 and not any(m.written_fraction[1 : k + 1]):
        return recompute(f"recompute stages 0..{k - 1} ({_ms(baseline * b)} per step): {r:g} epoch(s) remain and "
                         "entries written now are first read next epoch, so caching cannot pay", base)
    best: dict[str, float] | None = None
    for j in range(k, 0, -1):
        need = m.num_samples * m.entry_bytes_per_sample[j]
        c_budget = 1.0 if need <= m.budget_bytes else m.budget_bytes / need
        written = m.written_fraction[j] if j < len(m.written_fraction) else 0.0
        for c in (c_budget, _evaluate(j, 0.0, k, pre, slower)["balance_fraction"], written):
            if 0.0 < c <= c_budget and (r > 1.0 or c <= written):
                cand = {**_evaluate(j, c, k, pre, m), "budget_fraction": c_budget}
                if best is None or cand["amortized_s_per_sample"] < best["amortized_s_per_sample"]:
                    best = cand
    if best is None:
        return recompute(f"recompute stages 0..{k - 1}: the budget ({_size(m.budget_bytes)}) holds no entry", base)
    numbers_ = {**base, **best}
    j, c = int(best["depth"]), best["cached_fraction"]
    bound = "fetch" if best["transfer_s_per_sample"] > best["device_s_per_sample"] else "compute"
    detail = (f"depth {j} of {k} for {c:.1%} of samples ({_size(best['entry_bytes_per_sample'])}/sample, "
              f"budget {_size(m.budget_bytes)} holds {best['budget_fraction']:.1%}, "
              f"fetch {_size(m.fetch_bytes_per_s)}/s): {_ms(best['amortized_s_per_sample'] * b)} per step "
              f"amortized over {r:g} epochs vs {_ms(baseline * b)} recomputing; read epochs "
              f"{_ms(best['steady_s_per_sample'] * b)} per step ({bound}-bound: transfer "
              f"{_ms(best['transfer_s_per_sample'] * b)}, device {_ms(best['device_s_per_sample'] * b)})")
    if not (best["amortized_s_per_sample"] < baseline and best["gain"] >= min_gain):
        return recompute(f"recompute stages 0..{k - 1}: the best cache option, {detail}, gains "
                         f"{best['gain']:.1%} < min_gain {min_gain:.1%}", numbers_)
    write_epoch = best["write_s_per_sample"] * m.num_samples
    return Plan(mode=PlanMode.CACHE, cache_depth=j, recompute_stages=(j, k), cached_fraction=c,
                expected_step_s=best["amortized_s_per_sample"] * b, baseline_step_s=baseline * b,
                write_epoch_extra_s=write_epoch, numbers=numbers_,
                reason=f"cache {detail}, {best['gain']:.1%} faster; the write epoch costs +{write_epoch:.3g} s")


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def cached_subset(sample_id: int, fraction: float, salt: int = 0) -> bool:
    """Whether ``sample_id`` is in the cached subset of size ``fraction``.

    u = top 53 bits of splitmix64((sample_id mod 2**64) XOR splitmix64(salt mod 2**64)) / 2**53;
    member iff u < fraction. The same in every process and platform (unlike ``hash()``), and
    nested: a smaller fraction's subset is within a larger one's (shrinking keeps what was written).

    Args:
        sample_id: The sample.
        fraction: The subset's share, in [0, 1].
        salt: Picks another subset of the same size.

    Raises:
        ConfigError: ``fraction`` is not in [0, 1].
    """
    fraction = _number("cached_subset: fraction", fraction, fix="pass a share in [0, 1]")
    if fraction > 1.0:
        raise ConfigError(f"cached_subset: fraction must be in [0, 1], got {fraction!r}")
    h = _splitmix64((operator.index(sample_id) & _MASK64) ^ _splitmix64(operator.index(salt) & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53)) < fraction


def should_replan(old: Measurements, new: Measurements, drift: float = 0.25) -> bool:
    """True if any measured number moved by more than ``drift`` relative to ``old``.

    Every field but ``remaining_epochs`` and ``written_fraction`` counts, sequences element-wise (a length
    change counts), a None/number change counts, an old value of 0 drifts on any change.

    Args:
        old: The measurements the plan was made with.
        new: The current measurements.
        drift: The largest relative change that does not count.
    """
    drift = _number("should_replan: drift", drift, fix="pass a relative change such as 0.25")

    def moved(a: float | None, b: float | None) -> bool:
        if a == b:
            return False
        if a is None or b is None or a == 0 or math.isinf(a) or math.isinf(b):
            return True
        return abs(b - a) / abs(a) > drift

    def flat(m: Measurements) -> list[float | None]:
        skip = ("remaining_epochs", "written_fraction")
        values = [getattr(m, f.name) for f in fields(Measurements) if f.name not in skip]
        return [x for v in values for x in (v if isinstance(v, tuple) else [v])]

    a, b = flat(old), flat(new)
    return len(a) != len(b) or any(moved(x, y) for x, y in zip(a, b))
