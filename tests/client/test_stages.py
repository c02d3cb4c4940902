"""Tests for actcache_client.layouts._stages (and the ResNet-20 in actcache_client.models)."""

from __future__ import annotations

import itertools
import math
import random
from collections import OrderedDict

import pytest
import torch
from torch import Tensor, nn

from actcache.errors import ConfigError
from actcache_client import models
from actcache_client.layouts import _stages as stages
from actcache_client.layouts._stages import Stage, StagedModel, auto_partition, from_bert, from_resnet, from_sequential
from actcache_client.models import BasicBlock, resnet20
from tests.client.tiny_bert import TinyBertForSequenceClassification, TinyBertModel, TinyFlatBert

# ---------------------------------------------------------------- helpers


def _same(a: object, b: object) -> bool:
    """Bit-identical tensors or tuples of tensors."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return False


def _check_shared(model: nn.Module, staged: StagedModel) -> None:
    """The staged model holds exactly the original's parameters and buffers, not copies."""
    staged_params = list(staged.parameters())
    assert len(staged_params) == len(list(model.parameters()))
    assert {id(p) for p in staged_params} == {id(p) for p in model.parameters()}
    assert {id(b) for b in staged.buffers()} == {id(b) for b in model.buffers()}
    assert sum(staged.param_counts()) == sum(p.numel() for p in model.parameters())


def _check_identical(model: nn.Module, staged: StagedModel, *inputs: Tensor) -> None:
    """Eval and train mode (seeded, so dropout draws match) give bit-identical outputs."""
    state = inputs[0] if len(inputs) == 1 else tuple(inputs)
    for train in (False, True):
        model.train(train)
        torch.manual_seed(123)
        expected = model(*inputs)
        torch.manual_seed(123)
        assert _same(staged(state), expected), f"train={train}"
    model.eval()
    expected = model(*inputs)
    for k in range(staged.num_stages + 1):  # every split point, as the cache uses it
        assert _same(staged.run(staged.run(state, 0, k), k), expected), f"split at {k}"


