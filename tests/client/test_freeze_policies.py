"""Freeze policies: the shared contract, Egeria, AutoFreeze, static/manual, and the SP loss."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch

import actcache_client.freeze as freeze
from actcache.errors import ConfigError
from actcache_client.freeze import (
    AutoFreezeConfig,
    AutoFreezePolicy,
    Decision,
    DecisionKind,
    EgeriaConfig,
    EgeriaPolicy,
    FreezeMilestone,
    ManualPolicy,
    Signals,
    StaticPolicy,
    check_freeze_policy_contract,
    sp_loss,
)

FREEZE, NONE, UNFREEZE = DecisionKind.FREEZE_NEXT, DecisionKind.NONE, DecisionKind.UNFREEZE_ALL


def sig(step: int, *, frozen: int = 0, num_stages: int = 4, lr: float = 0.1, epoch: int = 0, **kw) -> Signals:
    return Signals(step=step, epoch=epoch, frozen=frozen, num_stages=num_stages, lr=lr, **kw)


def decay(i: int) -> float:
    """A converging plasticity curve: fast early change, flattening out."""
    return math.exp(-i / 8) + 0.05


def plateau(i: int) -> float:
    """Converging, but a plateau (i ~ 12..20) precedes a second descent: the counter resets once."""
    return math.exp(-i / 4) + 0.05 + (0.3 if i < 20 else 0.3 * math.exp(-(i - 20) / 3))


def expected_freeze_index(series: list[float], window: int, fraction: float = 0.2, readings: int = 3) -> int:
    """Egeria §4.2.2 computed independently with numpy: the index of the W-th consecutive low slope."""
    p = np.asarray(series)
    smoothed = np.array([p[max(0, i - window + 1): i + 1].mean() for i in range(len(p))])
    slopes = {i: np.polyfit(np.arange(min(window, i + 1)), smoothed[max(0, i - window + 1): i + 1], 1)[0]
              for i in range(1, len(p))}
    tolerance = fraction * max(abs(slopes[i]) for i in range(1, readings + 1))
    run = 0
    for i in range(readings + 1, len(p)):
        run = run + 1 if abs(slopes[i]) < tolerance else 0
        if run == window:
            return i
    raise AssertionError("the series never freezes")


def feed(policy, stream_fn, n: int):
    """Drive a policy, applying its decisions; return [(index, decision, frozen_before)]."""
    frozen, out = 0, []
    for i in range(n):
        decision = policy.observe(stream_fn(i, frozen))
        out.append((i, decision, frozen))
        if decision.kind is FREEZE:
            frozen += 1
        elif decision.kind is UNFREEZE:
            frozen = 0
    return out


# ---------------------------------------------------------------- public surface and shared types

def test_all_is_sorted_and_importable():
    assert freeze.__all__ == sorted(freeze.__all__)
    assert all(hasattr(freeze, name) for name in freeze.__all__)


def test_signals_and_decision_validate():
    with pytest.raises(ValueError, match="head stage always trains"):
        sig(0, frozen=4, num_stages=4)
    with pytest.raises(ValueError, match="one per stage"):
        sig(0, grad_norms=[1.0, 2.0])
    assert sig(0, grad_norms=[1, 2, 3, 4]).grad_norms == (1.0, 2.0, 3.0, 4.0)
    s = sig(0, lr=np.float32(0.5), loss=torch.tensor(2.0), plasticity=np.float64(0.25))
    assert (type(s.lr), type(s.loss), type(s.plasticity)) == (float, float, float)
    with pytest.raises(ValueError):
        Decision(FREEZE, None, "no stage")
    with pytest.raises(ValueError):
        Decision(UNFREEZE, 2, "stage given")


class _Skipper:
    needs = frozenset()

    def observe(self, signals):
        return Decision.freeze(signals.frozen + 1, "skips")

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        """Nothing to restore: the policy keeps no state."""


class _Forgetful(_Skipper):
    def __init__(self):
        self.calls = 0

    def observe(self, signals):
        self.calls += 1
        return Decision.none("call", {"calls": float(self.calls)})


class _HeadFreezer(_Skipper):
    def observe(self, signals):
        return Decision.freeze(signals.frozen, "greedy")


@pytest.mark.parametrize(("factory", "message"), [
    (_Skipper, "only the frontmost active stage"),
    (_HeadFreezer, "the head always trains"),
    (_Forgetful, "state_dict round trip"),
])
def test_contract_catches_broken_policies(factory, message):
    with pytest.raises(AssertionError, match=message):
        check_freeze_policy_contract(factory, [sig(i) for i in range(10)])


# ---------------------------------------------------------------- contract for every policy

def egeria_stream(n: int = 160) -> list[Signals]:
    losses = [4.0, 2.0, 1.2, 1.1]  # relative changes 50%, 40%, 8%: bootstrapping ends at index 3
    out = []
    for i in range(n):
        lr = 0.1 if i < 110 else 0.01  # a 10x step decay -> UNFREEZE_ALL
        plasticity = math.exp(-(i % 30) / 2) + 0.05  # a fast-converging curve, restarting every 30
        out.append(sig(i, lr=lr, loss=losses[min(i, 3)] - 0.001 * i, plasticity=plasticity))
    return out


def autofreeze_stream(n: int = 40) -> list[Signals]:
    rng = random.Random(7)
    out = []
    for t in range(n):  # every step twice: the repeat is the "call again" after a freeze
        norms = [1 + (4 - s) * math.exp(-t / (1 + 2 * s)) + rng.uniform(0, 0.01) for s in range(4)]
        out += [sig(t, grad_norms=norms), sig(t, grad_norms=norms)]
    return out


def manual_pokes(policy: ManualPolicy, index: int) -> None:
    if index in (2, 9, 14):
        policy.request_freeze(2 if index == 9 else 1)
    if index == 20:
        policy.request_unfreeze()
    if index == 25:
        policy.request_freeze(5)  # more than can be frozen: the excess is dropped at the head


@pytest.mark.parametrize(("name", "factory", "stream", "poke"), [
    ("egeria", lambda: EgeriaPolicy(), egeria_stream(), None),
    ("egeria-nobootstrap", lambda: EgeriaPolicy(EgeriaConfig(bootstrap_threshold=None, window=4)),
     egeria_stream(), None),
    ("autofreeze", lambda: AutoFreezePolicy(), autofreeze_stream(), None),
    ("static", lambda: StaticPolicy([FreezeMilestone(stages=1, at_step=5), FreezeMilestone(stages=3, at_epoch=2)]),
     [sig(i, epoch=i // 10) for i in range(40)], None),
    ("manual", ManualPolicy, [sig(i) for i in range(40)], manual_pokes),
])
def test_policy_contract(name, factory, stream, poke):
    decisions = check_freeze_policy_contract(factory, stream, before_observe=poke, snapshot_at=range(len(stream)))
    assert any(d.kind is FREEZE for d in decisions), f"{name}: the contract run froze nothing"
    if name in ("egeria", "manual"):  # freezes, unfreezes and refreezes across the snapshot
        kinds = [d.kind for d in decisions if d.kind is not NONE]
        assert UNFREEZE in kinds and FREEZE in kinds[kinds.index(UNFREEZE):]


# ---------------------------------------------------------------- Egeria

def test_egeria_config_defaults_and_validation():
    c = EgeriaConfig()
    assert (c.window, c.tolerance_fraction, c.tolerance_readings) == (10, 0.2, 3)
    assert (c.bootstrap_threshold, c.unfreeze_lr_factor, c.min_window) == (0.1, 10.0, 2)
    for bad, text in [({"window": 1}, "window=1"), ({"min_window": 1}, "min_window=1"),
                      ({"tolerance_fraction": 0}, "tolerance_fraction"), ({"bootstrap_threshold": 1.5}, "None"),
                      ({"unfreeze_lr_factor": 1.0}, "must be > 1"), ({"tolerance_readings": 0}, "uses 3")]:
        with pytest.raises(ConfigError, match=text):
            EgeriaConfig(**bad)
    with pytest.raises(TypeError):
        EgeriaConfig(10)  # keyword-only


@pytest.mark.parametrize("curve", [decay, plateau])
def test_egeria_freezes_after_exactly_w_low_slope_evaluations(curve):
    window, n = 10, 80
    losses = [4.0, 2.0, 1.2, 1.1]  # bootstrapping ends at index 3 (8.3% < 10%); readings start at 4
    start = 4
    expected = start + expected_freeze_index([curve(i) for i in range(n)], window)
    assert expected > start + 1 + 3 + window  # not the earliest possible freeze
    policy = EgeriaPolicy(EgeriaConfig(window=window))
    run = feed(policy, lambda i, f: sig(i, frozen=f, loss=losses[min(i, 3)],
                                         plasticity=curve(i - start) if i >= start else 9.0), expected + 1)
    assert [i for i, d, _ in run if d.kind is not NONE] == [expected]
    assert not policy.bootstrapping
    last = run[expected][1]
    assert last.stage == 0 and last.numbers["consecutive"] == window and last.numbers["window"] == window
    assert abs(last.numbers["slope"]) < last.numbers["threshold"]
    assert run[expected - 1][1].numbers["consecutive"] == window - 1
    assert {"slope", "threshold", "smoothed", "consecutive", "window"} <= set(last.numbers)
    counts = [d.numbers.get("consecutive", 0) for _, d, _ in run]
    resets = sum(1 for before, now in zip(counts, counts[1:]) if before > 0 and now == 0)
    assert resets == (1 if curve is plateau else 0)


def test_egeria_freezes_stages_in_order_with_fresh_readings_and_never_the_head():
    window = 6
    per_stage = expected_freeze_index([decay(i) for i in range(200)], window) + 1  # evaluations per stage
    since = {"stage": 0, "i": 0}

    def stream(i, frozen):
        if frozen != since["stage"]:
            since.update(stage=frozen, i=i)
        return sig(i, frozen=frozen, plasticity=decay(i - since["i"]))

    run = feed(EgeriaPolicy(EgeriaConfig(window=window, bootstrap_threshold=None)), stream, 5 * per_stage)
    frozen_at = [(i, d.stage) for i, d, _ in run if d.kind is FREEZE]
    assert frozen_at == [(per_stage - 1, 0), (2 * per_stage - 1, 1), (3 * per_stage - 1, 2)]
    assert run[-1][1].reason == "only the head is active; it always trains"


def test_egeria_stays_unfrozen_while_bootstrapping_despite_flat_plasticity():
    # Flat noisy plasticity looks converged, but the loss still falls >= 10% per interval: the
    # critical period (§3, §4.2.2), so no stage may freeze; once the loss settles, freezing may
    # start, but no earlier than 1 collecting + 3 calibrating + W low-slope readings later.
    rng = random.Random(1234)
    policy = EgeriaPolicy()
    settle = 60  # the loss falls 15% per interval up to here, then 1%

    def loss(i):
        return 100 * 0.85 ** min(i, settle) * 0.99 ** max(0, i - settle)

    run = feed(policy, lambda i, f: sig(i, frozen=f, loss=loss(i), plasticity=0.5 + rng.gauss(0, 0.05)), 200)
    assert all(d.kind is NONE and d.reason.startswith("bootstrapping") for i, d, _ in run[: settle + 1])
    ended = [i for i, d, _ in run if d.reason.startswith("bootstrapping ended")]
    assert ended == [settle + 1]
    first_freeze = next(i for i, d, _ in run if d.kind is FREEZE)
    assert first_freeze >= settle + 1 + 1 + 3 + 10


@pytest.mark.parametrize("seed", range(5))
def test_egeria_never_freezes_a_stage_still_drifting(seed):
    # Plasticity falling at a constant rate with noise: the fitted slope stays near its early
    # magnitude (the cumulative mean of a line has half its slope, so T ~ 0.1 x rate), far above T.
    rng = random.Random(seed)
    run = feed(EgeriaPolicy(EgeriaConfig(bootstrap_threshold=None)),
               lambda i, f: sig(i, frozen=f, plasticity=1.0 - 0.002 * i + rng.gauss(0, 0.002)), 400)
    assert all(d.kind is NONE for _, d, _ in run)
    assert max(d.numbers.get("consecutive", 0) for _, d, _ in run) == 0


def test_egeria_unfreezes_on_10x_lr_drop_and_refreezes_with_half_window():
    policy = EgeriaPolicy(EgeriaConfig(bootstrap_threshold=None))
    t0 = expected_freeze_index([decay(i) for i in range(100)], 10)
    lrs = {"lr": 0.1}
    run = feed(policy, lambda i, f: sig(i, frozen=f, lr=lrs["lr"], plasticity=decay(i)), t0 + 5)
    assert [(i, d.kind) for i, d, _ in run if d.kind is not NONE] == [(t0, FREEZE)]
    assert policy.observe(sig(t0 + 5, frozen=1, lr=0.0101, plasticity=0.5)).kind is NONE  # 9.9x: not yet
    dropped = policy.observe(sig(t0 + 6, frozen=1, lr=0.1 * 0.1, plasticity=0.5))  # 0.010000000000000002
    assert dropped.kind is UNFREEZE and dropped.numbers["lr_at_freeze"] == 0.1
    assert policy.window == 5
    # Stage 0 keeps its tolerance; a flat converged curve refreezes after 1 collecting + 5 low readings.
    refrozen = [policy.observe(sig(100 + k, frozen=0, lr=0.01, plasticity=0.05 + 1e-9 * k)) for k in range(6)]
    assert [d.kind for d in refrozen] == [NONE] * 5 + [FREEZE]
    assert refrozen[-1].numbers["window"] == 5 and refrozen[-1].numbers["consecutive"] == 5
    # The next unfreeze is measured from the refreeze lr; W halves to the floor of 2 and stays there.
    assert policy.observe(sig(110, frozen=1, lr=0.002)).kind is NONE
    assert policy.observe(sig(111, frozen=1, lr=0.001)).kind is UNFREEZE and policy.window == 2
    policy.observe(sig(112, frozen=1, lr=0.001))  # frozen by other means: anchors lr_at_freeze here
    assert policy.observe(sig(113, frozen=1, lr=0.0001)).kind is UNFREEZE and policy.window == 2


def test_egeria_schedule_restart_reanchors_the_lr():
    def frozen_policy():
        policy = EgeriaPolicy(EgeriaConfig(bootstrap_threshold=None))
        policy.observe(sig(0, frozen=1, lr=0.1))  # anchors lr_at_freeze = 0.1
        return policy

    plain = frozen_policy()
    assert plain.observe(sig(1, frozen=1, lr=0.01)).kind is UNFREEZE
    restarted = frozen_policy()
    restarted.on_schedule_restart()
    assert restarted.observe(sig(1, frozen=1, lr=0.05)).kind is NONE  # new anchor 0.05
    assert restarted.observe(sig(2, frozen=1, lr=0.01)).kind is NONE  # only 5x below
    assert restarted.observe(sig(3, frozen=1, lr=0.005)).kind is UNFREEZE


def test_egeria_needs_loss_while_bootstrapping_and_skips_missing_plasticity():
    with pytest.raises(ValueError, match="bootstrap_threshold=None"):
        EgeriaPolicy().observe(sig(0))
    policy = EgeriaPolicy()
    reasons = [policy.observe(sig(i, loss=x)).reason for i, x in enumerate([2.0, math.nan, 1.95])]
    assert reasons[1].startswith("bootstrapping: non-finite") and reasons[2].startswith("bootstrapping ended")
    assert EgeriaPolicy().needs == {"plasticity", "loss"}
    policy = EgeriaPolicy(EgeriaConfig(bootstrap_threshold=None))
    assert policy.needs == {"plasticity"}
    for p in (None, math.nan, math.inf):
        assert policy.observe(sig(0, plasticity=p)).reason.startswith("no usable plasticity")
    assert policy.state_dict()["raw"] == []


# ---------------------------------------------------------------- AutoFreeze

def test_autofreeze_freezes_stabilising_front_stages_in_order():
    policy = AutoFreezePolicy()
    frozen = 0

    def step(t, norms):
        nonlocal frozen
        kinds = []
        while True:  # Algorithm 1's loop: call again at the same step after each freeze
            d = policy.observe(sig(t, frozen=frozen, grad_norms=norms))
            kinds.append((d.kind, d.stage))
            if d.kind is not FREEZE:
                return kinds
            frozen += 1

    assert step(0, [10, 10, 10, 10]) == [(NONE, None)]  # no previous interval
    assert step(1, [5, 6, 7, 8]) == [(NONE, None)]  # eta .5 .4 .3 .2, median .35: stage 0 moves fastest
    assert step(2, [5, 4, 5, 6]) == [(FREEZE, 0), (NONE, None)]  # eta 0 .33 .29 .25, median .27
    assert step(3, [0, 4, 3, 3]) == [(FREEZE, 1), (NONE, None)]  # eta 0 .4 .5 over stages 1-3, median .4
    assert step(4, [0, 0, 3.1, 6]) == [(FREEZE, 2), (NONE, None)]  # the head never freezes
    assert frozen == 3


def test_autofreeze_never_skips_and_can_freeze_several_in_one_interval():
    policy = AutoFreezePolicy()
    policy.observe(sig(0, grad_norms=[1, 1, 1, 1]))
    d = policy.observe(sig(1, grad_norms=[0.1, 1, 1, 0.5]))  # eta .9 0 0 .5: stage 1 is stillest
    assert d.kind is NONE and d.numbers == {"eta": 0.9, "threshold": 0.25, "percentile": 50.0}
    policy = AutoFreezePolicy()
    policy.observe(sig(0, grad_norms=[1, 1, 1, 1]))
    assert policy.observe(sig(1, grad_norms=[0.99, 0.98, 0.5, 0.4])).stage == 0
    assert policy.observe(sig(1, frozen=1)).stage == 1  # same interval: same threshold, no new norms needed
    assert policy.observe(sig(1, frozen=2)).kind is NONE


def test_autofreeze_config_and_needs():
    assert AutoFreezeConfig() == AutoFreezeConfig(percentile=50.0, intervals_per_epoch=5)
    with pytest.raises(ConfigError, match="median"):
        AutoFreezeConfig(percentile=0)
    with pytest.raises(ValueError, match="grad_norms"):
        AutoFreezePolicy().observe(sig(0))
    policy = AutoFreezePolicy()
    policy.observe(sig(0, grad_norms=[0, 1, math.nan, 1]))
    d = policy.observe(sig(1, grad_norms=[0, 1.5, 1, 2]))  # 0 -> 0 is no change; nan is no reading
    assert d.kind is FREEZE and d.numbers["eta"] == 0.0


# ---------------------------------------------------------------- static and manual

def test_static_policy_freezes_stage_by_stage_once_due():
    policy = StaticPolicy(stages=3, at_epoch=1)
    assert policy.observe(sig(5, epoch=0)).kind is NONE
    assert [policy.observe(sig(9, epoch=1, frozen=f)).stage for f in range(4)] == [0, 1, 2, None]
    with pytest.raises(ConfigError, match="at most 3"):
        StaticPolicy(stages=4, at_step=0).observe(sig(0))
    with pytest.raises(ConfigError, match="exactly one"):
        FreezeMilestone(stages=1, at_step=1, at_epoch=1)
    with pytest.raises(ConfigError, match="needs a milestone"):
        StaticPolicy()


def test_manual_policy_serves_requests_one_stage_at_a_time():
    policy = ManualPolicy()
    assert policy.observe(sig(0)).kind is NONE
    policy.request_freeze(2)
    assert [policy.observe(sig(1, frozen=f)).stage for f in (0, 1, 2)] == [0, 1, None]
    policy.request_freeze()
    policy.request_unfreeze()
    assert policy.observe(sig(2, frozen=2)).kind is UNFREEZE
    assert policy.observe(sig(3, frozen=0)).kind is NONE


# ---------------------------------------------------------------- SP loss

def test_sp_loss_matches_the_formula_on_a_hand_example():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # G_a = I
    b = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # G_b rows = (1, 1) / sqrt(2)
    assert sp_loss(a, b) == pytest.approx(1 - math.sqrt(2) / 2, rel=1e-12)


def test_sp_loss_zero_positive_bounded_and_invariant():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 3, 4, 4, generator=g)
    b = torch.randn(8, 3, 4, 4, generator=g)
    assert sp_loss(a, a) == 0.0
    loss = sp_loss(a, b)
    assert 0 < loss <= 4 / 8  # unit rows: ||G_a - G_b||_F^2 <= 4b
    assert sp_loss(3.0 * a, 0.25 * b) == pytest.approx(loss, rel=1e-6)  # global scale cancels (float32 input)
    flat = a.reshape(8, -1)
    rotation, _ = torch.linalg.qr(torch.randn(48, 48, generator=g, dtype=torch.float64))
    assert sp_loss(flat[:, torch.randperm(48, generator=g)], a) == pytest.approx(0, abs=1e-12)
    assert sp_loss((flat.double() @ rotation), a) == pytest.approx(0, abs=1e-12)
    assert sp_loss(a, torch.randn(8, 10, generator=g)) > 0  # only the 8 x 8 similarities are compared
    assert sp_loss((a, torch.ones(8, 5)), a) == 0.0  # tuple state: the first tensor
    with pytest.raises(ValueError, match="batch sizes 8 and 4"):
        sp_loss(a, b[:4])


def test_sp_loss_reacts_to_per_sample_rescaling():
    # Only a global scale cancels: rescaling one sample changes the similarity pattern.
    a = torch.randn(6, 20, generator=torch.Generator().manual_seed(3)).abs()
    b = a.clone()
    b[0] *= 10
    assert sp_loss(a, b) > 1e-4


def test_signals_replace_keeps_validation():
    with pytest.raises(ValueError):
        dataclasses.replace(sig(0), frozen=-1)
