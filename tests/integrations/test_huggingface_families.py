"""transformers.Trainer with actcache attached to the newer families: a Llama-style classifier padded on either
side, and a family registered by the user."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

pytest.importorskip("transformers", reason="the huggingface extra (actcache[huggingface]) is not installed")

from transformers import (  # noqa: E402
    DataCollatorWithPadding,
    LlamaConfig,
    LlamaForSequenceClassification,
    Trainer,
    TrainingArguments,
)

import actcache_client as ac  # noqa: E402
from actcache.errors import ConfigError  # noqa: E402
from actcache_client.integrations.huggingface import attach  # noqa: E402
from actcache_client.layouts import Layout, register_layout, unregister_layout  # noqa: E402
from tests.integrations.test_huggingface import losses, sentences, tokenizer  # noqa: E402


@pytest.fixture
def connection():
    c = ac.connect(embedded=True)
    yield c
    c.close()


def llama() -> nn.Module:
    torch.manual_seed(0)
    return LlamaForSequenceClassification(LlamaConfig(vocab_size=16, hidden_size=32, num_hidden_layers=3,
                                                      num_attention_heads=4, num_key_value_heads=2,
                                                      intermediate_size=64, max_position_embeddings=40, pad_token_id=0))


def trainer(net: nn.Module, out: Path, *, side: str = "right") -> Trainer:
    tok = tokenizer()
    tok.padding_side = side
    args = TrainingArguments(output_dir=str(out), num_train_epochs=3, per_device_train_batch_size=8, logging_steps=1,
                             report_to=[], disable_tqdm=True, seed=0, use_cpu=True, save_strategy="no")
    return Trainer(model=net, args=args, train_dataset=sentences(48, 1), processing_class=tok,
                   data_collator=DataCollatorWithPadding(tok, padding="max_length", max_length=16))


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_llama_classifier_trains_as_without_the_cache(tmp_path, connection, side):
    plain = trainer(llama(), tmp_path / "plain", side=side)
    attach(plain, depth=3, freeze_at=0.25, cache=False)
    plain.train()
    cached = trainer(llama(), tmp_path / "cached", side=side)
    hooked = attach(cached, depth="model.layers.1", freeze_at=0.25, connection=connection, planner=None)  # depth 3
    cached.train()
    assert losses(cached) == losses(plain)
    assert hooked.cache.model.varlen is None if side == "left" else hooked.cache.model.varlen is not None
    assert hooked.cache.model.epoch_counters()[-1].times.cached_samples == 48  # the last epoch served whole


class Tagger(nn.Module):
    """A network no built-in family takes: embeddings, two blocks, a head, called in that order."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.block1, self.block2 = nn.Linear(32, 32), nn.Linear(32, 32)
        self.head = nn.Linear(32, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(torch.relu(self.block2(torch.relu(self.block1(self.embed(input_ids))))).mean(1))
        return {"logits": logits} if labels is None else \
            {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def tagger_layout(net: Tagger) -> Layout:
    # Each stage ends where the network's module does (the ReLUs are the network's forward's, between them).
    stages = [ac.Stage("embed", net.embed), ac.Stage("block1", net.block1),
              ac.Stage("block2", nn.Sequential(nn.ReLU(), net.block2)), ac.Stage("head", net.head)]
    return Layout(ac.StagedModel(stages), inputs_of=lambda batch: batch["input_ids"])


def test_a_family_registered_by_the_user_is_used_by_attach(tmp_path, connection):
    register_layout("tagger", Tagger, tagger_layout)
    try:
        runs = {}
        for name, options in [("plain", dict(cache=False)), ("cached", dict(connection=connection, planner=None))]:
            torch.manual_seed(0)
            t = trainer(Tagger(), tmp_path / name)
            hooked = attach(t, depth=2, freeze_at=0.25, **options)
            t.train()
            runs[name] = (losses(t), hooked)
        assert runs["cached"][0] == runs["plain"][0]
        assert runs["cached"][1].cache.layout.family == "tagger"
        assert runs["cached"][1].cache.model.epoch_counters()[-1].times.cached_samples == 48
    finally:
        unregister_layout("tagger")


def test_a_misspelt_option_is_named_with_or_without_the_cache(tmp_path, connection):
    for cache in (True, False):
        with pytest.raises(ConfigError, match="unknown option store_dtyp; the options are store_dtype"):
            attach(trainer(llama(), tmp_path), depth=2, cache=cache, connection=connection, store_dtyp=torch.float16)
