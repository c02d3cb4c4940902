"""Egeria's plasticity-based freezing (EuroSys '23, §4.2.2 and Algorithm 1).

Per evaluation, for the frontmost active stage ``s == signals.frozen``::

    bootstrapping --(|Δloss| / loss_prev < bootstrap_threshold)--> knowledge-guided   (one way)

    knowledge-guided, per reading p of stage s:
      smoothed = mean(last W readings)                         (Eq. 2)
      slope    = least-squares slope of the last W smoothed values, per evaluation
      T[s]     = tolerance_fraction * max |slope| of s's first tolerance_readings slopes
                 (those readings only calibrate; T[s] is kept for refreezing)
      |slope| < T[s] -> consecutive += 1, else consecutive = 0
      consecutive == W -> FREEZE_NEXT(s); stage s+1 starts with fresh readings

    any time frozen > 0 and lr <= lr_at_freeze / unfreeze_lr_factor
      -> UNFREEZE_ALL; W = max(W // 2, min_window); stage 0 starts with fresh readings

``lr_at_freeze`` is the lr when stage 0 was frozen (re-anchored by
``on_schedule_restart`` for cyclic schedules). Algorithm 1 performs the freeze
one call after the counter reaches W; here it happens on the W-th low-slope
evaluation itself. The paper's test reads ``s < T``; plasticity falls, so the
slope is compared by magnitude.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

from actcache.errors import ConfigError

from actcache_client.freeze.policy import Decision, Signals

__all__ = ["EgeriaConfig", "EgeriaPolicy"]

_STATE_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class EgeriaConfig:
    """Knobs of Egeria's freezing rule; defaults are the paper's (§4.2.2, §6.4)."""

    #: W: moving-average span, slope-fit span, and consecutive low-slope evaluations to
    #: freeze. Paper: W=10 (§4.2.2 guideline; §6.4: 5 freezes too eagerly, 20 too late).
    window: int = 10
    #: T as a fraction of the largest |slope| among a stage's first readings. Paper: 20%
    #: (§4.2.2); §6.4: 40% freezes unconverged stages, 10% practically never freezes.
    tolerance_fraction: float = 0.2
    #: How many initial slope readings calibrate T per stage. Paper: 3 (§4.2.2).
    tolerance_readings: int = 3
    #: Bootstrapping ends once the training loss changes by less than this fraction per
    #: evaluation interval. Paper: 10% (§4.2.2). None skips bootstrapping.
    bootstrap_threshold: float | None = 0.1
    #: Unfreeze all once lr has dropped by this factor since stage 0 froze. Paper: 10 (§4.2.2).
    unfreeze_lr_factor: float = 10.0
    #: W halves at every unfreeze but never below this; a slope needs 2 points.
    min_window: int = 2

    def __post_init__(self) -> None:
        if self.min_window < 2:
            raise ConfigError(f"min_window={self.min_window}: a slope needs at least 2 points; use min_window >= 2")
        if self.window < self.min_window:
            raise ConfigError(f"window={self.window} is below min_window={self.min_window}; raise window "
                              "(the paper uses 10)")
        if not (math.isfinite(self.tolerance_fraction) and self.tolerance_fraction > 0):
            raise ConfigError(f"tolerance_fraction={self.tolerance_fraction} must be a positive number "
                              "(the paper uses 0.2)")
        if self.tolerance_readings < 1:
            raise ConfigError(f"tolerance_readings={self.tolerance_readings} must be >= 1 (the paper uses 3)")
        if self.bootstrap_threshold is not None and not 0 < self.bootstrap_threshold <= 1:
            raise ConfigError(f"bootstrap_threshold={self.bootstrap_threshold} must be in (0, 1] as a fraction "
                              "of the loss (the paper uses 0.1), or None to skip bootstrapping")
        if not (math.isfinite(self.unfreeze_lr_factor) and self.unfreeze_lr_factor > 1):
            raise ConfigError(f"unfreeze_lr_factor={self.unfreeze_lr_factor} must be > 1 (the paper uses 10)")


def _slope(values: Sequence[float]) -> float:
    n = len(values)
    x_mean = (n - 1) / 2
    y_mean = sum(values) / n
    num = sum((x - x_mean) * (y - y_mean) for x, y in enumerate(values))
    return num / sum((x - x_mean) ** 2 for x in range(n))


class EgeriaPolicy:
    """Freeze the frontmost active stage once its plasticity has been flat for W evaluations.

    Invariants: min_window <= window <= config.window; len(raw), len(smoothed) <= window;
    consecutive <= window; lr_at_freeze is None whenever nothing is frozen.
    """

    def __init__(self, config: EgeriaConfig | None = None) -> None:
        self.config = config or EgeriaConfig()
        bootstrap = self.config.bootstrap_threshold is not None
        self.needs = frozenset({"plasticity", "loss"} if bootstrap else {"plasticity"})
        self._bootstrapping = bootstrap
        self._prev_loss: float | None = None
        self._window = self.config.window
        self._tolerance: dict[int, float] = {}
        self._lr_at_freeze: float | None = None
        self._reset_stage(0)

    @property
    def bootstrapping(self) -> bool:
        """True until the loss settles; the controller builds the reference model after it."""
        return self._bootstrapping

    @property
    def window(self) -> int:
        """The current W (halved at every unfreeze)."""
        return self._window

    def on_schedule_restart(self) -> None:
        """A cyclic lr schedule restarted: measure the next lr drop from the next evaluation's lr."""
        self._lr_at_freeze = None

    def _reset_stage(self, stage: int) -> None:
        self._stage = stage
        self._raw: collections.deque[float] = collections.deque(maxlen=self._window)
        self._smoothed: collections.deque[float] = collections.deque(maxlen=self._window)
        self._calibration: list[float] = []
        self._consecutive = 0

    def observe(self, signals: Signals) -> Decision:
        if signals.frozen != self._stage:
            self._reset_stage(signals.frozen)
        if signals.frozen == 0:
            self._lr_at_freeze = None
        elif self._lr_at_freeze is None:
            self._lr_at_freeze = signals.lr
        lr_numbers = {"lr": signals.lr, "window": float(self._window)}
        if self._lr_at_freeze is not None:
            lr_numbers["lr_at_freeze"] = self._lr_at_freeze
            limit = self._lr_at_freeze / self.config.unfreeze_lr_factor
            if signals.lr <= limit * (1 + 1e-9):  # 0.1 * 0.1 == 0.010000000000000002 still counts
                self._window = max(self._window // 2, self.config.min_window)
                self._lr_at_freeze = None
                self._reset_stage(0)
                return Decision.unfreeze_all(
                    f"lr {signals.lr:g} <= {lr_numbers['lr_at_freeze']:g} (at the freeze) / "
                    f"{self.config.unfreeze_lr_factor:g}; refreezing with W={self._window}", lr_numbers)
        if self._bootstrapping:
            return self._bootstrap(signals.loss)
        if signals.frozen >= signals.num_stages - 1:
            return Decision.none("only the head is active; it always trains", lr_numbers)
        if signals.plasticity is None or not math.isfinite(signals.plasticity):
            return Decision.none(f"no usable plasticity reading ({signals.plasticity})", lr_numbers)
        return self._evaluate(float(signals.plasticity), signals.lr)

    def _bootstrap(self, loss: float | None) -> Decision:
        if loss is None:
            raise ValueError("EgeriaPolicy needs signals.loss while bootstrapping; pass the training loss "
                             "or set EgeriaConfig(bootstrap_threshold=None)")
        if not math.isfinite(loss):
            return Decision.none(f"bootstrapping: non-finite loss {loss} ignored")
        prev, self._prev_loss = self._prev_loss, loss
        if prev is None:
            return Decision.none("bootstrapping: first loss reading", {"loss": loss})
        change = abs(prev - loss) / abs(prev) if prev != 0 else (0.0 if loss == 0 else math.inf)
        numbers = {"loss": loss, "loss_change": change}
        threshold = cast(float, self.config.bootstrap_threshold)  # bootstrapping implies one
        if change < threshold:
            self._bootstrapping = False
            return Decision.none(f"bootstrapping ended: loss changed {change:.1%} < {threshold:.0%} "
                                 "per interval", numbers)
        return Decision.none(f"bootstrapping: loss changed {change:.1%} >= {threshold:.0%} per interval", numbers)

    def _evaluate(self, plasticity: float, lr: float) -> Decision:
        stage, window = self._stage, self._window
        self._raw.append(plasticity)
        smoothed = sum(self._raw) / len(self._raw)
        self._smoothed.append(smoothed)
        numbers = {"plasticity": plasticity, "smoothed": smoothed, "window": float(window)}
        if len(self._smoothed) < 2:
            return Decision.none(f"stage {stage}: collecting plasticity", numbers)
        slope = _slope(self._smoothed)
        numbers["slope"] = slope
        threshold = self._tolerance.get(stage)
        if threshold is None:
            self._calibration.append(abs(slope))
            if len(self._calibration) < self.config.tolerance_readings:
                return Decision.none(f"stage {stage}: calibrating tolerance "
                                     f"({len(self._calibration)}/{self.config.tolerance_readings})", numbers)
            threshold = self.config.tolerance_fraction * max(self._calibration)
            self._tolerance[stage] = threshold
            numbers["threshold"] = threshold
            return Decision.none(f"stage {stage}: tolerance set to {threshold:.3g}", numbers)
        self._consecutive = self._consecutive + 1 if abs(slope) < threshold else 0
        numbers.update(threshold=threshold, consecutive=float(self._consecutive))
        if self._consecutive < window:
            return Decision.none(f"stage {stage}: |slope| {abs(slope):.3g} vs tolerance {threshold:.3g}, "
                                 f"{self._consecutive}/{window} low", numbers)
        if stage == 0:
            self._lr_at_freeze = lr
        self._reset_stage(stage + 1)
        return Decision.freeze(stage, f"stage {stage}: |slope| < {threshold:.3g} for {window} evaluations", numbers)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "bootstrapping": self._bootstrapping,
            "prev_loss": self._prev_loss,
            "window": self._window,
            "tolerance": [[stage, t] for stage, t in sorted(self._tolerance.items())],
            "lr_at_freeze": self._lr_at_freeze,
            "stage": self._stage,
            "raw": list(self._raw),
            "smoothed": list(self._smoothed),
            "calibration": list(self._calibration),
            "consecutive": self._consecutive,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"EgeriaPolicy state version {state.get('version')!r} is not {_STATE_VERSION}; "
                             "it was saved by an incompatible actcache version")
        self._bootstrapping = bool(state["bootstrapping"])
        self._prev_loss = state["prev_loss"]
        self._window = int(state["window"])
        self._tolerance = {int(stage): float(t) for stage, t in state["tolerance"]}
        self._lr_at_freeze = state["lr_at_freeze"]
        self._reset_stage(int(state["stage"]))
        self._raw.extend(float(v) for v in state["raw"])
        self._smoothed.extend(float(v) for v in state["smoothed"])
        self._calibration = [float(v) for v in state["calibration"]]
        self._consecutive = int(state["consecutive"])
