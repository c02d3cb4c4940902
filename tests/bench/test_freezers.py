"""The controller modes (AutoFreeze, Egeria) through the real trainer and a real daemon, on tiny generated workloads."""

import collections
import dataclasses
import uuid

import pytest
import torch
from workloads.freezers import (
    AutoFreeze,
    AutoPolicy,
    EgeriaFreeze,
    NoFreeze,
    StaticFreeze,
    autofreeze_eval_every,
    egeria_eval_every,
    make_freezer,
)
from workloads.report import format_decisions
from workloads.tasks import cifar, step_schedule
from workloads.trainer import RunResult, TrainingRun, train

import actcache_client as ac
from actcache.errors import ConfigError
from actcache_client.freeze import AutoFreezeConfig, EgeriaConfig, ReferenceConfig
from actcache_client.freeze.reference import ReferenceWorker
from actcache_client.models import CifarResNet
from tests.bench.fake_data import make_data_dir
from tests.bench.test_workloads import check_real, run_bench_train

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One torch thread, as bench_train --threads 1: with two on a shared 2-core machine a step took 10-30x longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_cifar(data_dir, epochs: int):
    """ResNet-20 on 48 generated images, 3 steps per epoch, without augmentation: every epoch reads the same entries."""
    return dataclasses.replace(cifar(data_dir, epochs=epochs, batch_size=16, eval_size=16), augment=None, variants=None)


def check_times(run: RunResult) -> None:
    """The split's parts are disjoint intervals of the run's training clock, which is part of its wall clock."""
    split = run.split_s
    assert split["other"] >= -1e-6, split
    assert sum(v for k, v in split.items() if k not in ("other", "eval")) <= run.train_s + 1e-6
    assert 0 < split["eval"] and run.train_s + split["eval"] == pytest.approx(run.wall_s)


def check_decisions(run: RunResult, mode: str) -> list[dict]:
    """Every change of depth in the trainer's timeline is a recorded decision, at the same step."""
    record = run.freezer
    assert record["mode"] == mode and record["evaluations"] >= 1 and record["eval_every"] >= 1
    decisions = record["decisions"]
    depths = [(t["step"], t["frozen"]) for t in run.timeline]
    # the controller may take several decisions in one evaluation (AutoFreeze's loop): the last one counts
    last_per_step = {d["step"]: d["frozen"] for d in decisions}
    assert depths[0] == (0, 0) and depths[1:] == sorted(last_per_step.items())
    assert record["final_frozen"] == run.timeline[-1]["frozen"] == run.evals[-1].frozen
    assert len(record["trace"]) >= record["evaluations"]  # AutoFreeze may judge several stages per evaluation
    assert [(t["step"], t["frozen"]) for t in record["trace"] if t["reason"] in {d["reason"] for d in decisions}] \
        == [(d["step"], d["frozen"]) for d in decisions]
    for d in decisions:
        assert d["decision"] in ("freeze_next", "unfreeze_all") and d["reason"]
        assert d["epoch"] == pytest.approx(d["step"] / 3) and 0 < d["active_param_share"] <= 1
    return decisions


def test_autofreeze_freezes_the_same_stages_at_the_same_steps_with_and_without_the_cache(data_dir, daemon):
    w = tiny_cifar(data_dir, epochs=6)
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        on = train(w, AutoFreeze(), conn)
    off = train(w, AutoFreeze(), None)
    for run, cached in ((on, True), (off, False)):
        check_real(run, cached=cached)
        check_times(run)
        assert run.freezer["eval_every"] == 1  # 3 steps per epoch / 5 intervals, at least 1
        assert max(t["frozen"] for t in run.timeline) > 0
        assert run.timeline[-1]["active_params"] < run.timeline[0]["total_params"]
    decisions = check_decisions(on, "autofreeze")
    assert decisions and all(d["decision"] == "freeze_next" for d in decisions)  # AutoFreeze never unfreezes
    assert decisions == check_decisions(off, "autofreeze")  # gradients are the same: so are the decisions
    assert [p.loss for p in on.evals] == pytest.approx([p.loss for p in off.evals], abs=1e-4)
    assert on.cache_stats["hits"] > 0 == off.cache_stats["hits"]
    assert off.split_s["prefix"] > 0 and off.split_s["fetch_wait"] == 0 < on.split_s["fetch_wait"]
    assert "autofreeze+cache: " in format_decisions([on]) and "freeze stage 0 (stem..layer2.0)" in format_decisions([on])


