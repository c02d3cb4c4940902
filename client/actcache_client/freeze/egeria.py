"""Egeria's plasticity-based freezing (EuroSys '23, §4.2.2 and Algorithm 1), on readings of constant age.

Per evaluation, for the frontmost active stage ``s == signals.frozen``::

    bootstrapping --(smoothed loss changes < bootstrap_threshold per interval)--> knowledge-guided   (one way)

    knowledge-guided, per reading p of stage s (the SP loss between two eval-mode snapshots
    `age` evaluations apart, default W / 2: reference.py):
      smoothed = mean(last W readings)                                   (Eq. 2)
      T[s]     = tolerance_fraction * max |smoothed| of s so far; the first tolerance_readings
                 values only calibrate it (again after every unfreeze: see below)
      smoothed < T[s] -> consecutive += 1, else consecutive = 0
      consecutive == W -> FREEZE_NEXT(s); stage s+1 starts with fresh readings

    frozen > 0, the lr fell at this evaluation after a flat interval (a discrete drop), and
    lr <= lr_at_freeze / unfreeze_lr_factor
      -> UNFREEZE_ALL; W = max(W // 2, min_window); every T[s] is calibrated again;
         stage 0 starts with fresh readings

Cyclic lr schedules call ``on_schedule_restart``. docs/design/egeria.md says
where this departs from the paper, and why.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, cast

from actcache.errors import ConfigError
from actcache_client.freeze._main_guard import check_main_guard
from actcache_client.freeze.policy import Decision, Signals, check_state_version, relative_change

__all__ = ["EgeriaConfig", "EgeriaPolicy"]

_STATE_VERSION = 3
_SAME = 1e-9  # relative tolerance for "the lr did not change"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EgeriaConfig:
    """Knobs of Egeria's freezing rule; defaults are the paper's (§4.2.2, §6.4) unless marked ours.

    Attributes:
        window: W: moving-average span and consecutive low evaluations to freeze. Paper: 10 (§4.2.2, §6.4).
        tolerance_fraction: T as a fraction of the largest |smoothed reading| of a stage. Paper: 20% of the
            early slopes (§4.2.2).
        tolerance_readings: How many initial smoothed readings calibrate T per stage. Paper: 3 (§4.2.2).
        bootstrap_threshold: Bootstrapping ends once the loss changes by less than this fraction per
            interval. Paper: 10% (§4.2.2). None skips bootstrapping.
        bootstrap_steps: Ours: the loss is averaged over spans of at least this many steps before two spans
            are compared.
        unfreeze_lr_factor: Unfreeze all once a discrete lr drop brings it this factor below its value when
            stage 0 froze. Paper: 10.
        min_window: W halves at every unfreeze but never below this. Ours.
        freeze_lr_fraction: Ours, after FreezeOut: a stage that passed the test freezes only once the lr is
            at most this fraction of the largest lr seen so far (it waits, ready, until then). None: no such
            wait.

    Raises:
        ConfigError: A knob is out of range.
    """

    #: W: moving-average span and consecutive low evaluations to freeze. Paper: 10 (§4.2.2, §6.4).
    window: int = 10
    #: T as a fraction of the largest |smoothed reading| of a stage. Paper: 20% of the early slopes (§4.2.2).
    tolerance_fraction: float = 0.2
    #: How many initial smoothed readings calibrate T per stage. Paper: 3 (§4.2.2).
    tolerance_readings: int = 3
    #: Bootstrapping ends once the loss changes by less than this fraction per interval. Paper: 10%
    #: (§4.2.2). None skips bootstrapping.
    bootstrap_threshold: float | None = 0.1
    #: Ours: the loss is averaged over spans of at least this many steps before two spans are compared.
    bootstrap_steps: int = 32
    #: Unfreeze all once a discrete lr drop brings it this factor below its value when stage 0 froze. Paper: 10.
    unfreeze_lr_factor: float = 10.0
    #: W halves at every unfreeze but never below this. Ours.
    min_window: int = 2
    #: Ours, after FreezeOut: a stage that passed the test freezes only once the lr is at most this
    #: fraction of the largest lr seen so far (it waits, ready, until then). None: no such wait.
    freeze_lr_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.min_window < 2:
            raise ConfigError(f"min_window={self.min_window}: the moving average needs at least 2 readings; "
                              "use min_window >= 2")
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
        if self.bootstrap_steps < 1:
            raise ConfigError(f"bootstrap_steps={self.bootstrap_steps} must be >= 1 step (default 32)")
        if self.freeze_lr_fraction is not None and not 0 < self.freeze_lr_fraction <= 1:
            raise ConfigError(f"freeze_lr_fraction={self.freeze_lr_fraction} must be in (0, 1] as a fraction of the "
                              "peak lr (0.5: freeze once the lr has halved), or None")
        if not (math.isfinite(self.unfreeze_lr_factor) and self.unfreeze_lr_factor > 1):
            raise ConfigError(f"unfreeze_lr_factor={self.unfreeze_lr_factor} must be > 1 (the paper uses 10)")


class EgeriaPolicy:
    """Freeze the frontmost active stage once its plasticity per span has stayed below T for W evaluations.

    Its readings come from a spawned process: built by a script's top-level code outside
    ``if __name__ == "__main__":``, it is a ConfigError (freeze._main_guard).

    Invariants: min_window <= window <= config.window; len(raw) <= window;
    consecutive <= window; lr_at_freeze is None whenever nothing is frozen;
    lrs holds the lr of the last two evaluations (distinct steps).

    Args:
        config: The rule's knobs; default: the paper's (``EgeriaConfig()``).

    Raises:
        ConfigError: Built by a script's top-level code outside ``if __name__ == "__main__":``.
    """

    def __init__(self, config: EgeriaConfig | None = None) -> None:
        check_main_guard("EgeriaPolicy")
        self.config = config or EgeriaConfig()
        self._bootstrapping = self.config.bootstrap_threshold is not None
        self.needs = frozenset({"plasticity", "loss"} if self._bootstrapping else {"plasticity"})
        self._window = self.config.window
        self._tolerance: dict[int, float] = {}
        self._lr_at_freeze: float | None = None
        self._lrs: list[float] = []
        self._peak_lr = 0.0
        self._last_step: int | None = None
        self._span = [0.0, 0]  # loss x steps, steps of the span being summed
        self._prev_span: tuple[float, float] | None = None  # mean, steps
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
        self._calibration: list[float] = []
        self._consecutive = 0

    def observe(self, signals: Signals) -> Decision:
        """Bootstrap on the loss, then judge the frontmost active stage's plasticity; unfreeze all after an lr drop.

        Args:
            signals: The evaluation's signals (``plasticity``; ``loss`` while bootstrapping).

        Returns:
            The decision and the numbers it was based on.
        """
        interval = signals.step - (self._last_step or 0)
        dropped = False
        if signals.step != self._last_step:
            prev = self._lrs[-2:]
            dropped = (len(prev) == 2 and abs(prev[1] - prev[0]) <= _SAME * prev[0]
                       and signals.lr < prev[1] * (1 - _SAME))
            self._lrs = [*prev[-1:], signals.lr]
            self._peak_lr = max(self._peak_lr, signals.lr)
        self._last_step = signals.step
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
            if dropped and signals.lr <= limit * (1 + _SAME):  # 0.1 * 0.1 == 0.010000000000000002 still counts
                self._window = max(self._window // 2, self.config.min_window)
                self._lr_at_freeze = None
                self._tolerance.clear()
                self._reset_stage(0)
                return Decision.unfreeze_all(
                    f"lr dropped to {signals.lr:g} <= {lr_numbers['lr_at_freeze']:g} (at the freeze) / "
                    f"{self.config.unfreeze_lr_factor:g}; refreezing with W={self._window}", lr_numbers)
        if self._bootstrapping:
            return self._bootstrap(signals.loss, interval)
        if signals.frozen >= signals.num_stages - 1:
            return Decision.none("only the head is active; it always trains", lr_numbers)
        if signals.plasticity is None or not math.isfinite(signals.plasticity):
            return Decision.none(f"no usable plasticity reading ({signals.plasticity})", lr_numbers)
        return self._evaluate(float(signals.plasticity), signals.lr)

    def _bootstrap(self, loss: float | None, steps: int) -> Decision:
        if loss is None:
            raise ConfigError("EgeriaPolicy needs signals.loss while bootstrapping; pass the training loss "
                             "or set EgeriaConfig(bootstrap_threshold=None)")
        if not math.isfinite(loss):
            return Decision.none(f"bootstrapping: non-finite loss {loss} ignored")
        if steps <= 0:
            return Decision.none("bootstrapping: same step observed again", {"loss": loss})
        self._span[0] += loss * steps
        self._span[1] += steps
        total, span_steps = self._span
        need = max(self.config.bootstrap_steps, steps)
        if span_steps < need:
            return Decision.none(f"bootstrapping: averaging the loss ({span_steps}/{need} steps)", {"loss": loss})
        mean = total / span_steps
        self._span = [0.0, 0]
        prev, self._prev_span = self._prev_span, (mean, span_steps)
        numbers = {"loss": mean, "span_steps": float(span_steps)}
        if prev is None:
            return Decision.none(f"bootstrapping: first loss span ({span_steps} steps)", numbers)
        fraction = min(1.0, steps / ((prev[1] + span_steps) / 2))  # one interval of the spans' mean length
        change = (1 - math.exp(-abs(math.log(prev[0] / mean)) * fraction) if prev[0] > 0 and mean > 0
                  else relative_change(prev[0], mean) * fraction)  # geometric; linear unless both are > 0
        numbers["loss_change"] = change
        threshold = cast(float, self.config.bootstrap_threshold)  # bootstrapping implies one
        self._bootstrapping = change >= threshold
        state, op = ("bootstrapping", ">=") if self._bootstrapping else ("bootstrapping ended", "<")
        return Decision.none(f"{state}: smoothed loss changed {change:.1%} {op} {threshold:.0%} per interval", numbers)

    def _evaluate(self, plasticity: float, lr: float) -> Decision:
        stage, window = self._stage, self._window
        self._raw.append(plasticity)
        smoothed = sum(self._raw) / len(self._raw)
        numbers = {"plasticity": plasticity, "smoothed": smoothed, "window": float(window)}
        threshold = self._tolerance.get(stage)
        if threshold is None:
            self._calibration.append(abs(smoothed))
            if len(self._calibration) < self.config.tolerance_readings:
                return Decision.none(f"stage {stage}: calibrating tolerance "
                                     f"({len(self._calibration)}/{self.config.tolerance_readings})", numbers)
            threshold = self.config.tolerance_fraction * max(self._calibration)
            self._tolerance[stage] = numbers["threshold"] = threshold
            return Decision.none(f"stage {stage}: tolerance set to {threshold:.3g}", numbers)
        threshold = self._tolerance[stage] = max(threshold, self.config.tolerance_fraction * abs(smoothed))
        self._consecutive = min(self._consecutive + 1, window) if smoothed < threshold else 0  # ready stays ready
        numbers.update(threshold=threshold, consecutive=float(self._consecutive))
        if self._consecutive < window:
            return Decision.none(f"stage {stage}: smoothed plasticity {smoothed:.3g} vs tolerance {threshold:.3g}, "
                                 f"{self._consecutive}/{window} low", numbers)
        fraction = self.config.freeze_lr_fraction
        if fraction is not None and lr > fraction * self._peak_lr * (1 + _SAME):
            return Decision.none(f"stage {stage}: ready, waiting for the lr ({lr:g}) to fall to {fraction:g} x its "
                                 f"peak {self._peak_lr:g}", numbers)
        if stage == 0:
            self._lr_at_freeze = lr
        self._reset_stage(stage + 1)
        return Decision.freeze(stage, f"stage {stage}: smoothed plasticity < {threshold:.3g} for {window} "
                                      "evaluations", numbers)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION, "bootstrapping": self._bootstrapping, "span": list(self._span),
            "prev_span": None if self._prev_span is None else list(self._prev_span),
            "last_step": self._last_step, "lrs": list(self._lrs), "peak_lr": self._peak_lr, "window": self._window,
            "tolerance": [[stage, t] for stage, t in sorted(self._tolerance.items())],
            "lr_at_freeze": self._lr_at_freeze, "stage": self._stage, "raw": list(self._raw),
            "calibration": list(self._calibration), "consecutive": self._consecutive,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a ``state_dict()`` of a policy built with the same configuration.

        Args:
            state: The saved state.

        Raises:
            ConfigError: The state was saved by an incompatible version.
        """
        check_state_version("EgeriaPolicy", state, _STATE_VERSION)
        self._bootstrapping = bool(state["bootstrapping"])
        self._span = [float(state["span"][0]), int(state["span"][1])]
        prev = state["prev_span"]
        self._prev_span = None if prev is None else (float(prev[0]), int(prev[1]))
        self._last_step = state["last_step"]
        self._lrs = [float(v) for v in state["lrs"]]
        self._peak_lr = float(state["peak_lr"])
        self._window = int(state["window"])
        self._tolerance = {int(stage): float(t) for stage, t in state["tolerance"]}
        self._lr_at_freeze = state["lr_at_freeze"]
        self._reset_stage(int(state["stage"]))
        self._raw.extend(float(v) for v in state["raw"])
        self._calibration = [float(v) for v in state["calibration"]]
        self._consecutive = int(state["consecutive"])
