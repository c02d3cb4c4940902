"""The families matched by type without transformers: nn.Sequential, ResNets and actcache's own BERT, and the
two guesses by attribute names (a ResNet-like or BERT-like network), checked on the first batch."""

from __future__ import annotations

from torch import nn

from actcache_client.layouts._base import Layout, of_type, padded_hidden, text_inputs
from actcache_client.layouts._stages import from_bert, from_resnet, from_sequential, from_transformers
from actcache_client.transport._tensors import VarLen

__all__ = ["BERT_TYPES", "RESNET_TYPES", "TRANSFORMERS_BERT_TYPES", "bert", "bert_like", "is_resnet", "of_type",
           "resnet", "resnet_like", "sequential", "transformers_bert"]

RESNET_TYPES = ("actcache_client.models.CifarResNet", "torchvision.models.resnet.ResNet")
BERT_TYPES = ("actcache_client.bert.BertForSequenceClassification",)
TRANSFORMERS_BERT_TYPES = ("transformers.models.bert.modeling_bert.BertForSequenceClassification",
                           "transformers.models.roberta.modeling_roberta.RobertaForSequenceClassification")


def sequential(net: nn.Module) -> Layout:
    """One stage per child of an nn.Sequential."""
    assert isinstance(net, nn.Sequential), "registered for nn.Sequential"
    return Layout(from_sequential(net))


def resnet(net: nn.Module) -> Layout:
    """Stem, one stage per residual block, head (``from_resnet``)."""
    return Layout(from_resnet(net))


def resnet_like(net: nn.Module) -> bool:
    """A guess: the network has ResNet's attribute names (``conv1``, ``layer1``)."""
    return hasattr(net, "conv1") and hasattr(net, "layer1")


def bert(net: nn.Module) -> Layout:
    """Embeddings, one stage per encoder layer, head (``from_bert``); text stored at each sample's length."""
    return Layout(from_bert(net), VarLen(), text_inputs, padded_hidden)


def bert_like(net: nn.Module) -> bool:
    """A guess: the network has a BERT classifier's attribute names (``.bert.embeddings``, ``.classifier``)."""
    return hasattr(getattr(net, "bert", net), "embeddings") and hasattr(net, "classifier")


def transformers_bert(net: nn.Module) -> Layout:
    """A transformers BERT or RoBERTa classifier (``from_transformers``): the model's own attention mask."""
    return Layout(from_transformers(net), VarLen(), text_inputs, padded_hidden)


def is_resnet(net: nn.Module) -> bool:
    """A torchvision ResNet, or actcache's CIFAR one."""
    return of_type(net, *RESNET_TYPES)
