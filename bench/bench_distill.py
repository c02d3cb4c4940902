"""Knowledge distillation on SST-2: a MiniLM teacher recomputed every step vs served from the cache.

    python bench/bench_distill.py [--quick] [--train-size 2000] [--epochs 5] [--student-layers 2] [--threads 1]

The teacher is all-MiniLM-L6-v2 (6 layers, mean pooling, as the model is
meant to be used) with a linear head trained briefly on the training subset's
pooled features; it is fixed from then on. The student is a 2-layer MiniLM
(the teacher's embeddings, first layers and pooler; a new classifier on
[CLS]) whose embeddings are frozen; it learns from ``0.5 * KD(T=2) + 0.5 *
cross-entropy``. Two students start from the same weights, data order and
random state and take turns epoch by epoch in one process against one real
daemon (Unix socket, LMDB in a temp dir):

- ``recomputed``: ``CachedTeacher(teacher, None)``: the teacher runs every step;
- ``served``: ``CachedTeacher(teacher, conn)``: epoch 1 computes and stores
  its logits, later epochs read them from the daemon's stream (audited).

Both students are fed by ``CachedLoader(loader, [student, teacher])``.
Times are the whole student epoch (loading, teacher, student step), wall and
this process's CPU; the daemon's CPU is counted for the served epochs.
Sample output (2 cores shared with other jobs, --quick, 1 torch thread; the
whole output is in docs/benchmarks.md):

    epoch  arm          wall s   cpu s  daemon cpu s  teacher s  served  computed  audited     loss
        1  recomputed    13.74   13.67          0.00       6.66       0       640        0   0.8443
        1  served        13.64   13.63          0.07       6.60       0       640        0   0.8443
        2  served         7.49    7.40          0.04       0.12     640         0        9   0.8370
        2  recomputed    14.53   14.50          0.00       7.05       0       640        0   0.8370
    ...
    dev accuracy: teacher 73.67%, student recomputed 79.67%, served 79.67%; largest per-step loss gap 0.00e+00
    figure: kd_epoch_speedup = 1.962   (student epoch wall time, teacher recomputed / served, epochs >= 2)
    figure: kd_metric_delta = 0.00     (dev accuracy points, served - recomputed; 0 expected)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads.data import TextSet, pad_collate, read_glue, resolve_data_dir, subset, tokenize  # noqa: E402

import actcache_client as ac  # noqa: E402
from actcache.testing import run_daemon  # noqa: E402
from actcache_client.bert import BertConfig, BertForSequenceClassification, BertModel, load_minilm, minilm_dir  # noqa: E402

ARMS = ("recomputed", "served")


class MeanPoolClassifier(nn.Module):
    """A BERT encoder, mean pooling over the real tokens, a linear head: ``(ids, mask) -> logits``."""

    def __init__(self, bert: BertModel, num_labels: int = 2) -> None:
        super().__init__()
        self.bert = bert
        self.head = nn.Linear(bert.config.hidden_size, num_labels)

    def pool(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden, _ = self.bert(input_ids, attention_mask)
        mask = attention_mask[..., None].to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.head(self.pool(input_ids, attention_mask))


def make_teacher(train: TextSet, steps: int, seed: int) -> MeanPoolClassifier:
    """MiniLM with its head trained on the pooled features of ``train`` (the encoder is not trained)."""
    teacher = MeanPoolClassifier(load_minilm(2, seed=seed)[0].bert).eval()
    torch.manual_seed(seed)
    teacher.head.reset_parameters()
    with torch.no_grad():
        batches = [pad_collate([train[i] for i in range(lo, min(lo + 64, len(train)))])
                   for lo in range(0, len(train), 64)]
        features = torch.cat([teacher.pool(*x) for x, _ in batches])
    labels = train.labels
    opt = torch.optim.Adam(teacher.head.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        loss = F.cross_entropy(teacher.head(features), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return teacher


def make_student(teacher: MeanPoolClassifier, layers: int, seed: int) -> BertForSequenceClassification:
    """The teacher's embeddings, first ``layers`` layers and pooler; a new classifier (seeded)."""
    config = BertConfig.from_json(minilm_dir() / "config.json", num_hidden_layers=layers, num_labels=2)
    student = BertForSequenceClassification(config)
    student.bert.embeddings.load_state_dict(teacher.bert.embeddings.state_dict())
    student.bert.pooler.load_state_dict(teacher.bert.pooler.state_dict())
    for i in range(layers):
        student.bert.encoder.layer[i].load_state_dict(teacher.bert.encoder.layer[i].state_dict())
    student.init_weights(student.classifier, torch.Generator().manual_seed(seed))
    return student


