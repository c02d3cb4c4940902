"""The transformers families: text encoders, decoders with a classification head, vision encoders.

Each is found by the type of its body (``BertModel``, ``LlamaModel``, ``ViTModel``, ...) anywhere in the
network, so a model of the library and a module of the user's holding one (a probe) are both taken. The
stages are ``embeddings`` (the body's modules before its first layer), one per layer, and ``head``
(everything else, run by the network's own ``forward``). Whatever the body computes between them (the
attention mask, rotary position embeddings, positions) comes from the body's own ``forward``
(``_calls.arguments_at``), bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from actcache.errors import ConfigError
from actcache_client.layouts._base import Layout, module_at, of_type, padded_hidden, pixel_inputs, rest_of, text_inputs
from actcache_client.layouts._calls import arguments_at, hidden_of
from actcache_client.layouts._stages import Stage, StagedModel
from actcache_client.transport._state import State, tensors_of
from actcache_client.transport._tensors import VarLen

__all__ = ["Body", "DECODERS", "ENCODERS", "VISION", "find_body", "stage_body"]


@dataclass(frozen=True)
class Body:
    """A transformers body: its types, its modules before the layers (in call order), and its layers' path.

    ``kind``: ``"encoder"`` (text, bidirectional), ``"decoder"`` (text, causal) or ``"vision"``.
    """

    types: tuple[str, ...]
    embeddings: tuple[str, ...]
    layers: str
    kind: str


_M = "transformers.models."
ENCODERS = (
    Body((_M + "bert.modeling_bert.BertModel", _M + "roberta.modeling_roberta.RobertaModel"),
         ("embeddings",), "encoder.layer", "encoder"),
    Body((_M + "electra.modeling_electra.ElectraModel",), ("embeddings", "embeddings_project"), "encoder.layer",
         "encoder"),
    Body((_M + "distilbert.modeling_distilbert.DistilBertModel",), ("embeddings",), "transformer.layer", "encoder"),
)
DECODERS = (
    Body((_M + "llama.modeling_llama.LlamaModel", _M + "qwen2.modeling_qwen2.Qwen2Model",
          _M + "mistral.modeling_mistral.MistralModel"), ("embed_tokens",), "layers", "decoder"),
)
VISION = (
    Body((_M + "vit.modeling_vit.ViTModel",), ("embeddings",), "layers", "vision"),
    Body((_M + "clip.modeling_clip.CLIPVisionModel", _M + "clip.modeling_clip.CLIPVisionTransformer"),
         ("embeddings", "pre_layrnorm"), "encoder.layers",
         "vision"),
)


def find_body(net: nn.Module, bodies: tuple[Body, ...]) -> tuple[str, nn.Module, Body] | None:
    """The first module of ``net`` (itself included, in registration order) of one of ``bodies``' types."""
    for path, module in net.named_modules():
        for body in bodies:
            if of_type(module, *body.types):
                return path, module, body
    return None


class _Embeddings(nn.Module):
    """The batch's input -> the body's first layer's input: the body's own forward, stopped there.

    Text: ``(input_ids, attention_mask[, token_type_ids]) -> (hidden, mask)`` (the mask as float32: it is
    stored beside the hidden state, see ``VarLen(mask_dtype=...)``); vision: ``pixel_values -> hidden``.
    """

    body: nn.Module
    first: nn.Module

    def __init__(self, body: nn.Module, modules: list[nn.Module], first: nn.Module, kind: str) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)  # the body's modules before its layers: this stage's parameters
        object.__setattr__(self, "body", body)  # called, not owned: its other modules belong to other stages
        object.__setattr__(self, "first", first)
        self.kind = kind

    def forward(self, state: State) -> State:
        if self.kind == "vision":
            pixels = tensors_of(state)[0]
            args, kwargs = arguments_at(lambda: self.body(pixel_values=pixels), self.first, "its first layer")
            return hidden_of(args, kwargs)[0]
        tensors = tensors_of(state)
        if len(tensors) < 2:
            raise ConfigError("a transformers text model's input is (input_ids, attention_mask[, token_type_ids]); "
                              "give the batch an attention_mask (DataCollatorWithPadding does)")
        inputs: dict[str, Any] = {"input_ids": tensors[0], "attention_mask": tensors[1]}
        if len(tensors) > 2:
            inputs["token_type_ids"] = tensors[2]
        if self.kind == "decoder":
            inputs["use_cache"] = False
        args, kwargs = arguments_at(lambda: self.body(**inputs), self.first, "its first layer")
        return hidden_of(args, kwargs)[0], tensors[1].to(torch.float32)


class _Layer(nn.Module):
    """One layer, called as the body calls it: text ``(hidden, mask) -> (hidden, mask)``, its other arguments
    (attention mask, position embeddings) from the body's own forward on the batch's shape and mask;
    vision ``hidden -> hidden`` (no mask)."""

    body: nn.Module
    first: nn.Module

    def __init__(self, layer: nn.Module, body: nn.Module, first: nn.Module, kind: str) -> None:
        super().__init__()
        self.layer = layer
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "first", first)
        self.kind = kind

    def forward(self, state: State) -> State:
        if self.kind == "vision":
            return _hidden(self.layer(state, None))
        hidden, stored = state
        mask = stored.to(torch.int64)  # as a tokenizer gives it
        # The body's own forward on placeholder tokens of the batch's shape: the mask and positions it builds
        # depend on the attention mask and the shape only.
        inputs: dict[str, Any] = {"input_ids": torch.zeros_like(mask), "attention_mask": mask}
        if self.kind == "decoder":
            inputs["use_cache"] = False
        with torch.no_grad():
            args, kwargs = arguments_at(lambda: self.body(**inputs), self.first, "its first layer")
        _, args, kwargs = hidden_of(args, kwargs)
        return _hidden(self.layer(hidden, *args, **kwargs)), stored


def _hidden(out: Any) -> Tensor:
    return out[0] if isinstance(out, tuple) else out


def stage_body(net: nn.Module, found: tuple[str, nn.Module, Body]) -> Layout:
    """The layout of ``net`` around its body ``found``: embeddings, one stage per layer, head."""
    path, body, spec = found
    layers = module_at(body, spec.layers)
    if not isinstance(layers, (nn.ModuleList, nn.Sequential)) or len(layers) == 0:
        raise ConfigError(f"{type(body).__name__}.{spec.layers} is a {type(layers).__name__}; expected a non-empty "
                          "nn.ModuleList of layers: pass blocks=\"<dotted path>\" or stages=StagedModel([...])")
    before = [getattr(body, name) for name in spec.embeddings if isinstance(getattr(body, name, None), nn.Module)]
    prefix = f"{path}.{spec.layers}" if path else spec.layers
    first = layers[0]
    stages = [Stage("embeddings", _Embeddings(body, before, first, spec.kind))]
    stages += [Stage(f"{prefix}.{i}", _Layer(layer, body, first, spec.kind)) for i, layer in enumerate(layers)]
    stages.append(Stage("head", rest_of(net, [s.module for s in stages])))
    if spec.kind == "vision":
        return Layout(StagedModel(stages), None, pixel_inputs)
    return Layout(StagedModel(stages), VarLen(mask_dtype=torch.float32), text_inputs, padded_hidden)
