"""Egeria's freezing rule on synthetic stages: false freezes of a stage that never converges, delay on one that does.

    python bench/bench_policy.py [--evaluations 200] [--seeds 5] [--window 10] [--json PATH] [--no-schemes]

No training: each stage of a small staged model is a 64->32 Linear layer
with dropout 0.1 (then a fixed random 32->64 projection to the next stage;
the stage judged is both) whose weights the script sets at every step, following a
trajectory in weight space (a rotation between two orthogonal weight
matrices of equal norm, plus fresh jitter of 1% each step):

    drifting    angle = 0.02 * t              keeps changing at a constant rate, never converges
    converging  angle = 0.8 * (1 - exp(-t/25)) its drift falls exponentially
    still       angle = 0                     only jitter

The real ``FreezeController`` runs ``EgeriaPolicy`` (W=10, bootstrapping
off) on it with one evaluation per step and the real reference process
(fp32; the readings compare eval-mode snapshots, so the dropout of
the training forward is not in them). Unlike a training run, each evaluation waits
for the reading of the previous probe, so every evaluation gets one and the
figures do not depend on the machine's load.

- ``egeria_false_freezes``: freezes among four drifting stages (+ head) in
  ``--evaluations`` evaluations, summed over the seeds. Target 0.
- ``egeria_freeze_delay``: for a converging stage, evaluations between the
  evaluation where its drift (the reading's mean over 16 batches and jitter
  draws: the reading without its sampling noise), smoothed over W
  like the policy's readings, falls below the policy's T, and the evaluation
  that freezes it; the median over the seeds (the largest printed above
  it). Target <= W. The delay
  against the unsmoothed drift is printed too (the moving average's lag
  comes on top).

Before the figures, ``--schemes`` (default on) prints the experiment behind
the rule (client/actcache_client/freeze/egeria.py): the same trajectories
read in-process against references refreshed every W or of constant age,
tested by the old slope rule (re-implemented here) or by the level rule;
"minus age 0" takes a same-batch floor off a reading against the training
forward (the reading before the current one), "eval vs eval" compares two
snapshots (the current one). Sample output (2 shared cores, 25 s):

    scheme                        test   drifting: first (count)   converging            still
    refresh every W               slope  16 22 13 16 26 (32)         18 32 13 18 26 (39)  ...
    ...
    constant age 5, minus age 0   level  - - - - - (0)               42 34 40 45 41 (21)  ...
    constant age 5, eval vs eval  level  - - - - - (0)               41 38 41 40 40 (6)   - - - - - (0)
    drifting: seed 0: 0 freezes of 4 stages in 200 evaluations ...
    converging: seed 0: drift below T=0.000137 at evaluation 35 (unsmoothed 31), frozen at 44: delay 9 ...
    egeria_freeze_delay: median 9, largest 10, W = 10
    figure: egeria_false_freezes = 0
    figure: egeria_freeze_delay = 9
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

import actcache_client as ac
from actcache_client.freeze import (
    DecisionKind,
    EgeriaConfig,
    EgeriaPolicy,
    FreezeController,
    ReferenceConfig,
    Signals,
    sp_loss,
)
from actcache_client.freeze.reference import ReferenceWorker

D_IN, D_OUT, BATCH = 64, 32, 32
KINDS = ("drifting", "converging", "still")


def angle(kind: str, t: int) -> float:
    return {"drifting": 0.02 * t, "converging": 0.8 * (1 - math.exp(-t / 25)), "still": 0.0}[kind]


class Trajectory:
    """Weights of one synthetic stage at evaluation t: a rotation in weight space plus fresh jitter."""

    def __init__(self, kind: str, seed: int, jitter: float = 0.01) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kind, self.jitter, self.g = kind, jitter, g
        self.w0 = torch.randn(D_OUT, D_IN, generator=g) / math.sqrt(D_IN)
        w1 = torch.randn(D_OUT, D_IN, generator=g)
        w1 -= (w1 * self.w0).sum() / (self.w0 * self.w0).sum() * self.w0
        self.w1 = w1 / w1.norm() * self.w0.norm()

    def clean(self, t: int) -> torch.Tensor:
        a = angle(self.kind, t)
        return math.cos(a) * self.w0 + math.sin(a) * self.w1

    def __call__(self, t: int) -> torch.Tensor:
        return self.clean(t) + self.jitter * torch.randn(self.w0.shape, generator=self.g) / math.sqrt(D_IN)


class SyntheticStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(D_IN, D_OUT, bias=False)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.linear(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_IN, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Chain(nn.Module):
    """Synthetic stages feeding each other through fixed random projections back to D_IN."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.stages = nn.ModuleList(SyntheticStage() for _ in range(count))
        self.back = nn.ModuleList(nn.Linear(D_OUT, D_IN, bias=False) for _ in range(count))
        self.head = Head()


