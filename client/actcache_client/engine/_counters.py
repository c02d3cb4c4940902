"""What the forward pass counts: seconds per part and samples per source, overall and per epoch."""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields

__all__ = ["EpochCounters", "EpochLog", "StepTimes"]


@dataclass
class StepTimes:
    """Seconds per part of the forward pass, and samples per source, accumulated.

    Samples: ``prefix_samples`` needed the frozen prefix; each of them was
    served from the cache (``cached_samples``), computed from a shallower
    cached depth (``seeded_samples``) or computed from its raw input
    (``computed_samples``): ``prefix_samples == cached + seeded + computed``.

    Attributes:
        fetch_wait: The time the step waited for entries (stream or Get).
        prefix: Seconds running the frozen stages.
        suffix_forward: Seconds of the active stages' forward.
        steps: Forward passes.
        prefix_samples: Samples that needed the frozen prefix.
        computed_samples: Computed from their raw input.
        seeded_samples: Computed from a shallower cached depth.
        cached_samples: Served from the cache.
        raw_loaded: Raw items (dataset inputs) the batches carried or that were loaded on the spot.
        audit: Seconds spent recomputing audited hits.
        audited_samples: How many hits were audited.
    """

    fetch_wait: float = 0.0
    prefix: float = 0.0
    suffix_forward: float = 0.0
    steps: int = 0
    prefix_samples: int = 0
    computed_samples: int = 0
    seeded_samples: int = 0
    cached_samples: int = 0
    #: Raw items (dataset inputs) the batches carried or that were loaded on the spot.
    raw_loaded: int = 0
    #: Seconds spent recomputing audited hits, and how many were audited.
    audit: float = 0.0
    audited_samples: int = 0

    def since(self, earlier: "StepTimes") -> "StepTimes":
        """What was counted after ``earlier``.

        Args:
            earlier: A copy of these counters taken before.
        """
        return StepTimes(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})


@dataclass(frozen=True)
class EpochCounters:
    """What one epoch counted: the model's samples and seconds, and the connection's entries.

    Attributes:
        epoch: The epoch.
        times: The StepTimes it added.
        entries: Entries asked, hits, misses, streamed, gets, puts... of ClientStats during the epoch (None
            without a connection).
    """

    epoch: int
    times: StepTimes
    #: Entries asked, hits, misses, streamed, gets, puts... of ClientStats during the epoch (None without a connection).
    entries: dict[str, float] | None


class EpochLog:
    """The counters at each epoch's start, so that what each epoch added can be told apart."""

    def __init__(self) -> None:
        self._marks: list[tuple[int, StepTimes, dict[str, float] | None]] = []

    def mark(self, epoch: int, times: StepTimes, entries: dict[str, float] | None) -> None:
        """Epoch ``epoch`` starts with these StepTimes and ClientStats counts."""
        self._marks.append((epoch, copy.copy(times), entries))

    def counters(self, times: StepTimes, entries: dict[str, float] | None) -> list[EpochCounters]:
        """What each epoch added, the last one until the counts given now."""
        marks = [*self._marks, (None, times, entries)]
        out = []
        for (epoch, earlier, counts), (_, later, now) in zip(self._marks, marks[1:]):
            delta = None if counts is None or now is None else {k: now[k] - v for k, v in counts.items()}
            out.append(EpochCounters(epoch, later.since(earlier), delta))
        return out