def test_egeria_freezes_on_plasticity_unfreezes_on_the_lr_drop_and_the_cache_serves_the_prefix(
        data_dir, daemon, monkeypatch):
    # Egeria never waits for its reference process; here an evaluation with a probe in flight waits for
    # the answer (up to 60 s), so the outcome depends on the policy and not on how fast a process spawns
    # on a loaded machine. The tolerance is one that any slope meets (4 readings per stage: 1 to start the
    # window, 1 to calibrate, W=2 below it): this checks the wiring, the paper's rule has its own tests.
    poll = ReferenceWorker.poll
    monkeypatch.setattr(ReferenceWorker, "poll",
                        lambda self, wait_s=0.0: poll(self, wait_s=60.0 if self.stats.in_flight else wait_s))
    w = dataclasses.replace(tiny_cifar(data_dir, epochs=10), schedule=step_schedule((0.7,)))  # lr x0.1 at step 21
    config = EgeriaConfig(window=2, tolerance_readings=1, tolerance_fraction=1e9, bootstrap_threshold=None)
    freezer = EgeriaFreeze(config, eval_every=2)
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        run = train(w, freezer, conn, slice_steps=2)  # the run without the cache is the same trainer path
    check_real(run, cached=True)
    check_times(run)
    decisions = check_decisions(run, "egeria")
    assert decisions[0]["decision"] == "freeze_next" and decisions[0]["stage"] == 0
    # the lr the scheduler set reaches the policy: everything unfreezes at the first evaluation after the drop
    unfreezes = [d for d in decisions if d["decision"] == "unfreeze_all"]
    assert [(d["step"], d["frozen"], d["lr"]) for d in unfreezes] == [(22, 0, pytest.approx(0.01))]
    assert run.freezer["policy"] == "EgeriaPolicy"
    assert run.freezer["settings"]["reference"]["max_cpu_percent"] is None
    stats = run.freezer["reference_stats"]
    assert stats["readings"] >= 4 and stats["skipped_busy"] == 0 and stats["builds"]
    assert run.cache_stats["hits"] > 0 and run.split_s["fetch_wait"] > 0
    assert freezer.close() is freezer.close() is run.freezer  # closed once by the trainer; the record stays
    assert "egeria+cache: " in format_decisions([run]) and "unfreeze all" in format_decisions([run])


def test_bench_train_runs_a_controller_mode_and_records_its_decisions(data_dir, tmp_path, capsys):
    out, result = run_bench_train("autofreeze", ["--epochs", "4", "--train-size", "48", "--eval-size", "16"],
                                  data_dir, tmp_path, capsys)
    assert [r["run"] for r in result["summary"]] == ["full", "autofreeze+cache", "autofreeze+nocache"]
    full, cached, uncached = result["runs"]
    assert full["freezer"] == {"mode": "full"} and "decisions" not in full["freezer"]
    for run in (cached, uncached):  # 1 step per epoch: one evaluation per step
        record = run["freezer"]
        assert record["eval_every"] == 1 and record["settings"] == {"percentile": 50.0, "intervals_per_epoch": 5,
                                                                 "embedding_stages": 0}
        assert record["policy"] == "AutoFreezePolicy" and record["evaluations"] == 3  # the last step is not judged
        assert [[t["step"], t["frozen"]] for t in run["timeline"][1:]] == sorted(
            [d["step"], d["frozen"]] for d in {d["step"]: d for d in record["decisions"]}.values())
    assert cached["freezer"]["decisions"] == uncached["freezer"]["decisions"]
    assert f"autofreeze+cache: {len(cached['freezer']['decisions'])} freeze decision(s)" in out