class _Params(nn.Module):
    """A stage with exactly ``n`` parameter elements."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(n)) if n else None

    def forward(self, x: Tensor) -> Tensor:
        return x if self.p is None else x * self.p.mean()


def _synthetic(counts: list[int]) -> StagedModel:
    return StagedModel(Stage(f"s{i}", _Params(n)) for i, n in enumerate(counts))


# ---------------------------------------------------------------- tiny BERT (HF attribute layout)


def _bert_inputs() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (4, 10), generator=g)
    mask = torch.ones(4, 10, dtype=torch.long)
    mask[1, 6:] = 0
    mask[3, 3:] = 0
    return ids * mask, mask


# ---------------------------------------------------------------- public surface


@pytest.mark.parametrize("module", [stages, models])
def test_all_is_sorted_and_exported(module: object) -> None:
    names = module.__all__  # type: ignore[attr-defined]
    assert names == sorted(names)
    assert all(hasattr(module, n) for n in names)


# ---------------------------------------------------------------- Stage / StagedModel


def test_staged_model_basics_and_run_slices() -> None:
    staged = StagedModel([Stage("double", _Params(0)), Stage("a", _Params(3)), Stage("b", _Params(5))])
    assert staged.num_stages == 3
    assert staged.stage_names == ["double", "a", "b"]
    assert staged.param_counts() == [0, 3, 5]
    x = torch.arange(4.0)
    with torch.no_grad():
        staged.stages[1].module.p.fill_(2.0)
        staged.stages[2].module.p.fill_(3.0)
    assert torch.equal(staged(x), x * 6)
    assert torch.equal(staged.run(x, 1, 2), x * 2)
    assert staged.run(x, 2, 2) is x
    assert torch.equal(staged.run(staged.run(x, 0, 2), 2), staged(x))
    assert "name='a'" in repr(staged)


@pytest.mark.parametrize(("start", "stop"), [(-1, 2), (2, 1), (0, 4)])
def test_run_rejects_bad_ranges(start: int, stop: int) -> None:
    staged = _synthetic([1, 1, 1])
    with pytest.raises(ValueError, match=r"0 <= start <= stop <= 3"):
        staged.run(torch.ones(1), start, stop)


def test_staged_model_validation() -> None:
    with pytest.raises(ValueError, match="at least one stage"):
        StagedModel([])
    with pytest.raises(ValueError, match=r"not a Stage; wrap it as Stage\(name, module\)"):
        StagedModel([nn.ReLU()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"repeated: \['x'\]"):
        StagedModel([Stage("x", nn.ReLU()), Stage("x", nn.ReLU())])
    with pytest.raises(ValueError, match="non-empty str"):
        Stage("", nn.ReLU())
    with pytest.raises(ValueError, match="must be an nn.Module"):
        Stage("f", torch.relu)  # type: ignore[arg-type]


# ---------------------------------------------------------------- from_sequential


def _seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(8, 16), bn=nn.BatchNorm1d(16), act=nn.ReLU(), drop=nn.Dropout(0.5), fc2=nn.Linear(16, 4)
        )
    )


def test_from_sequential_identical_and_shared() -> None:
    seq = _seq()
    staged = from_sequential(seq)
    assert staged.stage_names == ["fc1", "bn", "act", "drop", "fc2"]
    assert staged.param_counts() == [144, 32, 0, 0, 68]
    _check_shared(seq, staged)
    _check_identical(seq, staged, torch.randn(6, 8))


def test_from_sequential_groups() -> None:
    seq = _seq()
    staged = from_sequential(seq, groups=[2, 1, 2])
    assert staged.stage_names == ["fc1..bn", "act", "drop..fc2"]
    assert staged.param_counts() == [176, 0, 68]
    _check_shared(seq, staged)
    _check_identical(seq, staged, torch.randn(6, 8))
    assert from_sequential(nn.Sequential(nn.ReLU(), nn.Tanh())).stage_names == ["0", "1"]


@pytest.mark.parametrize("groups", [[2, 2], [5, 1], [0, 5], [2.5, 2.5]])
def test_from_sequential_rejects_bad_groups(groups: list[int]) -> None:
    with pytest.raises(ValueError, match="positive ints summing to 5"):
        from_sequential(_seq(), groups=groups)


def test_from_sequential_rejects_non_sequential() -> None:
    with pytest.raises(ValueError, match=r"expects an nn.Sequential, got Linear; use from_resnet"):
        from_sequential(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty nn.Sequential"):
        from_sequential(nn.Sequential())


# ---------------------------------------------------------------- ResNet


def test_resnet20_shape_and_size() -> None:
    model = resnet20()
    assert sum(p.numel() for p in model.parameters()) == 269_722  # the paper's 0.27 M
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert resnet20(num_classes=100, shortcut="B")(torch.randn(1, 3, 32, 32)).shape == (1, 100)
    with pytest.raises(ValueError, match="shortcut must be 'A'"):
        resnet20(shortcut="C")  # type: ignore[arg-type]


@pytest.mark.parametrize("shortcut", ["A", "B"])
@pytest.mark.slow
def test_from_resnet_cifar_identical_and_shared(shortcut: str) -> None:
    torch.manual_seed(0)
    model = resnet20(shortcut=shortcut)  # type: ignore[arg-type]
    staged = from_resnet(model)
    blocks = [f"layer{i}.{j}" for i in (1, 2, 3) for j in range(3)]
    assert staged.stage_names == ["stem", *blocks, "head"]
    assert staged.stages[0].module[0] is model.conv1 and len(staged.stages[0].module) == 3  # no maxpool
    assert staged.stages[4].module is model.layer2[0]
    _check_shared(model, staged)
    _check_identical(model, staged, torch.randn(4, 3, 32, 32))


class _TvResNet(nn.Module):
    """torchvision layout: 7x7 stem with maxpool, layer1..layer4."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False)
        self.bn1, self.relu, self.maxpool = nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(8, 8, shortcut="B"), BasicBlock(8, 8, shortcut="B"))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2, shortcut="B"))
        self.layer3 = nn.Sequential(BasicBlock(16, 32, 2, shortcut="B"))
        self.layer4 = nn.Sequential(BasicBlock(32, 64, 2, shortcut="B"))
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d((1, 1)), nn.Linear(64, 5)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


@pytest.mark.slow
def test_from_resnet_torchvision_layout() -> None:
    torch.manual_seed(0)
    model = _TvResNet()
    staged = from_resnet(model)
    assert staged.stage_names == ["stem", "layer1.0", "layer1.1", "layer2.0", "layer3.0", "layer4.0", "head"]
    assert staged.stages[0].module[3] is model.maxpool
    _check_shared(model, staged)
    _check_identical(model, staged, torch.randn(2, 3, 48, 48))