def staged_chain(count: int, seed: int) -> tuple[ac.StagedModel, list[SyntheticStage]]:
    torch.manual_seed(seed)
    chain = Chain(count)
    for p in chain.parameters():
        p.requires_grad_(False)  # nothing trains: the script sets the weights
    parts: list[nn.Module] = []
    for stage, back in zip(chain.stages, chain.back):
        parts += [stage, back]
    return ac.from_sequential(nn.Sequential(*parts, chain.head), groups=[2] * count + [1]), list(chain.stages)


@contextlib.contextmanager
def waiting_for_readings() -> Iterator[None]:
    """Each evaluation waits (up to 60 s) for the probe in flight: one reading per evaluation, load-independent."""
    poll = ReferenceWorker.poll

    def answered(self: ReferenceWorker, wait_s: float = 0.0) -> list:
        out = poll(self, wait_s=wait_s)
        deadline = time.monotonic() + 60.0
        while self.stats.in_flight and time.monotonic() < deadline:
            out += poll(self, wait_s=deadline - time.monotonic())
        return out

    ReferenceWorker.poll = answered  # type: ignore[method-assign]
    try:
        yield
    finally:
        ReferenceWorker.poll = poll


def run_controller(kind: str, count: int, seed: int, evaluations: int, window: int) -> dict:
    """``count`` stages of ``kind`` (+ a head) under the real controller; returns its evaluation records."""
    staged, stages = staged_chain(count, seed)
    trajectories = [Trajectory(kind, 1000 * seed + i) for i in range(count)]
    cached = ac.CachedForward(staged)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # the controller reads its lr
    policy = EgeriaPolicy(EgeriaConfig(window=window, bootstrap_threshold=None))
    reference = ReferenceConfig()
    g = torch.Generator().manual_seed(seed)

    def move_to(t: int) -> None:  # what an optimizer step does in training: new weights before the evaluation
        with torch.no_grad():
            for stage, trajectory in zip(stages, trajectories):
                stage.linear.weight.copy_(trajectory(t))

    move_to(0)
    with waiting_for_readings(), FreezeController(cached, opt, policy, eval_every=1, reference=reference,
                                                  hook_optimizer=False) as ctl:
        for t in range(evaluations):
            staged.train()
            cached(torch.arange(BATCH), torch.randn(BATCH, D_IN, generator=g))  # weights of t; probes capture it
            move_to(t + 1)
            ctl.step()  # evaluation t + 1 (step t + 1): snapshot of the weights of t + 1
        records = [r for r in ctl.timeline.records if r["event"] == "evaluation"]
        return {"records": records, "changes": ctl.changes, "trajectories": trajectories,
                "stage": copy.deepcopy(staged.stages[0]),
                "stats": ctl.reference_stats}


