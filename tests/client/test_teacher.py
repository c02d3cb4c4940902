"""Tests for actcache_client.engine._teacher without a daemon: outputs, layouts, keys, top-k targets, the KD loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import actcache_client as ac
from actcache.errors import ConfigError
from actcache_client.bert import BertConfig, BertForSequenceClassification


def teacher_net(classes: int = 10) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, classes))


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(3)
    return BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=32,
                                                    max_position_embeddings=16, num_labels=3))


def test_without_a_connection_the_teacher_runs_frozen_in_eval_mode():
    net = teacher_net()
    teacher = ac.CachedTeacher(net, None)
    net.train()  # a user's train() must not turn the teacher's dropout back on
    x = torch.randn(6, 8)
    out = teacher(list(range(6)), x)
    assert not any(p.requires_grad for p in net.parameters())
    assert not out.logits.requires_grad and out.top_values is None and out.hidden == {} and out.mask is None
    with torch.no_grad():
        assert torch.equal(out.logits, net.eval()(x))
    assert not teacher.enabled and teacher.times.computed_samples == 6


def test_top_k_keeps_the_k_largest_logits_with_their_classes():
    net = teacher_net()
    out = ac.CachedTeacher(net, None, top_k=3)(list(range(5)), torch.randn(5, 8))
    assert out.logits is None and out.top_values.shape == (5, 3) and out.top_indices.dtype == torch.int64
    assert (out.top_values[:, :-1] >= out.top_values[:, 1:]).all()


def test_text_outputs_are_per_token_with_zero_padding_and_the_mask():
    bert = tiny_bert()
    teacher = ac.CachedTeacher(bert, None, outputs=("bert.encoder.layer.1", "logits"), top_k=2, varlen=ac.VarLen())
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    ids = torch.randint(1, 50, (2, 4)) * mask
    out = teacher([0, 1], (ids, mask))
    hidden = out.hidden["bert.encoder.layer.1"]
    assert hidden.shape == (2, 4, 16) and torch.equal(out.mask, mask)
    assert not hidden[1, 2:].any() and hidden[1, :2].abs().sum() > 0
    with torch.no_grad():
        reference = bert.eval()(ids, mask).topk(2, dim=-1)
    assert torch.equal(out.top_values, reference.values) and torch.equal(out.top_indices, reference.indices)


def test_the_key_covers_the_weights_and_the_outputs():
    net = teacher_net()
    plain = ac.CachedTeacher(net, None).weights_fingerprint()
    assert ac.CachedTeacher(net, None, top_k=4).weights_fingerprint() != plain
    assert ac.CachedTeacher(net, None, outputs=("logits", "1")).weights_fingerprint() != plain
    assert ac.CachedTeacher(net, None).weights_fingerprint() == plain
    with torch.no_grad():
        net[3].bias[0] += 1e-6
    assert ac.CachedTeacher(net, None).weights_fingerprint() != plain


def test_weights_changed_before_use_rekey_and_after_use_stop_the_cache():
    net = teacher_net()
    teacher = ac.CachedTeacher(net, None)
    before = teacher.weights_fingerprint()
    with torch.no_grad():
        net[0].weight.mul_(2)  # a checkpoint loaded after wrapping: nothing was served or stored yet
    assert teacher.check_weights() and teacher.weights_fingerprint() != before
    teacher(list(range(4)), torch.randn(4, 8))
    assert teacher.check_weights()
    with torch.no_grad():
        net[0].weight.mul_(0.5)
    with pytest.warns(ac.MovingTeacherWarning):
        assert not teacher.check_weights()
    assert teacher.moved and not teacher.check_weights()  # warned once


def test_topk_soft_targets_are_the_softmax_renormalised_over_the_top_k():
    logits = torch.randn(3, 7)
    top = logits.topk(3, dim=-1)
    target = ac.topk_soft_targets(top.values, top.indices, 7, temperature=2.0)
    torch.testing.assert_close(target.sum(-1), torch.ones(3))
    full = F.softmax(logits / 2.0, dim=-1)
    kept = torch.zeros_like(full).scatter_(-1, top.indices, full.gather(-1, top.indices))
    torch.testing.assert_close(target, kept / kept.sum(-1, keepdim=True))
    assert (target > 0).sum() == 9
    out = ac.TeacherOutput(top_values=top.values, top_indices=top.indices)
    torch.testing.assert_close(out.soft_targets(2.0, num_classes=7), target)
    with pytest.raises(ConfigError, match="num_classes"):
        out.soft_targets(2.0)


def test_distillation_loss_is_hintons_and_top_k_of_all_classes_is_the_full_loss():
    student, teacher = torch.randn(4, 6), torch.randn(4, 6)
    expected = F.kl_div(F.log_softmax(student / 3, -1), F.softmax(teacher / 3, -1), reduction="batchmean") * 9
    torch.testing.assert_close(ac.distillation_loss(student, teacher, temperature=3.0), expected)
    torch.testing.assert_close(ac.distillation_loss(student, ac.TeacherOutput(logits=teacher), 3.0), expected)
    top = teacher.topk(6, dim=-1)
    full_k = ac.TeacherOutput(top_values=top.values, top_indices=top.indices)
    torch.testing.assert_close(ac.distillation_loss(student, full_k, 3.0), expected)
    # top-k: KL from the renormalised top-k target, which is what the dense rebuilt target gives
    top = teacher.topk(2, dim=-1)
    p = ac.topk_soft_targets(top.values, top.indices, 6, 3.0)
    dense = (p * (p.clamp_min(1e-30).log() - F.log_softmax(student / 3, -1))).sum(-1).mean() * 9
    torch.testing.assert_close(ac.distillation_loss(student, ac.TeacherOutput(top_values=top.values,
                                                                            top_indices=top.indices), 3.0), dense)
    assert ac.distillation_loss(student, teacher, reduction="none").shape == (4,)


@pytest.mark.parametrize("options, match", [
    ({"outputs": ("logits", "no.such.layer")}, "submodule"),
    ({"outputs": ("0",), "top_k": 3}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"token_logits": True}, "varlen"),
    ({"outputs": ()}, "distinct"),
])
def test_bad_arguments_say_what_is_wrong(options, match):
    with pytest.raises(ConfigError, match=match):
        ac.CachedTeacher(teacher_net(), None, **options)


def test_a_per_token_output_of_the_wrong_shape_is_refused():
    bert = tiny_bert()
    teacher = ac.CachedTeacher(bert, None, outputs=("bert.pooler",), varlen=ac.VarLen())
    mask = torch.ones(2, 4, dtype=torch.int64)
    with pytest.raises(ConfigError, match="per-token"):
        teacher([0, 1], (torch.randint(1, 50, (2, 4)), mask))
