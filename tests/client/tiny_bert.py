"""A tiny BERT-style encoder with HF attribute names, for tests."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class TinyEmbeddings(nn.Module):
    def __init__(self, vocab: int = 50, hidden: int = 16, max_pos: int = 12) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_pos, hidden)
        self.token_type_embeddings = nn.Embedding(2, hidden)
        self.LayerNorm = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(0.1)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions)
        return self.dropout(self.LayerNorm(x))


class TinyLayer(nn.Module):
    """Hand-written self-attention + FFN taking HF's additive [b, 1, 1, s] mask."""

    def __init__(self, hidden: int = 16, heads: int = 2, return_tuple: bool = True) -> None:
        super().__init__()
        self.heads, self.return_tuple = heads, return_tuple
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor | tuple[Tensor]:
        b, t, d = hidden.shape
        dh = d // self.heads

        def split(x: Tensor) -> Tensor:
            return x.view(b, t, self.heads, dh).transpose(1, 2)

        q, k, v = split(self.query(hidden)), split(self.key(hidden)), split(self.value(hidden))
        scores = q @ k.transpose(-1, -2) / math.sqrt(dh)
        if attention_mask is not None:
            scores = scores + attention_mask
        ctx = (self.dropout(scores.softmax(-1)) @ v).transpose(1, 2).reshape(b, t, d)
        h = self.ln1(hidden + self.dropout(self.out(ctx)))
        h = self.ln2(h + self.dropout(self.ffn(h)))
        return (h,) if self.return_tuple else h


class TinyEncoder(nn.Module):
    def __init__(self, n_layers: int, return_tuple: bool) -> None:
        super().__init__()
        self.layer = nn.ModuleList(TinyLayer(return_tuple=return_tuple) for _ in range(n_layers))


class TinyPooler(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.dense, self.activation = nn.Linear(hidden, hidden), nn.Tanh()

    def forward(self, hidden: Tensor) -> Tensor:
        return self.activation(self.dense(hidden[:, 0]))


class TinyBertModel(nn.Module):
    def __init__(self, n_layers: int = 3, return_tuple: bool = True) -> None:
        super().__init__()
        self.embeddings = TinyEmbeddings()
        self.encoder = TinyEncoder(n_layers, return_tuple)
        self.pooler = TinyPooler()

    def encode(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        h = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        ext = attention_mask[:, None, None, :].to(dtype=h.dtype)
        ext = (1.0 - ext) * torch.finfo(h.dtype).min
        for layer in self.encoder.layer:
            out = layer(h, ext)
            h = out[0] if isinstance(out, tuple) else out
        return self.pooler(h)


class TinyBertForSequenceClassification(nn.Module):
    """Like HF: ``.bert`` body, then dropout and classifier on the pooled [CLS]."""

    def __init__(self, n_layers: int = 3, num_labels: int = 3) -> None:
        super().__init__()
        self.bert = TinyBertModel(n_layers)
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(16, num_labels)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        return self.classifier(self.dropout(self.bert.encode(input_ids, attention_mask, token_type_ids)))


class TinyFlatBert(TinyBertModel):
    """Body and classifier on one object, layers returning a bare tensor, no dropout in the head."""

    def __init__(self) -> None:
        super().__init__(n_layers=2, return_tuple=False)
        self.classifier = nn.Linear(16, 2)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        return self.classifier(self.encode(input_ids, attention_mask, token_type_ids))