def expected_drift(trajectory: Trajectory, stage: nn.Module, evaluations: int, age: int, window: int,
                   draws: int = 16) -> tuple[list, list]:
    """Per evaluation step s, the mean over ``draws`` batches and jitters of the reading the policy gets
    there (fp32 references of ``stage``, the judged stage with its projection, with the weights of s - 1 -
    age and s - 1, jittered), the first at s = age + 2; and its moving average over W: the drift without
    the sampling noise of one reading."""
    g = torch.Generator().manual_seed(7)

    def jitter(g: torch.Generator) -> torch.Tensor:
        return trajectory.jitter * torch.randn(D_OUT, D_IN, generator=g) / math.sqrt(D_IN)

    ref_old, ref_now = copy.deepcopy(stage).eval(), copy.deepcopy(stage).eval()
    synthetic = [next(m for m in ref.modules() if isinstance(m, SyntheticStage)) for ref in (ref_now, ref_old)]
    raw: list[float | None] = [None] * min(evaluations + 1, age + 2)
    with torch.no_grad():
        for s in range(age + 2, evaluations + 1):
            total = 0.0
            for _ in range(draws):
                x = torch.randn(BATCH, D_IN, generator=g)
                synthetic[0].linear.weight.copy_(trajectory.clean(s - 1) + jitter(g))
                synthetic[1].linear.weight.copy_(trajectory.clean(s - 1 - age) + jitter(g))
                total += sp_loss(ref_now(x), ref_old(x))
            raw.append(total / draws)
    smoothed, seen = [], []
    for value in raw:
        if value is not None:
            seen.append(value)
        smoothed.append(sum(seen[-window:]) / len(seen[-window:]) if seen else None)
    return raw, smoothed


# ---------------------------------------------------------------- the experiment behind the rule

class SlopeRule:
    """The rule before the fix: least-squares slope of the smoothed readings against T (20% of the first 3)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.reset()

    def reset(self) -> None:
        self.raw: list[float] = []
        self.smoothed: list[float] = []
        self.calibration: list[float] = []
        self.tolerance: float | None = None
        self.low = 0

    def observe(self, p: float | None) -> bool:
        if p is None:
            return False
        self.raw.append(p)
        self.smoothed.append(sum(self.raw[-self.window:]) / len(self.raw[-self.window:]))
        ys = self.smoothed[-self.window:]
        if len(ys) < 2:
            return False
        n, xm, ym = len(ys), (len(ys) - 1) / 2, sum(ys) / len(ys)
        slope = sum((x - xm) * (y - ym) for x, y in enumerate(ys)) / sum((x - xm) ** 2 for x in range(n))
        if self.tolerance is None:
            self.calibration.append(abs(slope))
            if len(self.calibration) == 3:
                self.tolerance = 0.2 * max(self.calibration)
            return False
        self.low = self.low + 1 if abs(slope) < self.tolerance else 0
        return self.low >= self.window


class LevelRule:
    """The rule after the fix, through the real EgeriaPolicy."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.reset()

    def reset(self) -> None:
        self.policy = EgeriaPolicy(EgeriaConfig(window=self.window, bootstrap_threshold=None))
        self.t = 0

    def observe(self, p: float | None) -> bool:
        self.t += 1
        decision = self.policy.observe(Signals(step=self.t, epoch=0, frozen=0, num_stages=2, lr=0.1, plasticity=p))
        return decision.kind is DecisionKind.FREEZE_NEXT


