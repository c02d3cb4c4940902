"""Stages of a Hugging Face ``transformers`` encoder classifier, computed as the model computes them.

``from_transformers(model)`` stages a ``BertForSequenceClassification`` or a
``RobertaForSequenceClassification`` (and the other classes with their layout:
``.bert`` or ``.roberta`` holding ``embeddings`` and ``encoder.layer``, and a
``.classifier``) into ``embeddings``, ``encoder.layer.0`` .. ``encoder.layer.L-1``,
``head``. The state after the embeddings is ``(hidden, attention_mask)``.

Each layer gets the attention mask the model itself builds from the 0/1 mask
(``transformers.masking_utils.create_bidirectional_mask``, for the model's
attention implementation: SDPA, eager, ...), so a prefix computed here is the
model's own computation, bit for bit. transformers is imported only when a
model of its own is staged.
"""

from __future__ import annotations

from torch import Tensor, nn

from actcache.errors import ConfigError
from actcache_client._stages import Stage, StagedModel, State

__all__ = ["from_transformers", "is_transformers_model"]

_BODIES = ("bert", "roberta")


def is_transformers_model(net: nn.Module) -> bool:
    return type(net).__module__.startswith("transformers.")


class _Embeddings(nn.Module):
    """``(input_ids, attention_mask[, token_type_ids]) -> (hidden, attention_mask)``, called as the model calls it."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, state: State) -> tuple[Tensor, Tensor]:
        if isinstance(state, Tensor) or not 2 <= len(state) <= 3:
            raise ConfigError("a transformers encoder's state is (input_ids, attention_mask[, token_type_ids]); "
                              "give the batch an attention_mask (DataCollatorWithPadding does)")
        input_ids, mask = state[0], state[1]
        token_types = state[2] if len(state) > 2 else None
        return self.embeddings(input_ids=input_ids, token_type_ids=token_types), mask


class _Layer(nn.Module):
    """``(hidden, mask) -> (hidden, mask)``: the layer with the mask its model builds for ``config``."""

    def __init__(self, layer: nn.Module, config: object) -> None:
        super().__init__()
        self.layer = layer
        self.config = config

    def forward(self, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        from transformers.masking_utils import create_bidirectional_mask

        hidden, mask = state
        extended = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask)
        out = self.layer(hidden, extended)
        return (out[0] if isinstance(out, tuple) else out), mask


class _Head(nn.Module):
    """``(hidden, mask) -> logits``: the pooler if the body has one, the dropout if any, the classifier."""

    def __init__(self, pooler: nn.Module | None, dropout: nn.Module | None, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler, self.dropout, self.classifier = pooler, dropout, classifier

    def forward(self, state: tuple[Tensor, Tensor]) -> Tensor:
        if self.pooler is None:  # RoBERTa's head reads the first token itself
            return self.classifier(state[0])
        pooled = self.pooler(state[0])
        return self.classifier(pooled if self.dropout is None else self.dropout(pooled))


def from_transformers(model: nn.Module) -> StagedModel:
    """Stages ``embeddings``, ``encoder.layer.i``, ``head`` of a transformers encoder classifier."""
    body = next((getattr(model, name) for name in _BODIES if isinstance(getattr(model, name, None), nn.Module)), None)
    layers = getattr(getattr(body, "encoder", None), "layer", None)
    classifier = getattr(model, "classifier", None)
    if body is None or not isinstance(getattr(body, "embeddings", None), nn.Module) \
            or not isinstance(layers, nn.ModuleList) or not isinstance(classifier, nn.Module):
        raise ConfigError(
            f"actcache cannot stage a {type(model).__name__}: it knows transformers classifiers whose body "
            f"(.{' or .'.join(_BODIES)}) has .embeddings and .encoder.layer, with a .classifier "
            "(BertForSequenceClassification, RobertaForSequenceClassification); pass "
            "stages=StagedModel([...]) built from the model's own modules, in the order it calls them"
        )
    if getattr(body.config, "is_decoder", False):
        raise ConfigError(f"{type(model).__name__} is configured as a decoder (causal attention); actcache stages "
                          "encoders: set is_decoder=False or pass stages=StagedModel([...])")
    dropout = getattr(model, "dropout", None)
    pooler = getattr(body, "pooler", None)
    head = _Head(pooler if isinstance(pooler, nn.Module) else None,
                 dropout if isinstance(dropout, nn.Module) else None, classifier)
    stages = [Stage("embeddings", _Embeddings(body.embeddings))]
    stages += [Stage(f"encoder.layer.{i}", _Layer(layer, body.config)) for i, layer in enumerate(layers)]
    stages.append(Stage("head", head))
    return StagedModel(stages)