@dataclass
class Arm:
    """One student and everything it trains with; its own RNG state, swapped in for its epochs."""

    name: str
    staged: ac.StagedModel
    student: ac.CachedForward
    teacher: ac.CachedTeacher
    loader: ac.CachedLoader
    opt: torch.optim.Optimizer
    rng: Tensor
    rows: list[dict] = field(default_factory=list)


def build_arm(name: str, student: BertForSequenceClassification, teacher: MeanPoolClassifier, train: TextSet,
              conn: ac.Connection | None, args) -> Arm:
    staged = ac.from_bert(copy.deepcopy(student))
    cached_student = ac.CachedForward(staged, None)  # the same student in both arms: its embeddings computed
    cached_student.set_frozen(1)
    cached_teacher = ac.CachedTeacher(teacher, conn)
    data = ac.IndexedDataset(train, targets=train.labels, data_id=f"sst2-{args.train_size}-{args.seed}")
    loader = ac.CachedLoader(
        DataLoader(data, batch_size=args.batch_size, shuffle=True, collate_fn=pad_collate,
                   generator=torch.Generator().manual_seed(args.seed)),
        [cached_student, cached_teacher],
    )
    opt = torch.optim.AdamW([p for p in staged.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01)
    return Arm(name, staged, cached_student, cached_teacher, loader, opt, torch.random.get_rng_state())


def daemon_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), in seconds."""
    fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


def run_epoch(arm: Arm, epoch: int, args, daemon_pid: int) -> dict:
    torch.random.set_rng_state(arm.rng)
    arm.staged.train()
    teacher_s, losses = 0.0, []
    before = copy.copy(arm.teacher.times)
    wall0, cpu0, daemon0 = time.perf_counter(), time.process_time(), daemon_cpu_seconds(daemon_pid)
    for batch in arm.loader:
        t0 = time.perf_counter()
        taught = arm.teacher(batch)
        teacher_s += time.perf_counter() - t0
        logits = arm.student(batch)
        loss = (args.alpha * ac.distillation_loss(logits, taught, args.temperature)
                + (1 - args.alpha) * F.cross_entropy(logits, batch.data[1]))
        arm.opt.zero_grad(set_to_none=True)
        loss.backward()
        arm.opt.step()
        losses.append(loss.item())
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    daemon = daemon_cpu_seconds(daemon_pid) - daemon0 if arm.name == "served" else 0.0
    if arm.teacher.connection is not None:
        arm.teacher.connection.flush(timeout_s=60)
    arm.rng = torch.random.get_rng_state()
    times = arm.teacher.times
    row = {"epoch": epoch, "arm": arm.name, "wall_s": wall, "cpu_s": cpu, "daemon_cpu_s": daemon,
           "teacher_s": teacher_s, "served": times.cached_samples - before.cached_samples,
           "computed": times.computed_samples - before.computed_samples,
           "audited": times.audited_samples - before.audited_samples, "loss": sum(losses) / len(losses),
           "losses": losses}
    arm.rows.append(row)
    return row


def accuracy(model: nn.Module, data: TextSet, batch_size: int = 128) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for lo in range(0, len(data), batch_size):
            x, y = pad_collate([data[i] for i in range(lo, min(lo + batch_size, len(data)))])
            logits = model(x) if isinstance(model, ac.StagedModel) else model(*x)
            correct += int((logits.argmax(-1) == y).sum())
    return 100.0 * correct / len(data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="640 training sentences, 300 dev, 4 epochs")
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--eval-size", type=int, default=None, help="dev sentences (default: all 872)")
    parser.add_argument("--epochs", type=int, default=5, help="epochs per arm (epoch 1 stores, the rest are timed)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--student-layers", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--alpha", type=float, default=0.5, help="weight of the KD loss (the rest: cross-entropy)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--head-steps", type=int, default=100, help="steps training the teacher's head")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the other core serves)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.train_size, args.eval_size, args.epochs = 640, args.eval_size or 300, 4
    if args.epochs < 2:
        parser.error("--epochs must be >= 2: epoch 1 stores the teacher's outputs, later ones are compared")
    torch.set_num_threads(args.threads)

    data_dir = resolve_data_dir(args.data_dir)
    sentences, labels = read_glue(data_dir, "sst2", "train")
    dev_sentences, dev_labels = read_glue(data_dir, "sst2", "dev")
    _, tokenizer = load_minilm(2, seed=args.seed, max_length=64)
    rows = subset(len(labels), args.train_size, args.seed)
    dev_rows = subset(len(dev_labels), args.eval_size, args.seed)
    train = TextSet(tokenize(tokenizer, [sentences[i] for i in rows]), [labels[i] for i in rows])
    dev = TextSet(tokenize(tokenizer, [dev_sentences[i] for i in dev_rows]), [dev_labels[i] for i in dev_rows])

    t0 = time.perf_counter()
    teacher = make_teacher(train, args.head_steps, args.seed)
    teacher_accuracy = accuracy(teacher, dev)
    student = make_student(teacher, args.student_layers, args.seed)
    print(f"SST-2: {len(train)} training / {len(dev)} dev sentences, batch {args.batch_size}, {args.epochs} epochs "
          f"per arm, {args.threads} torch thread(s)")
    print(f"teacher: all-MiniLM-L6-v2, mean pooling, head trained {args.head_steps} steps "
          f"({time.perf_counter() - t0:.1f} s): dev accuracy {teacher_accuracy:.1f}%")
    print(f"student: {args.student_layers} MiniLM layers, embeddings frozen; loss {args.alpha} * KD(T={args.temperature})"
          f" + {1 - args.alpha:g} * CE")

    with run_daemon() as daemon, ac.connect(daemon.socket, namespace="bench-distill", strict=True) as conn:
        torch.manual_seed(args.seed)
        arms = {name: build_arm(name, student, teacher, train, conn if name == "served" else None, args)
                for name in ARMS}
        print(f"\n{'epoch':>5}  {'arm':<11}{'wall s':>8}{'cpu s':>8}{'daemon cpu s':>14}{'teacher s':>11}"
              f"{'served':>8}{'computed':>10}{'audited':>9}{'loss':>9}")
        for epoch in range(1, args.epochs + 1):
            order = ARMS if epoch % 2 else ARMS[::-1]  # who goes first alternates
            for name in order:
                r = run_epoch(arms[name], epoch, args, daemon.proc.pid)
                print(f"{epoch:>5}  {name:<11}{r['wall_s']:>8.2f}{r['cpu_s']:>8.2f}{r['daemon_cpu_s']:>14.2f}"
                      f"{r['teacher_s']:>11.2f}{r['served']:>8}{r['computed']:>10}{r['audited']:>9}{r['loss']:>9.4f}",
                      flush=True)
        stats = conn.stats
    accuracies = {name: accuracy(arm.staged, dev) for name, arm in arms.items()}

    def timed(name: str, key: str) -> float:
        return sum(r[key] + (r["daemon_cpu_s"] if key == "cpu_s" else 0.0) for r in arms[name].rows[1:])

    speedup = timed("recomputed", "wall_s") / timed("served", "wall_s")
    cpu_speedup = timed("recomputed", "cpu_s") / timed("served", "cpu_s")
    per_epoch = [a["wall_s"] / b["wall_s"] for a, b in zip(arms["recomputed"].rows[1:], arms["served"].rows[1:])]
    loss_gap = max(abs(a - b) for ra, rb in zip(arms["recomputed"].rows, arms["served"].rows)
                   for a, b in zip(ra["losses"], rb["losses"]))
    delta = accuracies["served"] - accuracies["recomputed"]
    print(f"\ndev accuracy: teacher {teacher_accuracy:.2f}%, student recomputed {accuracies['recomputed']:.2f}%, "
          f"served {accuracies['served']:.2f}%; largest per-step loss gap {loss_gap:.2e}")
    print(f"cache: {stats.puts} entries stored ({stats.bytes_written / 1e3:.1f} kB), {stats.hits} hits and "
          f"{stats.misses} misses ({stats.streamed} of them through the stream)")
    print(f"epochs >= 2: per-epoch wall ratios {', '.join(f'{r:.2f}' for r in per_epoch)}; "
          f"CPU (trainer + daemon) ratio {cpu_speedup:.2f}")
    figures = {"kd_epoch_speedup": speedup, "kd_metric_delta": delta}
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "teacher_accuracy": teacher_accuracy,
                                         "accuracy": accuracies, "rows": {n: a.rows for n, a in arms.items()},
                                         "cpu_speedup": cpu_speedup, "figures": figures}, indent=2))
    print(f"figure: kd_epoch_speedup = {speedup:.3f}")
    print(f"figure: kd_metric_delta = {delta:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