@pytest.mark.slow
def test_parameters_are_shared_not_copied() -> None:
    torch.manual_seed(0)
    model = resnet20().eval()
    staged = from_resnet(model)
    x = torch.randn(2, 3, 32, 32)
    before = staged(x)
    with torch.no_grad():
        model.fc.bias.add_(1.0)
        model.conv1.weight.mul_(2.0)
    after = staged(x)
    assert not torch.equal(before, after)
    assert torch.equal(after, model(x))
    staged.train()
    assert model.layer3[2].bn2.training and model.bn1.training  # mode changes reach the original submodules
    staged(x).sum().backward()
    assert model.conv1.weight.grad is not None and model.fc.weight.grad is not None


class _NoLayers(nn.Module):
    def __init__(self, with_relu: bool = True, layer1: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        if with_relu:
            self.relu = nn.ReLU()
        if layer1 is not None:
            self.layer1 = layer1


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (nn.Sequential(nn.ReLU()), "model has no attribute 'conv1'"),
        (_NoLayers(with_relu=False), "model has no attribute 'relu'"),
        (_NoLayers(), "model has no attribute 'layer1'; expected a torchvision-style ResNet"),
        (_NoLayers(layer1=nn.ModuleList([nn.ReLU()])), "model.layer1 is a ModuleList; expected a non-empty"),
        (_NoLayers(layer1=nn.Sequential(nn.ReLU())), "model has no attribute 'avgpool'"),
    ],
)
def test_from_resnet_rejects_other_models(model: nn.Module, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        from_resnet(model)
    assert "pass an nn.Sequential or build stages with StagedModel([...])" in str(info.value)


# ---------------------------------------------------------------- BERT


@pytest.mark.slow
def test_from_bert_hf_layout_identical_and_shared() -> None:
    torch.manual_seed(0)
    model = TinyBertForSequenceClassification()
    staged = from_bert(model)
    assert staged.stage_names == ["embeddings", "encoder.layer.0", "encoder.layer.1", "encoder.layer.2", "head"]
    _check_shared(model, staged)
    ids, mask = _bert_inputs()
    _check_identical(model, staged, ids, mask)
    model.eval()
    hidden, carried = staged.run((ids, mask), 0, 2)  # the state a cache would store
    assert hidden.shape == (4, 10, 16) and carried is mask
    assert staged.run((hidden, carried), 2).shape == (4, 3)


@pytest.mark.slow
def test_from_bert_flat_layout_and_tensor_layers() -> None:
    torch.manual_seed(0)
    model = TinyFlatBert()
    staged = from_bert(model)
    assert staged.stage_names == ["embeddings", "encoder.layer.0", "encoder.layer.1", "head"]
    assert staged.stages[-1].module.dropout is None
    _check_shared(model, staged)
    ids, mask = _bert_inputs()
    _check_identical(model, staged, ids, mask)
    model.eval()
    assert torch.equal(staged(ids), model(ids, torch.ones_like(ids)))  # bare ids: all-ones mask
    with torch.no_grad():
        model.encoder.layer[1].out.weight.zero_()
    assert torch.equal(staged((ids, mask)), model(ids, mask))


@pytest.mark.parametrize("make", [TinyBertForSequenceClassification, TinyFlatBert])
@pytest.mark.slow
def test_from_bert_sentence_pairs_match_the_model(make) -> None:
    """(input_ids, attention_mask, token_type_ids): segment 1 reaches the embeddings, at every split point."""
    torch.manual_seed(0)
    model = make()
    staged = from_bert(model)
    ids, mask = _bert_inputs()
    types = torch.zeros_like(ids)
    types[:, 4:] = mask[:, 4:]  # the second sentence of each pair starts at token 4
    _check_identical(model, staged, ids, mask, types)
    model.eval()
    assert not torch.equal(staged((ids, mask, types)), staged((ids, mask)))  # the segments count
    assert torch.equal(staged((ids, mask, torch.zeros_like(ids))), staged((ids, mask)))
    hidden, carried = staged.run((ids, mask, types), 0, 1)  # what a cache stores: the mask, not the types
    assert hidden.shape == (4, 10, 16) and carried is mask
    with pytest.raises(ConfigError, match="token_type_ids"):
        staged((ids, mask, types, types))


def test_from_bert_rejects_other_models() -> None:
    broken = TinyFlatBert()
    broken.encoder = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"no attribute 'encoder.layer'; expected an HF-style BERT"):
        from_bert(broken)
    with pytest.raises(ValueError, match="no attribute 'classifier'"):
        from_bert(TinyBertModel())
    empty = TinyFlatBert()
    empty.encoder.layer = nn.ModuleList()
    with pytest.raises(ValueError, match="expected a non-empty nn.ModuleList"):
        from_bert(empty)
    with pytest.raises(ValueError, match="no attribute 'embeddings'"):
        from_bert(resnet20())


