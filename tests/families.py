"""Tiny networks of each layout family (built from transformers configs: nothing is downloaded), their
batches, and a plain training loop run with or without the cache."""

from __future__ import annotations

import random
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import actcache_client as ac
from actcache_client.engine._cached_forward import CachedForward

VOCAB, LENGTH = 64, 12
_TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64)
_IMAGE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=16,
              patch_size=4)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForSequenceClassification
    return LlamaForSequenceClassification(LlamaConfig(**_TEXT, num_key_value_heads=2, pad_token_id=0))


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForSequenceClassification
    return Qwen2ForSequenceClassification(Qwen2Config(**_TEXT, num_key_value_heads=2, pad_token_id=0))


def mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForSequenceClassification
    return MistralForSequenceClassification(MistralConfig(**_TEXT, num_key_value_heads=2, pad_token_id=0))


def distilbert() -> nn.Module:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    return DistilBertForSequenceClassification(DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4,
                                                                hidden_dim=64, max_position_embeddings=64,
                                                                pad_token_id=0))


def electra() -> nn.Module:
    from transformers import ElectraConfig, ElectraForSequenceClassification
    return ElectraForSequenceClassification(ElectraConfig(**_TEXT, embedding_size=16, pad_token_id=0))


def roberta() -> nn.Module:
    from transformers import RobertaConfig, RobertaForSequenceClassification
    return RobertaForSequenceClassification(RobertaConfig(**_TEXT, pad_token_id=0))


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(**_IMAGE, num_labels=4))


class ClipProbe(nn.Module):
    """A linear head on a CLIP image encoder's pooled output."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import CLIPVisionConfig, CLIPVisionModel
        self.clip = CLIPVisionModel(CLIPVisionConfig(**_IMAGE))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.clip(pixel_values=x).pooler_output)


class TorchvisionStyleViT(nn.Module):
    """torchvision's VisionTransformer in miniature: patchify, class token and position embedding in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(3, 32, 4, 4)
        self.class_token = nn.Parameter(torch.zeros(1, 1, 32))
        self.encoder = nn.Module()
        self.encoder.pos_embedding = nn.Parameter(torch.randn(1, 17, 32) * 0.02)
        self.encoder.dropout = nn.Dropout(0.1)
        self.encoder.layers = nn.Sequential(*[nn.TransformerEncoderLayer(32, 4, 64, 0.1, batch_first=True,
                                                                         norm_first=True) for _ in range(3)])
        self.encoder.ln = nn.LayerNorm(32)
        self.heads = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.encoder.layers(self.encoder.dropout(x + self.encoder.pos_embedding))
        return self.heads(self.encoder.ln(x)[:, 0])


class ResNetLike(nn.Module):
    """ResNet's attribute names, and a convolution between the stem and layer1 that no ResNet has."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.extra = nn.Conv2d(8, 8, 3, padding=1)
        self.layer1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(self.extra(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def text(n: int = 40, *, left: bool = False, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Token sequences of 3..LENGTH tokens padded to LENGTH (on the left or right), with a binary label."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        k = rng.randint(3, LENGTH)
        ids, pad = [rng.randrange(3, VOCAB) for _ in range(k)], [0] * (LENGTH - k)
        out.append({"input_ids": torch.tensor(pad + ids if left else ids + pad),
                    "attention_mask": torch.tensor(pad + [1] * k if left else [1] * k + pad),
                    "labels": torch.tensor(sum(ids) % 2)})
    return out


def images(n: int = 40) -> Dataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 4, (n,), generator=g))


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


def train(make: Callable[[], nn.Module], data: Any, depth: int | str, *, connection: ac.Connection | None = None,
          epochs: int = 3, **options: Any) -> tuple[list[float], int]:
    """Losses of a plain loop freezing ``depth`` stages after epoch 0, and the rows served from the cache;
    with ``connection``, through ActCache, else with the same stages frozen by hand, computed every step."""
    torch.manual_seed(0)
    net = make()
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1),
                        collate_fn=collate if isinstance(data, list) else None)
    if connection is not None:
        cache = ac.ActCache(net, connection, **{"planner": None, **options})  # always served: hits to count
        loader, staged = cache.wrap(loader, skip_loads=False), cache.model
    else:
        blocks = options.get("blocks")
        layout = ac.layouts.blocks_layout(net, blocks) if blocks else ac.layouts.find_layout(net)
        staged = CachedForward(layout.stages, None)
    losses = []
    for epoch in range(epochs):
        net.train()
        if epoch == 1:
            if connection is not None:
                cache.freeze(depth)
            else:
                staged.set_frozen(depth if isinstance(depth, int) else staged.model.stage_names.index(depth) + 1)
        for batch in loader:
            for stage in staged.model.stages[: staged.frozen]:  # what ActCache does: frozen stages in eval mode
                stage.train(False)
            if isinstance(batch, dict):
                out = net(**{k: v for k, v in batch.items() if k != "labels"})
                logits, labels = out.logits, batch["labels"]
            else:
                out = net(batch[0])
                logits, labels = getattr(out, "logits", out), batch[1]
            loss = F.cross_entropy(logits, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    if connection is not None:
        cache.connection.flush()
    return losses, staged.times.cached_samples


def llama_lora() -> nn.Module:
    """A 4-layer Llama classifier with LoRA adapters on its top two layers only."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForSequenceClassification
    config = LlamaConfig(**{**_TEXT, "num_hidden_layers": 4}, num_key_value_heads=2, pad_token_id=0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[2, 3],
                      task_type="SEQ_CLS")
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 for a renamed property (its warning, not ours)
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(LlamaForSequenceClassification(config), lora)
