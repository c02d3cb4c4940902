"""Fine-tune a BERT encoder on SST-2 with transformers.Trainer.

    python examples/huggingface_finetune.py --data DIR     # all-MiniLM-L6-v2 on DIR/train.tsv, DIR/dev.tsv
    python examples/huggingface_finetune.py --tiny         # a tiny random BERT on made-up sentences

huggingface_finetune.py and huggingface_finetune_actcache.py differ only by the two lines that add actcache.
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

WORDS = ["good", "bad", "great", "awful", "film", "plot", "actors", "very", "not", "quite", "the", "a", "is", "was"]


def tiny_model_and_data(n: int) -> tuple[torch.nn.Module, PreTrainedTokenizerFast, list, list]:
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                        cls_token="[CLS]", sep_token="[SEP]")
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)
    rng = random.Random(0)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(n)]
    labels = [int(t.count("good") + t.count("great") > t.count("bad") + t.count("awful")) for t in texts]
    split = n * 3 // 4
    return (BertForSequenceClassification(config), tokenizer,
            list(zip(texts[:split], labels[:split])), list(zip(texts[split:], labels[split:])))


def minilm_and_sst2(data: Path, limit: int) -> tuple[torch.nn.Module, PreTrainedTokenizerFast, list, list]:
    from actcache_client.integrations.huggingface import load_transformers_minilm

    def read(name: str, count: int) -> list:
        with open(data / name, newline="") as f:
            rows = [(r["sentence"], int(r["label"])) for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
        return rows[:count]

    model, tokenizer = load_transformers_minilm(num_labels=2)
    return model, tokenizer, read("train.tsv", limit), read("dev.tsv", max(limit // 4, 64))


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=1) == prediction.label_ids).mean())}


def main(argv: list[str] | None = None) -> Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="a directory with SST-2's train.tsv and dev.tsv")
    parser.add_argument("--tiny", action="store_true", help="a tiny random BERT on made-up sentences")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--output", default="/tmp/hf-finetune")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.tiny:
        model, tokenizer, train, dev = tiny_model_and_data(args.samples)
    else:
        model, tokenizer, train, dev = minilm_and_sst2(args.data, args.samples)

    def encode(rows: list) -> list[dict]:
        return [{**tokenizer(text, truncation=True, max_length=64), "label": label} for text, label in rows]

    training = TrainingArguments(output_dir=args.output, num_train_epochs=args.epochs, per_device_train_batch_size=32,
                                 learning_rate=1e-4, warmup_steps=10, weight_decay=0.01, eval_strategy="epoch",
                                 logging_steps=5, save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=training, train_dataset=encode(train), eval_dataset=encode(dev),
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy)
    trainer.train()
    print(trainer.evaluate())
    return trainer


if __name__ == "__main__":
    main()
