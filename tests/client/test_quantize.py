"""The reference stage at each precision: it builds, runs close to fp32, and reports its measured speed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import actcache_client as ac
from actcache_client.freeze import PRECISIONS, build_reference, sp_loss
from actcache_client.freeze.quantize import linear_heavy
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
    assert set(conv.ms_per_batch) == {"static_int8", "fp32", "bf16"}
    assert conv.precision in conv.ms_per_batch
    if conv.precision != "static_int8":  # chosen only when int8 was slower here: the note says so
        assert any("slower than fp32" in n for n in conv.notes)
    lin = build_reference(linear_stage(), "auto", torch.randn(16, 32), repeats=1)
    assert set(lin.ms_per_batch) == {"dynamic_int8", "fp32"}
    with torch.no_grad():
        assert sp_loss(lin.run(torch.ones(4, 32)), linear_stage()(torch.ones(4, 32))) < 1e-3


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
