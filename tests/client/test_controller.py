"""FreezeController in one process: applying decisions, the optimizer, signals, timeline, checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import actcache_client as ac
from actcache.errors import ConfigError
from actcache_client.engine._frozen import prefix_fingerprints
from actcache_client.freeze import (
    AutoFreezePolicy,
    Decision,
    EgeriaPolicy,
    FreezeController,
    ManualPolicy,
    NoFreezePolicy,
    ReferenceConfig,
    StaticPolicy,
    read_timeline,
)
from actcache_client.freeze.autofreeze import GradNormAccumulator
from actcache_client.freeze.defaults import egeria_eval_every


def staged_cnn(seed: int = 0) -> ac.StagedModel:
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        nn.Flatten(), nn.Linear(32, 5),
    )
    return ac.from_sequential(net, groups=[3, 3, 3, 2])


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        yield torch.arange(8 * i, 8 * i + 8), torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)


def train(cached, opt, ctl, n: int, *, set_to_none: bool = True, seed: int = 1, on_step=None) -> list[float]:
    losses = []
    for ids, x, y in batches(n, seed):
        loss = nn.functional.cross_entropy(cached(ids, x), y)
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        opt.step()
        if ctl is not None:
            ctl.step(loss)
        losses.append(loss.item())
        if on_step is not None:
            on_step(len(losses))
    return losses


def setup(policy, *, eval_every=2, opt="sgd", **kw):
    staged = staged_cnn()
    cached = ac.CachedForward(staged)
    if opt == "sgd":
        optimizer = torch.optim.SGD(staged.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    else:
        optimizer = torch.optim.AdamW(staged.parameters(), lr=1e-2, weight_decay=0.1)
    return staged, cached, optimizer, FreezeController(cached, optimizer, policy, eval_every=eval_every, **kw)


def test_config_is_validated():
    staged = staged_cnn()
    cached = ac.CachedForward(staged)
    opt = torch.optim.SGD(staged.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="eval_every=0"):
        FreezeController(cached, opt, ManualPolicy(), eval_every=0)
    for bad, text in [({"queue_size": 0}, "queue_size"),
                      ({"max_cpu_percent": 0}, "max_cpu_percent"), ({"reference_age": 0}, "reference_age"),
                      ({"max_cpu_percent": "busy"}, "max_cpu_percent"),
                      ({"max_samples": 1}, "max_samples"), ({"threads": 0}, "threads")]:
        with pytest.raises(ConfigError, match=text):
            ReferenceConfig(**bad)


def bare(seed: int = 0):
    staged = staged_cnn(seed)
    cached = ac.CachedForward(staged)
    return staged, cached, torch.optim.SGD(staged.parameters(), lr=0.1)


def not_freezing(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not freezing" in r.getMessage()]


@pytest.mark.parametrize("length", [{"total_steps": 980}, {"steps_per_epoch": 98, "epochs": 10}])
def test_without_a_policy_the_runs_length_gives_the_policy_and_interval(length, caplog):
    staged, cached, opt = bare()
    with FreezeController(cached, opt, **length) as ctl:  # 4 stages
        assert isinstance(ctl.policy, EgeriaPolicy) and ctl.policy.config.freeze_lr_fraction == 0.5
        assert ctl.eval_every == egeria_eval_every(980, 4, 10) == 7 and ctl.total_steps == 980
    assert not_freezing(caplog) == []
    with FreezeController(cached, opt, eval_every=3, total_steps=980) as ctl:
        assert isinstance(ctl.policy, EgeriaPolicy) and ctl.eval_every == 3


def test_a_named_policy_without_eval_every_gets_it_from_the_runs_length():
    staged, cached, opt = bare()
    with FreezeController(cached, opt, EgeriaPolicy(), total_steps=1570) as ctl:
        assert ctl.eval_every == egeria_eval_every(1570, 4, 10)
    with FreezeController(cached, opt, AutoFreezePolicy(), steps_per_epoch=157, epochs=3) as ctl:
        assert ctl.eval_every == 31
    with pytest.raises(ConfigError, match="ManualPolicy needs eval_every"):
        FreezeController(cached, opt, ManualPolicy(), total_steps=100)
    with pytest.raises(ConfigError, match="pass both"):
        FreezeController(cached, opt, epochs=3)


@pytest.mark.parametrize(("length", "why"), [({"total_steps": 40}, "40 steps is too short"),
                                             ({}, "length is unknown")])
@pytest.mark.slow
def test_a_run_the_default_cannot_judge_says_so_once_and_never_freezes(length, why, caplog):
    staged, cached, opt = bare()
    with caplog.at_level("WARNING", logger="actcache_client.freeze"):
        with FreezeController(cached, opt, **length) as ctl:
            assert isinstance(ctl.policy, NoFreezePolicy)
            train(cached, opt, ctl, 40)
            assert ctl.frozen == 0 and ctl.changes == [] and ctl.evaluations <= 1
            assert all(p.requires_grad for p in staged.parameters())
    messages = not_freezing(caplog)
    assert len(messages) == 1 and why in messages[0]
    assert ("pass a policy and eval_every" if length else "total_steps=N") in messages[0]


def test_a_schedule_freezes_at_its_step_in_one_go_and_writes_the_timeline(tmp_path):
    path = tmp_path / "timeline.jsonl"
    staged, cached, opt, ctl = setup(StaticPolicy(stages=2, at_step=4), timeline=str(path))
    train(cached, opt, ctl, 3)
    assert ctl.frozen == 0
    train(cached, opt, ctl, 1)
    assert ctl.frozen == cached.frozen == 2 and ctl.changes == [(4, 0, 2)]
    staged.train()
    for i, stage in enumerate(staged.stages):
        assert all(p.requires_grad == (i >= 2) for p in stage.parameters())
    cached(torch.arange(2), torch.randn(2, 3, 8, 8))  # the forward puts frozen stages back in eval mode
    assert [s.training for s in staged.stages] == [False, False, True, True]
    ctl.close()
    records = read_timeline(path)
    assert [r["step"] for r in records] == [2, 4, 4, 4]  # observed again after each freeze
    assert [r["decision"] for r in records] == ["none", "freeze_next", "freeze_next", "none"]
    counts = staged.param_counts()
    assert records[-1]["frozen"] == 2
    assert records[-1]["active_param_share"] == pytest.approx(sum(counts[2:]) / sum(counts))
    assert records[1]["frozen"] == 1 and records[0]["active_param_share"] == 1.0
    assert {"step", "epoch", "stage", "signal", "smoothed", "threshold", "decision", "lr", "active_param_share",
            "rewrap_s", "reference_age"} <= set(records[0])
    assert records == ctl.timeline.records


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_a_freeze_keeps_active_optimizer_state_and_frozen_params_never_move(kind):
    policy = ManualPolicy()
    staged, cached, opt, ctl = setup(policy, opt=kind)
    train(cached, opt, ctl, 4)
    frozen_params = list(staged.stages[0].parameters()) + list(staged.stages[1].parameters())
    active = [p for s in list(staged.stages)[2:] for p in s.parameters()]
    before = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in active}
    state_objects = {id(p): opt.state[p] for p in active}
    policy.request_freeze(2)
    train(cached, opt, ctl, 2, seed=5)  # step 6 is an evaluation: it freezes 2 stages
    assert ctl.frozen == 2
    # At the freeze itself nothing touched the optimizer: same state objects, same values as after step 6's update.
    after_freeze = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in active}
    assert all(opt.state[p] is state_objects[id(p)] for p in active)
    assert len(opt.param_groups) == 1 and len(opt.param_groups[0]["params"]) == len(list(staged.parameters()))
    assert all(p.grad is None for p in frozen_params)
    frozen_values = [p.detach().clone() for p in frozen_params]
    frozen_state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in frozen_params]
    # Even with zero_grad(set_to_none=False), momentum and weight decay cannot move frozen parameters.
    train(cached, opt, ctl, 4, set_to_none=False, seed=7)
    assert all(torch.equal(p, v) for p, v in zip(frozen_params, frozen_values))
    for p, saved in zip(frozen_params, frozen_state):
        assert all(torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v
                   for k, v in saved.items())
    assert all(not torch.equal(opt.state[p][k], after_freeze[id(p)][k]) for p in active[:1]
               for k, v in after_freeze[id(p)].items() if torch.is_tensor(v) and v.numel() > 1)
    assert before  # active state existed before the freeze and was carried on, not rebuilt


def test_active_state_is_bit_identical_across_the_freeze_step():
    policy = ManualPolicy()
    staged, cached, opt, ctl = setup(policy, opt="adamw", eval_every=1, hook_optimizer=True)
    train(cached, opt, ctl, 3)
    active = [p for s in list(staged.stages)[1:] for p in s.parameters()]
    saved = [{k: v.clone() for k, v in opt.state[p].items()} for p in active]
    policy.request_freeze(1)
    ctl.step(torch.tensor(1.0))  # an evaluation with no optimizer step in between: only the freeze happens
    assert ctl.frozen == 1
    for p, state in zip(active, saved):
        assert opt.state[p].keys() == state.keys()
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())


@pytest.mark.slow
def test_unfreeze_restores_training_mode_and_gradients():
    policy = ManualPolicy()
    staged, cached, opt, ctl = setup(policy)
    policy.request_freeze(3)
    train(cached, opt, ctl, 2)
    assert ctl.frozen == 3
    fingerprint = cached.fingerprint(2)
    policy.request_unfreeze()
    staged.train()
    train(cached, opt, ctl, 2)
    assert ctl.frozen == 0 and ctl.changes == [(2, 0, 3), (4, 3, 0)]
    assert all(p.requires_grad for p in staged.parameters())
    assert all(s.training for s in staged.stages)
    train(cached, opt, ctl, 1)
    assert all(p.grad is not None for p in staged.stages[0].parameters())
    assert prefix_fingerprints(list(staged.stages), 2)[2] != fingerprint  # weights moved


def test_autofreeze_gets_the_l1_norm_of_each_stage_gradient_summed_over_the_interval():
    seen = []

    class Spy(AutoFreezePolicy):
        def observe(self, signals):
            seen.append(signals)
            return super().observe(signals)

    staged, cached, opt, ctl = setup(Spy(), eval_every=3)
    sums = [None] * 4

    def add_grads(_step):
        for i, stage in enumerate(staged.stages):
            g = torch.cat([p.grad.flatten() for p in stage.parameters() if p.grad is not None])
            sums[i] = g.clone() if sums[i] is None else sums[i] + g

    opt.register_step_post_hook(lambda *_: add_grads(0))
    train(cached, opt, ctl, 3)
    assert len(seen) == 1 and seen[0].loss is None and seen[0].plasticity is None
    assert seen[0].grad_norms == pytest.approx([float(s.abs().sum()) for s in sums], rel=1e-5)  # as AutoFreeze's code


def test_grad_norm_accumulator_counts_shared_parameters_once_and_frozen_stages_as_nan():
    shared = nn.Linear(2, 2)
    acc = GradNormAccumulator([shared, nn.Sequential(shared), nn.Linear(2, 1)])
    assert acc.norms() is None
    for p in acc._active:
        p.grad = torch.ones_like(p)
    acc.add()
    acc.add()
    norms = acc.norms()
    assert norms[0] == norms[1] == pytest.approx(2 * 6) and norms[2] == pytest.approx(2 * 3)
    acc.set_frozen(1)
    acc.add()
    assert math.isnan(acc.norms()[0])


def test_missing_gradient_sums_and_broken_policies_are_reported():
    staged, cached, opt, ctl = setup(AutoFreezePolicy(), hook_optimizer=False)
    with pytest.raises(RuntimeError, match="after_backward"):
        train(cached, opt, ctl, 2)

    class Skipper(ManualPolicy):
        def observe(self, signals):
            return Decision.freeze(signals.frozen + 1, "skips a stage")

    staged, cached, opt, ctl = setup(Skipper())
    with pytest.raises(RuntimeError, match="only stage 0 may freeze"):
        train(cached, opt, ctl, 2)


def test_state_round_trip_resumes_the_frozen_prefix_and_policy(tmp_path):
    policy = ManualPolicy()
    staged, cached, opt, ctl = setup(policy)
    policy.request_freeze(3)  # one observation freezes all three (the re-observe loop); none stay pending
    train(cached, opt, ctl, 4)
    policy.request_freeze(1)
    state = json.loads(json.dumps(ctl.state_dict()))
    assert state["frozen"] == 3 and state["step"] == 4 and state["policy"]["pending_freezes"] == 1
    weights = {k: v.clone() for k, v in staged.state_dict().items()}

    resumed_policy = ManualPolicy()
    staged2, cached2, opt2, ctl2 = setup(resumed_policy)
    with pytest.raises(ConfigError, match="load the model's state_dict"):
        ctl2.load_state_dict(state)  # fresh weights: another fingerprint
    staged2.load_state_dict(weights)
    staged3, cached3, opt3, ctl3 = setup(resumed_policy)
    staged3.load_state_dict(weights)
    ctl3.load_state_dict(state)
    assert ctl3.frozen == cached3.frozen == 3 and cached3.fingerprint() == cached.fingerprint()
    assert ctl3.step_count == 4 and ctl3.changes == ctl.changes
    assert all(not p.requires_grad for s in list(staged3.stages)[:3] for p in s.parameters())
    assert ctl3.state_dict()["policy"] == state["policy"]
    with pytest.raises(ConfigError, match="version"):
        ctl3.load_state_dict({**state, "version": 99})


@pytest.mark.slow
def test_plasticity_policies_start_the_reference_process_when_bootstrapping_ends():
    from actcache_client.freeze import EgeriaConfig, EgeriaPolicy, ReferenceState

    # bootstrap_steps=2: every interval of 2 steps is a span of its own, Egeria's rule as in the paper
    staged, cached, opt, ctl = setup(EgeriaPolicy(EgeriaConfig(bootstrap_steps=2)),
                                     reference=ReferenceConfig(max_cpu_percent=None))
    losses = [8.0, 4.0, 2.0, 1.0, 0.5, 0.25, 0.24]  # halving: bootstrapping until the last 4% change
    with ctl:
        for step, loss in enumerate(losses, start=1):
            ctl.step(loss)  # eval_every=2: evaluations see the interval means 6, 1.5, 0.375 then (0.24)
            if step < 6:
                assert ctl.policy.bootstrapping and ctl._probe.worker.state is ReferenceState.NEW
        assert ctl.policy.bootstrapping  # 0.375 -> no evaluation yet at step 7
        ctl.step(0.23)  # step 8: mean 0.235 vs 0.375: still 37%
        for loss in (0.22, 0.22):
            ctl.step(loss)  # step 10: mean 0.22 vs 0.235: 6% < 10%
        assert not ctl.policy.bootstrapping
        assert ctl._probe.worker.state is ReferenceState.RUNNING and ctl.reference_stats.snapshots == 1
        reasons = [r["reason"] for r in ctl.timeline.records]
        assert all(r.startswith("bootstrapping") for r in reasons) and reasons[-1].startswith("bootstrapping ended")
    assert ctl._probe.worker.state is ReferenceState.CLOSED


def test_cost_model_decisions_go_into_the_timeline_with_their_numbers(tmp_path):
    path = tmp_path / "timeline.jsonl"
    staged = staged_cnn()
    planner = ac.CachePlanner(ac.PlannerConfig(total_epochs=4))
    cached = ac.CachedForward(staged, planner=planner)
    opt = torch.optim.SGD(staged.parameters(), lr=0.1)
    ctl = FreezeController(cached, opt, StaticPolicy(stages=2, at_step=2), eval_every=2, timeline=str(path))
    train(cached, opt, ctl, 4)
    ctl.close()
    assert ctl._record_plan not in planner.listeners  # closing detaches the controller
    plans = [r for r in read_timeline(path) if r["event"] == "plan"]
    assert plans, "the planner decided for frozen depth 2 but nothing reached the timeline"
    assert all(p["frozen"] == 2 and p["mode"] in ("cache", "recompute") for p in plans)
    assert plans[-1]["reason"] == planner.current.reason
    assert plans[-1]["expected_step_s"] == pytest.approx(planner.current.expected_step_s)
    assert {"cache_depth", "cached_fraction", "baseline_step_s", "numbers", "step", "epoch"} <= set(plans[-1])


class DropoutStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 12)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x):
        return self.dropout(self.linear(x))


@pytest.mark.slow
def test_plasticity_compares_snapshots_of_constant_age_in_eval_mode(monkeypatch):
    # A snapshot at every evaluation; the probe on the step after evaluation k is read against snapshots
    # k - age and k. With the weights held still the two are the same weights, so the reading is exactly 0
    # although dropout is active in the training forward (the reading does not use it); when the stage
    # moves, the reading is what it changed over `age` evaluations.
    from actcache_client.freeze import EgeriaConfig, EgeriaPolicy
    from actcache_client.freeze.reference import ReferenceWorker

    poll = ReferenceWorker.poll

    def answered(self, wait_s=0.0):  # each evaluation waits for the probe in flight: one reading per evaluation
        out = poll(self, wait_s=wait_s)
        while self.stats.in_flight and self.state.value == "running":
            out += poll(self, wait_s=60.0)
        return out

    monkeypatch.setattr(ReferenceWorker, "poll", answered)
    torch.manual_seed(0)
    stage = DropoutStage()
    staged = ac.from_sequential(nn.Sequential(stage, nn.Linear(12, 3)))
    cached = ac.CachedForward(staged)
    opt = torch.optim.SGD(staged.parameters(), lr=0.0)
    policy = EgeriaPolicy(EgeriaConfig(window=6, bootstrap_threshold=None, tolerance_fraction=1e-9))
    g = torch.Generator().manual_seed(2)
    with FreezeController(cached, opt, policy, eval_every=2, reference=ReferenceConfig()) as ctl:
        def steps(n, move):
            for _ in range(n):
                loss = cached(torch.arange(16), torch.randn(16, 12, generator=g)).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if move:
                    with torch.no_grad():
                        stage.linear.weight.add_(0.05 * torch.ones(12, 12))
                ctl.step(loss)

        steps(20, move=False)
        def read():
            return [r for r in ctl.timeline.records if r["event"] == "evaluation" and r["plasticity"] is not None]

        still = read()
        steps(30, move=True)
        moving = read()[len(still):]
    assert ctl.reference_stats.snapshots == ctl.evaluations  # one per evaluation once the reference runs
    first = min(r["step"] for r in still)
    assert first == 2 * (3 + 1) + 2  # snapshots at evaluations 1..4 (age 3: W / 2), probe at step 9, read at 10
    assert all(r["reference_age"] == 3 for r in still + moving)
    assert still and all(r["plasticity"] == 0.0 for r in still)
    late = [r["plasticity"] for r in moving if r["step"] > 20 + 2 * 2 * 3 + 2]  # both snapshots moving ones
    assert len(late) >= 5 and all(p > 0 for p in late)
