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
from actcache_client._stages import ClassifierHead, EncoderLayer, Stage, StagedModel, State

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


class _BidirectionalMask:
    """The attention mask a transformers encoder builds for ``config`` (its attention implementation)."""

    def __init__(self, config: object) -> None:
        self.config = config

    def __call__(self, hidden: Tensor, mask: Tensor) -> Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        return create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask)


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
    head = ClassifierHead(pooler if isinstance(pooler, nn.Module) else None,
                     dropout if isinstance(dropout, nn.Module) else None, classifier)
    stages = [Stage("embeddings", _Embeddings(body.embeddings))]
    extend = _BidirectionalMask(body.config)
    stages += [Stage(f"encoder.layer.{i}", EncoderLayer(layer, extend)) for i, layer in enumerate(layers)]
    stages.append(Stage("head", head))
    return StagedModel(stages)
