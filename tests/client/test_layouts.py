"""The layout registry without a daemon: which family takes which network, registration, the check of a
guess against the network's own forward, the options."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import actcache_client as ac
from actcache.errors import ConfigError
from actcache_client.layouts import (
    Layout,
    check_layout,
    find_layout,
    layout_families,
    register_layout,
    unregister_layout,
)
from actcache_client.models import resnet20
from tests import families

transformers = pytest.importorskip("transformers", reason="the huggingface extra is not installed")


@pytest.mark.parametrize("make, family, names", [
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), "sequential", ["0", "1", "2"]),
    (resnet20, "resnet", ["stem", "layer1.0"]),
    (families.ResNetLike, "resnet-like", ["stem", "layer1.0", "layer1.1", "head"]),
    (families.llama, "transformers-decoder", ["embeddings", "model.layers.0"]),
    (families.qwen2, "transformers-decoder", ["embeddings", "model.layers.0"]),
    (families.roberta, "transformers-bert", ["embeddings", "encoder.layer.0"]),
    (families.distilbert, "transformers-encoder", ["embeddings", "distilbert.transformer.layer.0"]),
    (families.electra, "transformers-encoder", ["embeddings", "electra.encoder.layer.0"]),
    (families.vit, "transformers-vision", ["embeddings", "vit.layers.0"]),
    (families.ClipProbe, "transformers-vision", ["embeddings", "clip.encoder.layers.0"]),
])
def test_each_family_takes_its_networks_by_type(make, family, names):
    layout = find_layout(make())
    assert layout.family == family
    assert layout.stages.stage_names[: len(names)] == names


def test_the_head_owns_every_parameter_no_frozen_stage_holds():
    net = families.llama()
    stages = find_layout(net).stages
    held = {id(p) for stage in stages.stages for p in stage.parameters()}
    assert held == {id(p) for p in net.parameters()}
    assert {id(p) for p in stages.stages[-1].parameters()} == {id(p) for p in net.score.parameters()} | \
        {id(p) for p in net.model.norm.parameters()}


def test_a_users_family_is_consulted_first_and_names_must_be_unique():
    def staged(net: nn.Sequential) -> Layout:
        return Layout(ac.from_sequential(net, groups=[2, 1]))

    register_layout("pairs", nn.Sequential, staged)
    try:
        assert layout_families()[0] == "pairs"
        layout = find_layout(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
        assert layout.family == "pairs" and layout.stages.stage_names == ["0..1", "2"]
        with pytest.raises(ConfigError, match="registered already; pass replace=True"):
            register_layout("pairs", nn.Sequential, staged)
    finally:
        unregister_layout("pairs")
    assert "pairs" not in layout_families() and layout_families()[-2:] == ["resnet-like", "bert-like"]
    with pytest.raises(ConfigError, match="a type, a tuple of types or a predicate"):
        register_layout("bad", "nn.Sequential", staged)


def test_a_network_no_family_takes_names_blocks_and_registration():
    with pytest.raises(ConfigError, match=r"blocks=.*register_layout.*stages=StagedModel"):
        find_layout(nn.Module())


@pytest.mark.slow
def test_the_resnet_like_guess_is_checked_and_the_stage_where_they_part_named():
    net = families.ResNetLike()
    x = torch.randn(4, 3, 8, 8)
    with pytest.raises(ConfigError, match=r"resnet-like layout of a ResNetLike parts from its own forward at stage "
                                          r"'layer1.0' \(layer1.0\)"):
        check_layout(net, find_layout(net), (x, torch.zeros(4)))
    right = resnet20()
    check_layout(right, find_layout(right), (torch.randn(4, 3, 8, 8), torch.zeros(4)))  # a right guess
    assert net.training and net.bn1.running_mean.abs().sum() == 0  # modes and statistics as they were


def test_the_check_leaves_the_random_state_as_it_was():
    net = families.TorchvisionStyleViT()
    layout = ac.layouts.blocks_layout(net, "encoder.layers")
    before = torch.random.get_rng_state()
    check_layout(net, layout, families.images(4)[:])
    assert torch.equal(torch.random.get_rng_state(), before)


def test_blocks_names_a_path_to_a_list_of_blocks():
    net = families.TorchvisionStyleViT()
    with pytest.raises(ConfigError, match=r"no module at 'encoder.blocks'.*pos_embedding|no module at 'encoder.blocks'"):
        ac.layouts.blocks_layout(net, "encoder.blocks")
    with pytest.raises(ConfigError, match="name an nn.ModuleList or nn.Sequential"):
        ac.layouts.blocks_layout(net, "encoder.ln")
    layout = ac.layouts.blocks_layout(net, "encoder.layers")
    stem = layout.stages.stages[0]
    assert stem.sites == [net.encoder.layers[0]]
    assert {id(p) for p in stem.parameters()} >= {id(net.class_token), id(net.encoder.pos_embedding),
                                                  id(net.conv_proj.weight)}


def test_options_are_one_validated_dataclass():
    assert ac.CacheOptions.of(None, audit=False).audit is False
    with pytest.raises(ConfigError, match=r"unknown options planer, streem; the options are store_dtype, encoding"):
        ac.CacheOptions.of(planer=None, streem=False)
    with pytest.raises(TypeError):
        ac.CacheOptions(None)  # keyword-only
    for bad in (dict(encoding="gzip"), dict(stream="yes"), dict(varlen="padded"), dict(audit=0.5)):
        with pytest.raises(ConfigError):
            ac.CacheOptions(**bad)


def test_a_stage_names_sites_inside_its_own_module():
    block, other = nn.Linear(2, 2), nn.Linear(2, 2)
    assert ac.Stage("s", nn.Sequential(block), sites=[block]).sites == [block]
    with pytest.raises(ConfigError, match="sites must be a non-empty list of modules inside"):
        ac.Stage("s", nn.Sequential(block), sites=[other])
