"""Layouts: a network split into stages, and how actcache finds the split, one family per module, in a registry.

    from actcache_client.layouts import Layout, register_layout

    def my_layout(net: MyNet) -> Layout:
        return Layout(StagedModel([Stage("stem", net.stem), Stage("body", net.body), Stage("head", net.head)]))

    register_layout("mynet", MyNet, my_layout)     # ActCache(MyNet()) and attach(trainer) now take it

A family matches networks by type (a guess by attribute names comes last) and builds a ``Layout``: its
stages and how a batch maps to the first stage's input and the served state to the next module's. Whatever
family built it, the layout is checked against the network's own forward on the first batch.

Built in, in the order they are consulted: ``sequential`` (nn.Sequential), ``resnet`` (torchvision and
actcache's ResNets), ``bert`` (actcache's BERT), ``transformers-bert`` (BERT and RoBERTa classifiers),
``transformers-encoder`` (a BertModel, RobertaModel, ElectraModel or DistilBertModel anywhere in the
network), ``transformers-decoder`` (LlamaModel, Qwen2Model, MistralModel), ``transformers-vision``
(ViTModel, CLIPVisionModel), then the guesses ``resnet-like`` and ``bert-like``. ``blocks_layout(net,
"encoder.layers")`` stages any network by its blocks (``ActCache(net, blocks=...)``).
"""

from __future__ import annotations

from torch import nn

from actcache_client.layouts import _simple, _transformers
from actcache_client.layouts._base import Layout
from actcache_client.layouts._blocks import stage_blocks as blocks_layout
from actcache_client.layouts._check import check_layout
from actcache_client.layouts._registry import (
    Family,
    Match,
    find_layout,
    layout_families,
    register_layout,
    unregister_layout,
)

__all__ = ["Family", "Layout", "Match", "blocks_layout", "check_layout", "find_layout", "layout_families",
           "register_layout", "unregister_layout"]


def _body_family(bodies: tuple[_transformers.Body, ...]) -> tuple:
    def matches(net: nn.Module) -> bool:
        return _transformers.find_body(net, bodies) is not None

    def build(net: nn.Module) -> Layout:
        found = _transformers.find_body(net, bodies)
        assert found is not None  # matches() said so
        return _transformers.stage_body(net, found)

    return matches, build


register_layout("sequential", nn.Sequential, _simple.sequential, _builtin=True)
register_layout("resnet", _simple.is_resnet, _simple.resnet, _builtin=True)
register_layout("bert", lambda net: _simple.of_type(net, *_simple.BERT_TYPES), _simple.bert, _builtin=True)
register_layout("transformers-bert", lambda net: _simple.of_type(net, *_simple.TRANSFORMERS_BERT_TYPES),
                _simple.transformers_bert, _builtin=True)
register_layout("transformers-encoder", *_body_family(_transformers.ENCODERS), _builtin=True)
register_layout("transformers-decoder", *_body_family(_transformers.DECODERS), _builtin=True)
register_layout("transformers-vision", *_body_family(_transformers.VISION), _builtin=True)
register_layout("resnet-like", _simple.resnet_like, _simple.resnet, guess=True, _builtin=True)
register_layout("bert-like", _simple.bert_like, _simple.bert, guess=True, _builtin=True)
