"""What a freeze policy sees, what it answers, and the contract every policy keeps.

A policy is decision logic only: the controller calls ``observe(signals)`` once
per evaluation, applies the ``Decision`` and reports it in the next
``Signals.frozen``. Stages ``0 .. frozen-1`` are frozen, stage ``frozen`` is
the frontmost active one, and the last stage (the head) always trains.

Decision lifecycle, from the controller's side::

    NONE          nothing to do
    FREEZE_NEXT   freeze stage == signals.frozen   (frozen -> frozen + 1)
    UNFREEZE_ALL  unfreeze every stage             (frozen -> 0), only if frozen > 0
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from actcache.errors import ConfigError, PolicyError

__all__ = [
    "Decision",
    "DecisionKind",
    "FreezePolicy",
    "SIGNAL_NAMES",
    "Signals",
    "check_freeze_policy_contract",
]

#: The optional signals a policy may need; the controller computes only these.
SIGNAL_NAMES = frozenset({"grad_norms", "loss", "plasticity"})


class DecisionKind(enum.Enum):
    NONE = "none"
    FREEZE_NEXT = "freeze_next"
    UNFREEZE_ALL = "unfreeze_all"


@dataclasses.dataclass(frozen=True)
class Decision:
    """One answer of a policy; ``numbers`` are the values it was based on (for the timeline).

    Attributes:
        kind: Do nothing, freeze the frontmost active stage, or unfreeze all.
        stage: The stage to freeze (FREEZE_NEXT only; None otherwise).
        reason: Why, in words.
        numbers: The values the decision was based on.

    Raises:
        ConfigError: FREEZE_NEXT without a stage index >= 0, or another kind with a stage.
    """

    kind: DecisionKind
    stage: int | None
    reason: str
    numbers: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind is DecisionKind.FREEZE_NEXT:
            if not isinstance(self.stage, int) or self.stage < 0:
                raise ConfigError(f"FREEZE_NEXT needs a stage index >= 0, got {self.stage!r}")
        elif self.stage is not None:
            raise ConfigError(f"{self.kind.name} takes stage=None, got {self.stage!r}")

    @classmethod
    def none(cls, reason: str, numbers: Mapping[str, float] | None = None) -> Decision:
        """No change.

        Args:
            reason: Why, in words.
            numbers: The values the decision was based on.
        """
        return cls(DecisionKind.NONE, None, reason, dict(numbers or {}))

    @classmethod
    def freeze(cls, stage: int, reason: str, numbers: Mapping[str, float] | None = None) -> Decision:
        """Freeze ``stage``, the frontmost active one.

        Args:
            stage: The stage to freeze.
            reason: Why, in words.
            numbers: The values the decision was based on.
        """
        return cls(DecisionKind.FREEZE_NEXT, stage, reason, dict(numbers or {}))

    @classmethod
    def unfreeze_all(cls, reason: str, numbers: Mapping[str, float] | None = None) -> Decision:
        """Unfreeze every stage.

        Args:
            reason: Why, in words.
            numbers: The values the decision was based on.
        """
        return cls(DecisionKind.UNFREEZE_ALL, None, reason, dict(numbers or {}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Signals:
    """What the controller measured since the previous evaluation.

    Attributes:
        step: The optimizer step of the evaluation.
        epoch: The epoch.
        frozen: The number of frozen stages (the head always trains).
        num_stages: The number of stages.
        lr: The learning rate.
        loss: The training loss, ideally averaged over the interval.
        plasticity: The SP loss of stage ``frozen`` against the reference model (None when no reading is
            ready).
        grad_norms: One accumulated gradient norm per stage over the interval (entries of frozen stages are
            ignored).

    Raises:
        ConfigError: A field is out of range, or ``grad_norms`` has not one entry per stage.
    """

    step: int
    epoch: int
    frozen: int
    num_stages: int
    lr: float
    loss: float | None = None
    plasticity: float | None = None
    grad_norms: Sequence[float] | None = None

    def __post_init__(self) -> None:
        for name in ("lr", "loss", "plasticity"):  # accept 0-d tensors and numpy scalars
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        if self.num_stages < 1:
            raise ConfigError(f"num_stages must be >= 1, got {self.num_stages}")
        if not 0 <= self.frozen < self.num_stages:
            raise ConfigError(f"frozen={self.frozen} is outside 0..{self.num_stages - 1} for {self.num_stages} "
                              "stages (the head stage always trains)")
        if self.step < 0 or self.epoch < 0:
            raise ConfigError(f"step and epoch must be >= 0, got step={self.step} epoch={self.epoch}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ConfigError(f"lr must be finite and >= 0, got {self.lr}")
        if self.grad_norms is not None:
            norms = tuple(float(g) for g in self.grad_norms)
            if len(norms) != self.num_stages:
                raise ConfigError(f"grad_norms has {len(norms)} entries for {self.num_stages} stages; "
                                  "pass one per stage")
            object.__setattr__(self, "grad_norms", norms)


@runtime_checkable
class FreezePolicy(Protocol):
    """Decides when to freeze the frontmost active stage or unfreeze all; ``needs`` is a subset of ``SIGNAL_NAMES``.

    ``state_dict()`` is JSON-serialisable; ``load_state_dict`` into a policy built with the same
    configuration continues with identical decisions.
    """

    needs: frozenset[str]

    def observe(self, signals: Signals) -> Decision:
        """Decide on this evaluation's signals.

        Args:
            signals: What the controller measured since the previous evaluation.

        Returns:
            The decision and the numbers it was based on.
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """The policy's state, JSON-serialisable."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a ``state_dict()`` of a policy built with the same configuration.

        Args:
            state: The saved state.
        """
        ...


