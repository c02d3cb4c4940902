"""The layout families in a plain loop: cache on = cache off bit for bit, a wrong guess stopped on the first
batch, a family registered by the user, stages named, options checked."""

from __future__ import annotations

import uuid

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="the huggingface extra (actcache[huggingface]) is not installed")

import actcache_client as ac  # noqa: E402
from actcache.errors import ConfigError  # noqa: E402
from actcache_client.layouts import Layout, find_layout, register_layout, unregister_layout  # noqa: E402
from tests import families  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def connection(daemon):
    c = ac.connect(daemon.socket, namespace=f"layouts-{uuid.uuid4().hex[:8]}", strict=True)
    yield c
    c.close()


def _same_with_and_without_the_cache(make, data, depth, connection, **options) -> int:
    off, _ = families.train(make, data, depth, **options)
    on, served = families.train(make, data, depth, connection=connection, **options)
    assert on == off  # float32 entries: bit for bit
    assert served == 40  # epoch 1 stored the prefix, epoch 2 was served whole
    return served


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
@pytest.mark.slow
def test_a_decoder_classifier_is_served_bit_for_bit(connection, family, left):
    # Left padding shifts a sample's positions with the batch's length: stored whole at one padded length.
    options = {"varlen": None} if left else {}
    _same_with_and_without_the_cache(getattr(families, family), families.text(left=left), 3, connection, **options)


def test_a_left_padded_batch_stored_at_each_samples_length_is_named(connection):
    with pytest.raises(ConfigError, match=r"padded on the left.*varlen=None"):
        families.train(families.llama, families.text(left=True), 2, connection=connection)


@pytest.mark.parametrize("family", ["distilbert", "electra", "roberta"])
def test_an_encoder_classifier_is_served_bit_for_bit(connection, family):
    _same_with_and_without_the_cache(getattr(families, family), families.text(), 3, connection)


@pytest.mark.parametrize("family", ["vit", "ClipProbe"])
def test_a_vision_encoder_with_a_head_is_served_bit_for_bit(connection, family):
    _same_with_and_without_the_cache(getattr(families, family), families.images(), 3, connection)


def test_blocks_stage_a_torchvision_style_vit_by_its_blocks(connection):
    # Patchify, class token and position embedding run in the network's forward, before its first block.
    _same_with_and_without_the_cache(families.TorchvisionStyleViT, families.images(), "encoder.layers.1", connection,
                                     blocks="encoder.layers")


def test_a_wrong_guess_is_an_error_on_the_first_batch_naming_the_stage(connection):
    """Before any freeze: the first batch the wrapped loader yields is checked."""
    net = families.ResNetLike()
    loader = ac.ActCache(net, connection).wrap(torch.utils.data.DataLoader(families.images(), batch_size=8))
    with pytest.raises(ConfigError, match=r"resnet-like layout.*stage 'layer1.0'.*stages=StagedModel.*blocks="):
        next(iter(loader))


def test_a_family_registered_by_the_user_is_used_by_actcache(connection):
    def staged(net: families.ResNetLike) -> Layout:
        return Layout(ac.StagedModel([ac.Stage("stem", nn.Sequential(net.conv1, net.bn1, net.relu, net.extra)),
                                      ac.Stage("layer1", net.layer1),
                                      ac.Stage("head", nn.Sequential(net.avgpool, nn.Flatten(1), net.fc))]))

    register_layout("resnet-with-extra", families.ResNetLike, staged)
    try:
        assert find_layout(families.ResNetLike()).family == "resnet-with-extra"
        _same_with_and_without_the_cache(families.ResNetLike, families.images(), "layer1", connection)
    finally:
        unregister_layout("resnet-with-extra")


def test_stages_are_listed_and_frozen_by_name(connection):
    cache = ac.ActCache(families.llama(), connection)
    listed = cache.stages
    assert [s.name for s in listed] == ["embeddings", "model.layers.0", "model.layers.1", "model.layers.2", "head"]
    assert listed[0].modules == ("model.embed_tokens",) and listed[1].parameters > 0
    assert "score" in listed[-1].modules
    cache.freeze("model.layers.1")
    assert cache.frozen == 3
    for wrong in ("head", "layers.9", 2.5, 5):
        with pytest.raises(ConfigError, match="embeddings, model.layers.0, model.layers.1, model.layers.2"):
            cache.freeze(wrong)


def test_an_unknown_option_names_the_valid_ones(connection):
    with pytest.raises(ConfigError, match=r"unknown option store_dtyp; the options are store_dtype, encoding, audit"):
        ac.ActCache(families.llama(), connection, store_dtyp=torch.float16)
    with pytest.raises(ConfigError, match="store_dtype must be"):
        ac.CacheOptions(store_dtype=torch.int8)
    cache = ac.ActCache(families.llama(), connection, options=ac.CacheOptions(keep_generations=True))
    assert cache.model.keep_generations


@pytest.mark.slow
def test_a_lora_model_adapted_on_its_top_layers_is_served_below_them(connection):
    pytest.importorskip("peft", reason="the peft extra (actcache[peft]) is not installed")
    cache = ac.ActCache(families.llama_lora(), connection)
    adapted = [i for i, stage in enumerate(cache.model.model.stages)
               if any("lora_" in name for name, _ in stage.named_parameters())]
    assert cache.stages[adapted[0]].name == "base_model.model.model.layers.2"  # layers 0 and 1 hold no adapter
    first_adapted = adapted[0]  # embeddings, layers 0 and 1: the prefix below the adapters
    _same_with_and_without_the_cache(families.llama_lora, families.text(), first_adapted, connection)


def test_unfreezing_gives_back_the_trainable_parameters_the_user_chose(connection):
    pytest.importorskip("peft", reason="the peft extra (actcache[peft]) is not installed")
    net = families.llama_lora()
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    cache = ac.ActCache(net, connection)
    cache.freeze(4)
    assert not any(p.requires_grad for n, p in net.named_parameters() if "layers.2" in n)
    cache.freeze(0)
    assert {n for n, p in net.named_parameters() if p.requires_grad} == trainable  # the base stays frozen