def test_make_freezer_gives_each_mode_its_defaults():
    assert isinstance(make_freezer("full", static_depth=1, static_at_epoch=0), NoFreeze)
    assert isinstance(make_freezer("static", static_depth=2, static_at_epoch=1), StaticFreeze)
    auto = make_freezer("autofreeze", static_depth=1, static_at_epoch=0)
    assert isinstance(auto, AutoFreeze) and auto.config == AutoFreezeConfig() and auto.eval_every is None
    egeria = make_freezer("egeria", static_depth=1, static_at_epoch=0, eval_every=7)
    assert isinstance(egeria, EgeriaFreeze) and egeria.config == EgeriaConfig() and egeria.eval_every == 7
    assert egeria.reference_config == ReferenceConfig()  # max_cpu_percent "auto": None for a trainer on the CPU
    with pytest.raises(ConfigError, match="eval_every=0 must be a positive number of steps"):
        make_freezer("egeria", static_depth=1, static_at_epoch=0, eval_every=0)
    with pytest.raises(ValueError, match="unknown mode 'slow'"):
        make_freezer("slow", static_depth=1, static_at_epoch=0)


def test_default_intervals_for_the_workloads_at_their_default_sizes():
    # (steps per epoch, epochs, stages): cifar 20,000/128 x 10, ResNet-20 in 6 balanced stages; digits 1,437/64
    # x 30 (--quick: 10); sst2 8,000/32 x 2 and cola 6,000/32 x 3, MiniLM in 8 stages (embeddings, 6 layers, head)
    assert egeria_eval_every(157 * 10, 6, 10) == 7 and autofreeze_eval_every(157, 5) == 31
    assert egeria_eval_every(23 * 30, 6, 10) == 3 and egeria_eval_every(23 * 10, 6, 10) == 1
    assert egeria_eval_every(250 * 2, 8, 10) == 2 and autofreeze_eval_every(250, 5) == 50
    assert egeria_eval_every(188 * 3, 8, 10) == 2 and autofreeze_eval_every(188, 5) == 37
    assert egeria_eval_every(16 * 4, 6, 10) == 1 and autofreeze_eval_every(3, 5) == 1  # --quick and tiny runs


def test_a_controller_freezer_drives_one_run_and_needs_start(data_dir):
    w = tiny_cifar(data_dir, epochs=1)
    freezer = AutoFreeze()
    with pytest.raises(RuntimeError, match="start"):
        freezer.before_step(None, None)
    run = TrainingRun(w, freezer, None, max_steps=1)
    with pytest.raises(RuntimeError, match="make one per run"):
        TrainingRun(w, freezer, None)
    collections.deque(run.slices(), maxlen=0)  # run every slice
    assert run.result.freezer["evaluations"] == 0 and run.result.freezer["decisions"] == []


def test_auto_mode_is_the_controllers_default_for_the_runs_length():
    for total, policy in ((30, "NoFreezePolicy"), (980, "EgeriaPolicy")):  # 5 stages: 613 steps at least
        staged = ac.from_resnet(CifarResNet(1, 10))
        freezer = make_freezer("auto", static_depth=1, static_at_epoch=0)
        assert isinstance(freezer, AutoPolicy)
        freezer.start(ac.CachedForward(staged), torch.optim.SGD(staged.parameters(), lr=0.1), steps_per_epoch=10,
                      total_steps=total)
        record = freezer.close()
        assert record["policy"] == policy == record["settings"]["policy"]
        assert record["eval_every"] == (total if total == 30 else egeria_eval_every(total, staged.num_stages, 10))


def test_autofreeze_judges_bert_embeddings_with_the_first_block():
    from tests.client.tiny_bert import TinyBertForSequenceClassification

    for staged, expected in ((ac.from_bert(TinyBertForSequenceClassification(n_layers=2)), 1),
                             (ac.from_resnet(CifarResNet(1, 10)), 0)):
        freezer = AutoFreeze()
        model = ac.CachedForward(staged)
        freezer.start(model, torch.optim.SGD(staged.parameters(), lr=0.1), steps_per_epoch=3, total_steps=9)
        assert freezer.config.embedding_stages == expected
        assert freezer.controller.policy.config.embedding_stages == expected
        assert freezer.settings()["embedding_stages"] == expected
        freezer.close()
    explicit = AutoFreeze(AutoFreezeConfig(percentile=25))  # an explicit configuration is used as given
    staged = ac.from_bert(TinyBertForSequenceClassification(n_layers=2))
    explicit.start(ac.CachedForward(staged), torch.optim.SGD(staged.parameters(), lr=0.1), steps_per_epoch=3,
                   total_steps=9)
    assert explicit.config.embedding_stages == 0
