"""The reference stage at each precision: it builds, runs close to fp32, and reports its measured speed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import actcache_client as ac
from actcache_client.freeze import PRECISIONS, build_reference, sp_loss
from actcache_client.freeze import quantize
from actcache_client.freeze.quantize import AUTO_MARGIN, RESOLUTION_DRIFT, RESOLUTION_FACTOR, linear_heavy, quantizable
from actcache_client.models import resnet20
from tests.client.tiny_bert import TinyBertForSequenceClassification


def conv_stage() -> nn.Module:
    torch.manual_seed(0)
    return ac.from_resnet(resnet20()).stages[1]  # a residual block: conv, BN, ReLU, add


def linear_stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def test_precisions_cover_the_documented_set():
    assert PRECISIONS == ("auto", "dynamic_int8", "static_int8", "fp32", "bf16")
    assert linear_heavy(linear_stage()) and not linear_heavy(conv_stage())


@pytest.mark.parametrize("precision", ["static_int8", "fp32", "bf16"])
def test_conv_stage_at_each_precision_tracks_fp32(precision):
    stage = conv_stage().eval()
    x = torch.randn(8, 16, 8, 8)
    with torch.no_grad():
        expected = stage(x)
    built = build_reference(stage, precision, x, repeats=1)
    assert built.precision == precision
    assert set(built.ms_per_batch) == {precision} and built.ms_per_batch[precision] > 0
    with torch.no_grad():
        out = built.run(x)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert sp_loss(out, expected) < 1e-3 and built.error_vs_fp32[precision] < 1e-3


def test_auto_picks_int8_kind_by_layer_mix_and_reports_every_candidate():
    conv = build_reference(conv_stage(), "auto", torch.randn(8, 16, 8, 8), repeats=1)
    assert set(conv.drift_reading) == {"static_int8", "fp32", "bf16"}
    assert conv.precision in conv.ms_per_batch and "fp32" in conv.ms_per_batch
    lin = build_reference(linear_stage(), "auto", torch.randn(16, 32), repeats=1)
    assert set(lin.drift_reading) == {"dynamic_int8", "fp32"}
    with torch.no_grad():
        assert sp_loss(lin.run(torch.ones(4, 32)), linear_stage()(torch.ones(4, 32))) < 1e-3


def test_auto_keeps_only_candidates_that_read_a_small_drift_as_fp32_does(monkeypatch):
    # int8 rounds every weight again when the largest moves: a 0.1% drift reads 50x higher than in fp32,
    # so int8 is not used even where it runs twice as fast; bf16 reads this random block's drift as fp32
    # does, so it stays a candidate (and is timed).
    monkeypatch.setattr(quantize, "_time", lambda fn, example: 1.0 if fn is stage else 0.5)
    monkeypatch.setattr(quantize, "_build_ms", lambda module, precision, example: 0.0)
    stage = linear_stage()
    lin = build_reference(stage, "auto", torch.randn(16, 32), repeats=2)
    assert lin.precision == "fp32" and set(lin.ms_per_batch) == {"fp32"}
    assert lin.drift_reading["dynamic_int8"] > RESOLUTION_FACTOR * lin.drift_reading["fp32"] > 0
    assert any("dynamic_int8 reads a 0.001 drift" in n and "cannot resolve" in n for n in lin.notes)
    stage = conv_stage()
    conv = build_reference(stage, "auto", torch.randn(8, 16, 8, 8, generator=torch.Generator().manual_seed(1)),
                           repeats=2)
    assert "static_int8" not in conv.ms_per_batch and "bf16" in conv.ms_per_batch
    exact = conv.drift_reading["fp32"]
    assert exact / RESOLUTION_FACTOR <= conv.drift_reading["bf16"] <= exact * RESOLUTION_FACTOR
    assert conv.precision == "bf16"  # resolves the drift, and is (scripted) 2x faster
    assert RESOLUTION_DRIFT == 1e-3


def test_dynamic_int8_on_a_bert_layer_with_a_tuple_state():
    torch.manual_seed(0)
    layer = ac.from_bert(TinyBertForSequenceClassification(n_layers=2)).stages[1].eval()
    state = (torch.randn(4, 7, 16), torch.ones(4, 7, dtype=torch.int64))
    built = build_reference(layer, "dynamic_int8", state, repeats=1)
    hidden, mask = built.run(state)
    assert hidden.shape == (4, 7, 16) and torch.equal(mask, state[1])
    assert sp_loss(hidden, layer(state)[0]) < 1e-3


def test_auto_falls_back_when_int8_cannot_be_built():
    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: FX cannot trace it
                return self.conv(x)
            return self.conv(-x)

    built = build_reference(Untraceable(), "auto", torch.rand(2, 3, 6, 6), repeats=1)
    assert built.precision in ("fp32", "bf16")
    assert any(n.startswith("static_int8 failed") for n in built.notes)
    with pytest.raises(Exception):
        build_reference(Untraceable(), "static_int8", torch.rand(2, 3, 6, 6))
    with pytest.raises(ValueError, match="unknown precision"):
        build_reference(linear_stage(), "int4", torch.randn(2, 32))


def test_auto_gives_stages_without_quantizable_layers_full_precision_untimed_against_int8():
    # The embeddings stage (lookups, LayerNorm, dropout) has no Linear and no conv: static int8 used to be
    # tried (and to fail with a TypeError), then fp32 or bf16 won by timing noise from run to run.
    torch.manual_seed(0)
    embeddings = ac.from_bert(TinyBertForSequenceClassification(n_layers=2)).stages[0].eval()
    state = (torch.randint(0, 50, (4, 7)), torch.ones(4, 7, dtype=torch.int64))
    assert not quantizable(embeddings) and quantizable(linear_stage()) and quantizable(conv_stage())
    for _ in range(3):
        built = build_reference(embeddings, "auto", state, repeats=2)
        assert built.precision == "fp32" and set(built.ms_per_batch) == {"fp32"}
        assert built.notes == ["no Linear or convolution layers to quantize: full precision"]


@pytest.mark.parametrize(("int8_ms", "expected"), [
    ([0.5, 0.5, 0.5, 1.2, 0.5], "fp32"),  # faster by 50% four times, slower once: not a clear win
    ([0.95, 0.92, 0.93, 0.91, 0.95], "fp32"),  # faster every time, by less than 10%
    ([0.85, 0.8, 0.88, 0.7, 0.89], "dynamic_int8"),  # faster by more than 10% in every round
])
def test_auto_keeps_fp32_unless_a_candidate_wins_every_round_by_a_clear_margin(monkeypatch, int8_ms, expected):
    stage = linear_stage()
    x = torch.randn(16, 32)
    timings = {"fp32": iter([1.0] * 5)}
    fp32_run = stage

    def scripted(fn, example):
        return next(timings["fp32"]) if fn is fp32_run else next(timings["int8"])

    timings["int8"] = iter(int8_ms)
    monkeypatch.setattr(quantize, "_time", scripted)
    monkeypatch.setattr(quantize, "_resolve", lambda module, built, outputs, example, notes: {})  # timing alone decides
    monkeypatch.setattr(quantize, "_build_ms", lambda module, precision, example: 0.0)
    built = build_reference(stage, "auto", x, repeats=5)
    assert built.precision == expected and set(built.ms_per_batch) == {"fp32", "dynamic_int8"}
    assert AUTO_MARGIN == 0.10


def test_auto_counts_the_build_a_reading_needs(monkeypatch):
    # Every reading builds the reference of a new snapshot and runs two: a precision that runs 5x faster
    # but takes 200 ms to build (static int8 on a ResNet-20 module) loses to fp32 (50 ms a run).
    monkeypatch.setattr(quantize, "_time", lambda fn, example: runs[id(fn)])  # scripted run times, by built fn
    stage = conv_stage()
    x = torch.randn(8, 16, 8, 8)
    runs: dict = {}
    real_build = quantize._build

    def build(module, precision, example):
        fn = real_build(module, precision, example)
        runs[id(fn)] = {"fp32": 50.0, "static_int8": 10.0, "bf16": 45.0}[precision]
        return fn

    monkeypatch.setattr(quantize, "_build", build)
    monkeypatch.setattr(quantize, "_resolve", lambda module, built, outputs, example, notes: {})  # timing alone decides
    monkeypatch.setattr(quantize, "_build_ms",
                        lambda module, precision, example: {"fp32": 0.0, "static_int8": 200.0, "bf16": 3.0}[precision])
    built = build_reference(stage, "auto", x, repeats=3)
    assert built.precision == "fp32"  # int8: 200 + 2 x 10 = 220 > 100; bf16: 3 + 90 = 93, not 10% cheaper
    assert built.ms_per_build == {"fp32": 0.0, "static_int8": 200.0, "bf16": 3.0}