def _key(d: Decision) -> tuple[Any, ...]:  # nan equals nan
    return d.kind, d.stage, d.reason, sorted((k, "nan" if math.isnan(v) else v) for k, v in d.numbers.items())


def relative_change(prev: float, cur: float) -> float:
    """|prev - cur| / |prev|: 0 when both are 0, inf when only ``prev`` is."""
    if prev == 0:
        return 0.0 if cur == 0 else math.inf
    return abs(prev - cur) / abs(prev)


def check_state_version(owner: str, state: Mapping[str, Any], version: int) -> None:
    if state.get("version") != version:
        raise ConfigError(f"{owner} state version {state.get('version')!r} is not {version}; "
                          "it was saved by an incompatible actcache version")


def depth_after(decision: Decision, frozen: int, num_stages: int, who: str) -> int:
    """The frozen depth once ``decision`` is applied; PolicyError unless a freeze targets exactly stage ``frozen``
    and not the head, and an unfreeze finds something frozen."""
    if decision.kind is DecisionKind.FREEZE_NEXT:
        if decision.stage != frozen:
            raise PolicyError(f"{who} asked to freeze stage {decision.stage} with {frozen} of {num_stages} stages "
                              f"frozen; only stage {frozen} may freeze (only the frontmost active stage "
                              "may freeze; see check_freeze_policy_contract)")
        if frozen >= num_stages - 1:
            raise PolicyError(f"{who} asked to freeze stage {frozen}, the head of {num_stages} stages; "
                              "the head always trains (see check_freeze_policy_contract)")
        return frozen + 1
    if decision.kind is DecisionKind.UNFREEZE_ALL:
        if frozen == 0:
            raise PolicyError(f"{who} asked to unfreeze all with nothing frozen")
        return 0
    return frozen


def _run(policy: FreezePolicy, stream: Sequence[Signals], frozen: int, start: int,
         before_observe: Callable[[Any, int], None] | None) -> tuple[list[Decision], int]:
    """Feed ``stream`` with ``frozen`` overridden by the applied decisions; check each decision."""
    decisions = []
    for index, template in enumerate(stream, start=start):
        if before_observe is not None:
            before_observe(policy, index)
        signals = dataclasses.replace(template, frozen=frozen)
        decision = policy.observe(signals)
        where = f"signal #{index} (step {signals.step}, frozen={frozen})"
        if not isinstance(decision, Decision):
            raise AssertionError(f"{where}: observe returned {decision!r}, not a Decision")
        try:
            frozen = depth_after(decision, frozen, signals.num_stages, "the policy")
        except PolicyError as exc:
            raise AssertionError(f"{where}: {exc}") from None
        decisions.append(decision)
    return decisions, frozen


def check_freeze_policy_contract(policy_factory: Callable[[], FreezePolicy], signal_stream: Sequence[Signals], *,
                                 before_observe: Callable[[Any, int], None] | None = None,
                                 snapshot_at: Sequence[int] | None = None) -> list[Decision]:
    """Assert the freeze-policy contract; return the decisions of one uninterrupted run.

    Checked: ``needs`` names known signals; decisions keep ``depth_after``'s
    rule; a state snapshot taken before signal ``k``, passed through JSON into
    a fresh policy, yields the same decisions for the rest of the stream.

    Args:
        policy_factory: Builds a fresh policy.
        signal_stream: The signals to observe; their ``frozen`` fields are replaced by the applied
            decisions' count.
        before_observe: ``before_observe(policy, index)`` runs before each observation on every policy
            (e.g. to make manual requests).
        snapshot_at: The signal indices to snapshot before (default: halfway).

    Returns:
        The decisions of one uninterrupted run.

    Raises:
        AssertionError: Names the first violation.
    """
    stream = list(signal_stream)
    policy = policy_factory()
    if not isinstance(policy, FreezePolicy):
        raise AssertionError(f"{policy!r} does not implement FreezePolicy "
                             "(observe, state_dict, load_state_dict, needs)")
    if not isinstance(policy.needs, frozenset) or not policy.needs <= SIGNAL_NAMES:
        raise AssertionError(f"needs={policy.needs!r} must be a frozenset of {sorted(SIGNAL_NAMES)}")
    splits = sorted(set(snapshot_at if snapshot_at is not None else [len(stream) // 2]))
    if splits and not 0 <= splits[0] <= splits[-1] <= len(stream):
        raise ConfigError(f"snapshot_at must lie in 0..{len(stream)} (the stream length), got {splits}")
    decisions: list[Decision] = []
    snapshots: list[tuple[int, Any, int]] = []
    frozen = 0
    for done, split in zip([0, *splits], [*splits, len(stream)]):
        more, frozen = _run(policy, stream[done:split], frozen, done, before_observe)
        decisions += more
        snapshots.append((split, json.loads(json.dumps(policy.state_dict())), frozen))
    for split, state, frozen in snapshots[:-1]:
        restored = policy_factory()
        restored.load_state_dict(state)
        replay, _ = _run(restored, stream[split:], frozen, split, before_observe)
        for index, (want, got) in enumerate(zip(decisions[split:], replay, strict=True), start=split):
            if _key(want) != _key(got):
                raise AssertionError(f"signal #{index}: after a state_dict round trip at #{split} the policy "
                                     f"decided {got!r}, the uninterrupted one {want!r}")
    return decisions