# ---------------------------------------------------------------- auto_partition


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"target_params": 20}, ["s0..s2", "s3", "s4..s5", "s6"]),  # 100 alone; zero-param s1, s5 join
        ({"max_stages": 2}, ["s0..s3", "s4..s6"]),  # largest group 110 is optimal for 2 groups
        ({"max_stages": 3}, ["s0..s3", "s4..s5", "s6"]),
        ({"max_stages": 1}, ["s0..s6"]),
        ({"max_stages": 2, "target_params": 20}, ["s0..s3", "s4..s6"]),  # target raised to fit max_stages
        ({"max_stages": 9, "target_params": 1}, ["s0..s1", "s2", "s3", "s4..s5", "s6"]),
    ],
)
def test_auto_partition_rule(kwargs: dict[str, int], names: list[str]) -> None:
    staged = _synthetic([10, 0, 10, 10, 100, 0, 10])
    assert auto_partition(staged, **kwargs).stage_names == names


def test_auto_partition_leading_param_free_stages_join_first_group() -> None:
    assert auto_partition(_synthetic([0, 0, 5, 5]), target_params=5).stage_names == ["s0..s2", "s3"]
    assert auto_partition(_synthetic([0, 0]), max_stages=2).stage_names == ["s0..s1"]


def _best_max_load(counts: list[int], k: int) -> int:
    n = len(counts)
    best = sum(counts)
    for g in range(1, min(k, n) + 1):
        for cuts in itertools.combinations(range(1, n), g - 1):
            bounds = [0, *cuts, n]
            best = min(best, max(sum(counts[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_auto_partition_max_stages_minimises_largest_group() -> None:
    rng = random.Random(0)
    for _ in range(60):
        counts = [rng.choice([0, 1, 3, 8, 20, 50]) for _ in range(rng.randint(1, 7))]
        k = rng.randint(1, 5)
        staged = _synthetic(counts)
        merged = auto_partition(staged, max_stages=k)
        loads = merged.param_counts()
        assert merged.num_stages <= k and sum(loads) == sum(counts)
        assert max(loads) == _best_max_load(counts, k), (counts, k, loads)
        flat = [n for name in merged.stage_names for n in name.split("..")]
        assert flat == sorted(flat, key=lambda s: int(s[1:]))  # order kept


@pytest.mark.slow
def test_auto_partition_resnet_and_bert_identical_and_shared() -> None:
    torch.manual_seed(0)
    model = resnet20()
    fine = from_resnet(model)
    coarse = auto_partition(fine, max_stages=4)
    assert coarse.num_stages <= 4
    assert coarse.stage_names[0].startswith("stem") and coarse.stage_names[-1].endswith("head")
    assert max(coarse.param_counts()) <= math.ceil(sum(fine.param_counts()) / 4) + max(fine.param_counts())
    _check_shared(model, coarse)
    _check_identical(model, coarse, torch.randn(2, 3, 32, 32))
    assert auto_partition(coarse, max_stages=2).stage_names == ["stem..layer3.0", "layer3.1..head"]

    bert = TinyBertForSequenceClassification()
    staged = auto_partition(from_bert(bert), max_stages=3)
    assert staged.num_stages == 3
    _check_shared(bert, staged)
    _check_identical(bert, staged, *_bert_inputs())


def test_auto_partition_validation() -> None:
    staged = _synthetic([1, 2])
    with pytest.raises(ValueError, match="needs max_stages or target_params"):
        auto_partition(staged)
    with pytest.raises(ValueError, match="max_stages must be >= 1, got 0"):
        auto_partition(staged, max_stages=0)
    with pytest.raises(ValueError, match="target_params must be >= 1 parameter, got -5"):
        auto_partition(staged, target_params=-5)
