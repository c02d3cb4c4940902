"""Policies that need no signal: a fixed schedule, manual requests, and never."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from actcache.errors import ConfigError
from actcache_client.freeze.policy import Decision, Signals, check_state_version

__all__ = ["FreezeMilestone", "ManualPolicy", "NoFreezePolicy", "StaticPolicy"]

_STATE_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class FreezeMilestone:
    """Have ``stages`` stages frozen once ``step >= at_step`` or ``epoch >= at_epoch`` (give one).

    Attributes:
        stages: The number of stages frozen at the milestone (at least 1).
        at_step: The optimizer step it is reached at.
        at_epoch: The epoch it is reached at.

    Raises:
        ConfigError: ``stages`` is below 1, not exactly one of ``at_step`` and ``at_epoch`` is given, or it
            is negative.
    """

    stages: int
    at_step: int | None = None
    at_epoch: int | None = None

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ConfigError(f"FreezeMilestone(stages={self.stages}) must freeze at least 1 stage")
        if (self.at_step is None) == (self.at_epoch is None):
            raise ConfigError(f"FreezeMilestone(stages={self.stages}) needs exactly one of at_step or at_epoch, "
                              f"got at_step={self.at_step} at_epoch={self.at_epoch}")
        when = self.at_step if self.at_step is not None else self.at_epoch
        if when is not None and when < 0:
            raise ConfigError(f"FreezeMilestone(stages={self.stages}) has a negative step/epoch {when}")

    def reached(self, signals: Signals) -> bool:
        """Whether the milestone is reached.

        Args:
            signals: The evaluation's signals (their step and epoch).
        """
        if self.at_step is not None:
            return signals.step >= self.at_step
        return self.at_epoch is not None and signals.epoch >= self.at_epoch


class _NoSignal:
    """A policy that needs no signal; its state holds at least a version."""

    needs: frozenset[str] = frozenset()

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a ``state_dict()`` of a policy built with the same configuration.

        Args:
            state: The saved state.

        Raises:
            ConfigError: The state was saved by an incompatible version.
        """
        check_state_version(type(self).__name__, state, _STATE_VERSION)


class StaticPolicy(_NoSignal):
    """Freeze stage by stage, one per observation, up to the largest count among reached milestones.

    ``StaticPolicy(stages=3, at_epoch=1)`` is one milestone; ``StaticPolicy([FreezeMilestone(stages=1,
    at_step=500), FreezeMilestone(stages=3, at_epoch=2)])`` a schedule. It never unfreezes.

    Args:
        freeze_at: The milestones of a schedule.
        stages: One more milestone: this many stages frozen at ``at_step`` or ``at_epoch``.
        at_step: That milestone's step.
        at_epoch: That milestone's epoch.

    Raises:
        ConfigError: No milestone is given, or ``at_step``/``at_epoch`` without ``stages``.
    """

    def __init__(self, freeze_at: Sequence[FreezeMilestone] = (), *, stages: int | None = None,
                 at_step: int | None = None, at_epoch: int | None = None) -> None:
        milestones = list(freeze_at)
        if stages is not None:
            milestones.append(FreezeMilestone(stages=stages, at_step=at_step, at_epoch=at_epoch))
        elif at_step is not None or at_epoch is not None:
            raise ConfigError("StaticPolicy got at_step/at_epoch without stages=; say how many stages to freeze")
        if not milestones:
            raise ConfigError("StaticPolicy needs a milestone: StaticPolicy(stages=3, at_epoch=1) or freeze_at=[...]")
        self.milestones = tuple(milestones)

    def observe(self, signals: Signals) -> Decision:
        """Freeze the frontmost active stage while fewer stages are frozen than the reached milestones ask.

        Args:
            signals: The evaluation's signals.

        Returns:
            The decision and the numbers it was based on.

        Raises:
            ConfigError: A milestone asks for the head (or more stages than the model has) to freeze.
        """
        most = max(m.stages for m in self.milestones)
        if most > signals.num_stages - 1:
            raise ConfigError(f"StaticPolicy asks for {most} frozen stages but the model has {signals.num_stages} "
                              f"stages and the head always trains; freeze at most {signals.num_stages - 1}")
        target = max((m.stages for m in self.milestones if m.reached(signals)), default=0)
        numbers = {"target": float(target)}
        if signals.frozen < target:
            return Decision.freeze(signals.frozen, f"schedule: {target} stages frozen by step {signals.step} "
                                                   f"epoch {signals.epoch}", numbers)
        return Decision.none(f"schedule: {target} stages due, {signals.frozen} frozen", numbers)


class ManualPolicy(_NoSignal):
    """Freeze or unfreeze when asked, e.g. from a notebook, a signal handler or another thread.

    Requests are served one stage per observation; an unfreeze cancels pending
    freezes; freezes that would reach the head are dropped. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending_freezes = 0
        self._pending_unfreeze = False

    def request_freeze(self, stages: int = 1) -> None:
        """Freeze more stages, one per following observation.

        Args:
            stages: How many more.

        Raises:
            ConfigError: ``stages`` is below 1.
        """
        if stages < 1:
            raise ConfigError(f"request_freeze(stages={stages}) must ask for at least 1 stage")
        with self._lock:
            self._pending_freezes += stages

    def request_unfreeze(self) -> None:
        """Unfreeze every stage at the next observation; cancels pending freeze requests."""
        with self._lock:
            self._pending_freezes = 0
            self._pending_unfreeze = True

    def observe(self, signals: Signals) -> Decision:
        """Serve the pending requests: an unfreeze, else one stage of the pending freezes.

        Args:
            signals: The evaluation's signals.

        Returns:
            The decision and the numbers it was based on.
        """
        with self._lock:
            if self._pending_unfreeze:
                self._pending_unfreeze = False
                if signals.frozen > 0:
                    return Decision.unfreeze_all("manual request")
                return Decision.none("manual unfreeze request: nothing is frozen")
            if self._pending_freezes == 0:
                return Decision.none("no manual request")
            if signals.frozen >= signals.num_stages - 1:
                dropped, self._pending_freezes = self._pending_freezes, 0
                return Decision.none(f"dropped {dropped} manual freeze request(s): only the head is active, "
                                     "and it always trains", {"dropped": float(dropped)})
            self._pending_freezes -= 1
            return Decision.freeze(signals.frozen, "manual request", {"pending": float(self._pending_freezes)})

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {**super().state_dict(), "pending_freezes": self._pending_freezes,
                    "pending_unfreeze": self._pending_unfreeze}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a ``state_dict()`` of a policy built with the same configuration.

        Args:
            state: The saved state.

        Raises:
            ConfigError: The state was saved by an incompatible version.
        """
        super().load_state_dict(state)
        with self._lock:
            self._pending_freezes = int(state["pending_freezes"])
            self._pending_unfreeze = bool(state["pending_unfreeze"])


class NoFreezePolicy(_NoSignal):
    """Never freeze: what a run gets that no policy can judge; the controller warns ``reason`` once.

    Args:
        reason: Why the run does not freeze.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def observe(self, signals: Signals) -> Decision:
        """Never freeze.

        Args:
            signals: The evaluation's signals (unused).
        """
        return Decision.none(self.reason)