def _quantized(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().max() / 127
    return torch.round(w / scale) * scale


def scheme_reading(name: str, trajectory: list[torch.Tensor], t: int, snap: int, age: int,
                   g: torch.Generator) -> float | None:
    x = torch.randn(BATCH, D_IN, generator=g)
    a = (x @ trajectory[t].T) * (torch.rand(BATCH, D_OUT, generator=g) > 0.1) / 0.9  # dropout in training

    def p(ref: int) -> float:
        return sp_loss(a, x @ _quantized(trajectory[ref]).T)

    if name == "refresh every W":
        return p(snap)
    if name == "refresh, reading / age":
        return p(snap) / max(1, t - snap)
    if name == "refresh, (p - p0) / age":
        return (p(snap) - p(t)) / max(1, t - snap)
    if name == "constant age 5":
        return p(t - age) if t >= age else None
    if name == "constant age 5, minus age 0":
        return p(t - age) - p(t) if t >= age else None
    if name == "constant age 5, eval vs eval":
        return sp_loss(x @ _quantized(trajectory[t]).T, x @ _quantized(trajectory[t - age]).T) if t >= age else None
    raise ValueError(name)


def _firsts(cell: dict) -> str:
    return " ".join("-" if f is None else str(f) for f in cell["first"]) + f" ({cell['count']})"


def schemes_table(evaluations: int, seeds: int, window: int) -> list[dict]:
    rows = []
    for test, rule in (("slope", SlopeRule(window)), ("level", LevelRule(window))):
        for name in ("refresh every W", "refresh, reading / age", "refresh, (p - p0) / age", "constant age 5",
                     "constant age 5, minus age 0", "constant age 5, eval vs eval"):
            if test == "slope" and name in ("refresh, (p - p0) / age", "constant age 5, eval vs eval"):
                continue
            row = {"scheme": name, "test": test}
            for kind in KINDS:
                firsts, count = [], 0
                for seed in range(seeds):
                    trajectory = Trajectory(kind, seed)
                    weights = [trajectory(t) for t in range(evaluations)]
                    g = torch.Generator().manual_seed(seed + 99)
                    rule.reset()
                    frozen, snap = [], 0
                    for t in range(evaluations):
                        if rule.observe(scheme_reading(name, weights, t, snap, window // 2, g)):
                            frozen.append(t)
                            rule.reset()  # the stage goes on as it was: judge it afresh
                            snap = t
                        elif t - snap >= window:
                            snap = t
                    firsts.append(frozen[0] if frozen else None)
                    count += len(frozen)
                row[kind] = {"first": firsts, "count": count}
            rows.append(row)
            cells = "".join(f"{_firsts(row[k]):<28}" for k in KINDS)
            print(f"{name:<30}{test:<7}{cells}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evaluations", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--window", type=int, default=10, help="Egeria's W")
    parser.add_argument("--schemes", action=argparse.BooleanOptionalAction, default=True,
                        help="print the comparison of reference schemes and tests first")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    if args.schemes:
        print(f"{'scheme':<30}{'test':<7}" + "".join(f"{k + ': first (count)':<28}" for k in KINDS))
        out["schemes"] = schemes_table(args.evaluations, args.seeds, args.window)
        print()
    false_freezes = 0
    for seed in range(args.seeds):
        run = run_controller("drifting", 4, seed, args.evaluations, args.window)
        freezes = [c for c in run["changes"] if c[2] > c[1]]
        false_freezes += len(freezes)
        lows = max((r["numbers"].get("consecutive", 0) for r in run["records"]), default=0)
        print(f"drifting: seed {seed}: {len(freezes)} freezes of 4 stages in {args.evaluations} evaluations "
              f"(longest run of low readings {lows:.0f}); {run['stats'].readings} readings", flush=True)
    delays = []
    for seed in range(args.seeds):
        run = run_controller("converging", 1, seed, args.evaluations, args.window)
        freeze = next((r for r in run["records"] if r["decision"] == "freeze_next"), None)
        if freeze is None:
            print(f"converging: seed {seed}: never frozen in {args.evaluations} evaluations", flush=True)
            delays.append(math.inf)
            continue
        at, threshold = freeze["step"], freeze["threshold"]
        raw, smoothed = expected_drift(run["trajectories"][0], run["stage"], at, freeze["reference_age"],
                                       args.window)
        below = next(s for s, v in enumerate(smoothed) if v is not None and v < threshold)
        below_raw = next(s for s, v in enumerate(raw) if v is not None and v < threshold)
        delays.append(at - below)
        print(f"converging: seed {seed}: drift below T={threshold:.3g} at evaluation {below} (unsmoothed "
              f"{below_raw}), frozen at {at}: delay {at - below} ({at - below_raw} from the unsmoothed drift)",
              flush=True)
    out.update(false_freezes=false_freezes, delays=delays)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    delay = statistics.median(delays)
    print(f"egeria_freeze_delay: median {delay:g}, largest {max(delays):g}, W = {args.window}")
    print(f"figure: egeria_false_freezes = {false_freezes}")
    print(f"figure: egeria_freeze_delay = {delay:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
