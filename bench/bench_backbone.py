"""A frozen BERT encoder fine-tuned in a plain loop: recomputed every step, served by actcache, and the ideal.

    python bench/bench_backbone.py --quick                  # CPU, under half a minute on 2 cores
    python bench/bench_backbone.py --device cuda            # h1024, h1024-bf16 and h2048 [--json PATH]
    python bench/bench_backbone.py --hidden 256 --layers 8 --frozen 6 --sequences 1024 [--store-dtype bfloat16]

Named configurations (``--configs``; on ``--device cuda`` the first three by default, sized to fit in
8 minutes of one H200 with 2 timed epochs each, not yet timed there): ``h1024`` (hidden 1024, 24 layers,
embeddings + 20 frozen, 8,192 sequences, float32 entries, every row), ``h1024-bf16`` (the same with
bfloat16 entries; only the rows h1024 does not already measure: plain, actcache_bf16, actcache_planner
and the ideals), ``h2048`` (hidden 2048, 24 layers, 22 frozen, 4,096 sequences, bfloat16 entries, every
row but actcache_default); ``quick`` (``--quick``: hidden 64, 4 layers, 3 frozen, 512 sequences of 32
tokens, 5 timed epochs). Without ``--configs`` or ``--quick`` on the CPU, the size flags make one.

A ``BertForSequenceClassification`` built from a ``transformers`` BertConfig (random weights, nothing
downloaded) learns random token ids (fixed seed, padded to ``--seq-len`` with varying lengths, so the
attention masks vary) with AdamW; on ``--device cuda`` under bf16 autocast. Its embeddings and the first
``--frozen`` encoder layers are frozen: ``frozen + 1`` of actcache's stages (the embeddings are one stage,
each encoder layer one). Every row builds its network afresh from the same seed, sees the same batches
and the same dropout draws, and runs one untimed fill epoch, one untimed warm-up epoch, then
``--epochs`` timed epochs; the rows take turns epoch by epoch (the order rotates each round). Rows:

- ``plain``: the loop freezing by hand (``requires_grad_(False)`` and ``eval()`` on the embeddings and the
  bottom layers): they run every step. The baseline of every ratio.
- ``actcache_default``: the README's loop, ``ActCache(net)`` with its defaults (float32 entries),
  ``cache.wrap(loader)``, ``cache.freeze(frozen + 1)`` before the first epoch;
- ``actcache_bf16``: the same with ``store_dtype=torch.bfloat16``;
- ``actcache_planner``: ``planner=CachePlanner(PlannerConfig(total_epochs=E))`` (E: every epoch of the
  row) at the configuration's ``--store-dtype``; its last plan (mode and reason) is reported;
- ``actcache_off``: actcache with caching declined: ``planner=CachePlanner(PlannerConfig(min_gain=1.0))``
  never finds caching worth it, so actcache runs the frozen stages itself every step and serves nothing
  (what a run pays for actcache when its cost model says recompute);
- ``data_plane``: the data path into a step whose own work is trivial: ``nn.Sequential(frozen stage,
  linear head)`` over per-sample tensors of ``--plane-kib`` KiB (default: the size of the configuration's
  hidden states at ``--store-dtype``, at least 256 KiB), the frozen stage served from the first timed
  epoch (no planner), its inputs not loaded (the dataset has ``targets``), the head a linear layer on
  the first position;
- ``ideal_host``: the frozen prefix's outputs computed once and held in host memory (pinned on CUDA) at
  ``--store-dtype``, gathered and copied to the device per batch; only the top runs. On CUDA also
  ``ideal_device``: the outputs held in device memory, when they fit in a third of its free memory.

Each actcache row has a namespace of its own on the configuration's daemon (its own LMDB in a temp dir;
``ACTCACHE_DIR`` also points to a temp dir, so no other daemon is touched). Per row: seconds per epoch
(best and median of the timed epochs), the median's ratio to ``plain``, the fill and warm-up epochs'
seconds and the whole run's, the hits of the timed epochs, the entries stored (puts), and GB/s of entry
bytes delivered into the step (``ClientStats.bytes_read`` of the timed epochs, as stored: after the codec,
over their time; for the ideals, the bytes of the held outputs, padding included, copied per epoch).
``raw_lmdb_gb_s`` reads the ``data_plane`` row's entries in this process from the daemon's LMDB
(read-only, warm): get, checksum and decode (``decode_entry``), and a copy into a buffer, over every
entry, the median of five passes. Sample output (2-core VM, ``--quick --epochs 8``)::

    BERT hidden 64, 4 layers, embeddings + 3 frozen (4 stages), 512 sequences x 32 tokens, batch 64, AdamW, 8 ...
    row                    best_s  median_s  vs_plain   fill_s   warm_s    run_s    hits    puts    GB/s  plan
    plain                   0.187     0.193     1.000    0.230    0.193    2.007       0       0    0.00  -
    actcache_default        0.128     0.130     0.673    0.341    0.174    1.627    4096     512    0.02  cache
    actcache_bf16           0.124     0.142     0.736    0.310    0.193    1.664    4096     512    0.01  cache
    actcache_planner        0.128     0.137     0.712    0.326    0.150    1.596    4096     512    0.02  cache
    actcache_off            0.199     0.202     1.047    0.272    0.198    2.127       0     128    0.00  recompute
    data_plane              0.017     0.020         -    0.264    0.093    0.517    2048     256    3.37  -
    ideal_host              0.107     0.112     0.580    0.201    0.109    1.250       0       0    0.04  -
    actcache_planner plan: cache depth 4 for every sample: measured 16.8 ms per step served from the cache vs ...
    raw LMDB read in process (data_plane's entries): 256 entries, 67.1 MB in 0.009 s = 7.08 GB/s
    (15 s for this configuration)
    figure: delivered_vs_raw = 0.475
    figure: recompute_overhead = 1.047
    figure: costmodel_vs_best = 0.981
    figure: served_gb_s = 0.019
    figure: cached_vs_ideal = 1.161
    figure: losses_equal = 1.000

Figures (per configuration; with several configurations each name ends in ``_<configuration>``):

- ``delivered_vs_raw``: served GB/s of ``data_plane`` / ``raw_lmdb_gb_s``;
- ``recompute_overhead``: ``actcache_off`` / ``plain`` (median epoch seconds);
- ``costmodel_vs_best``: ``actcache_planner`` / the faster of ``plain`` and the fixed caching row at the
  same store dtype (``actcache_default`` for float32, ``actcache_bf16`` for bfloat16), in seconds of the
  whole run (``run_s``: fill, warm-up and timed epochs, the run the planner was told of), as
  ``bench_costmodel.py`` counts the write epoch;
- ``served_gb_s``: GB/s delivered into the step by that fixed caching row;
- ``cached_vs_ideal``: that caching row / ``ideal_host`` (the ideal holds the same dtype);
- ``losses_equal`` (1 or 0): ``actcache_default``'s losses are ``plain``'s, bit for bit (float32 entries).
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import actcache_client as ac
from actcache.testing import run_daemon

SEED = 0
LABELS = 2
RAW_PASSES = 5  # passes of the in-process LMDB read loop (the median one is reported)

#: The issue's GPU configurations, and the small CPU one.
CONFIGS: dict[str, dict[str, Any]] = {
    "h1024": dict(hidden=1024, layers=24, frozen=20, sequences=8192, store_dtype="float32"),
    "h1024-bf16": dict(hidden=1024, layers=24, frozen=20, sequences=8192, store_dtype="bfloat16"),
    "h2048": dict(hidden=2048, layers=24, frozen=22, sequences=4096, store_dtype="bfloat16"),
    "quick": dict(hidden=64, layers=4, frozen=3, sequences=512, seq_len=32, store_dtype="float32"),
}
#: Rows per configuration (default: all): h1024-bf16 leaves out what h1024 measures, h2048 the float32 entries.
ALL_ROWS = ("plain", "actcache_default", "actcache_bf16", "actcache_planner", "actcache_off", "data_plane",
            "ideal_host", "ideal_device")
ROWS = {"h1024-bf16": ("plain", "actcache_bf16", "actcache_planner", "ideal_host", "ideal_device"),
        "h2048": tuple(r for r in ALL_ROWS if r != "actcache_default")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Tokens(Dataset):
    """Random token ids of varying length (padded with 0 to ``seq_len``), with random labels."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(SEED)
        self.input_ids = torch.randint(1000, vocab, (n, seq_len), generator=g)
        self.input_ids[:, 0] = 101  # [CLS]
        lengths = torch.randint(max(2, seq_len // 4), seq_len + 1, (n,), generator=g)
        self.attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        self.input_ids *= self.attention_mask
        self.targets = torch.randint(0, LABELS, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.targets[i]}


@dataclasses.dataclass
class Setup:
    """One configuration's sizes and where it trains."""

    name: str
    hidden: int
    layers: int
    frozen: int
    sequences: int
    seq_len: int
    batch: int
    store_dtype: str
    epochs: int
    device: torch.device
    plane_kib: int = 0  # data_plane's entry size (0: the hidden states' size, at least 256 KiB)

    def __post_init__(self) -> None:
        if not self.plane_kib:
            hidden_kib = self.seq_len * self.hidden * DTYPES[self.store_dtype].itemsize // 1024
            object.__setattr__(self, "plane_kib", max(256, hidden_kib))

    @property
    def plane_samples(self) -> int:
        """data_plane's samples: at most 256 MiB of entries on a GPU, 64 MiB on the CPU."""
        cap = (256 if self.device.type == "cuda" else 64) << 10
        return max(2 * self.batch, min(self.sequences, cap // self.plane_kib))

    @property
    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    @property
    def total_epochs(self) -> int:
        return self.epochs + 2  # fill, warm-up, timed

    def build(self) -> nn.Module:
        from transformers import BertConfig, BertForSequenceClassification

        torch.manual_seed(SEED)
        config = BertConfig(hidden_size=self.hidden, num_hidden_layers=self.layers,
                            num_attention_heads=max(1, self.hidden // 64), intermediate_size=4 * self.hidden,
                            max_position_embeddings=max(512, self.seq_len), num_labels=LABELS)
        with self.device:  # initialised where it trains: a 24-layer BERT-2048 takes seconds on a CPU
            return BertForSequenceClassification(config).train()

    def loader(self, data: Tokens) -> DataLoader:
        return DataLoader(data, batch_size=self.batch, shuffle=True, generator=torch.Generator().manual_seed(1),
                          pin_memory=self.device.type == "cuda")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)


class Row(abc.ABC):
    """One configuration's network, loader and optimizer, trained an epoch at a time."""

    bytes_per_epoch: Callable[[], int] | None = None
    opt: torch.optim.Optimizer  # set by each row

    def __init__(self, name: str, setup: Setup) -> None:
        self.name, self.setup = name, setup
        self.seconds: list[float] = []  # the timed epochs
        self.every: list[float] = []  # every epoch: fill, warm-up, timed
        self.losses: list[float] = []
        self.timed_hits = self.timed_bytes = 0
        self.cache: ac.ActCache | None = None

    def epoch(self, index: int, timed: bool) -> None:
        before = dataclasses.replace(self.cache.connection.stats) if self.cache is not None else None
        torch.manual_seed(1000 + index)  # the same dropout draws in every row
        _sync(self.setup.device)
        t0 = time.perf_counter()
        losses = self.run_epoch()
        _sync(self.setup.device)
        seconds = time.perf_counter() - t0
        self.losses += [loss.item() for loss in losses]
        self.every.append(seconds)
        if timed:
            self.seconds.append(seconds)
            if before is not None:
                after = self.cache.connection.stats
                self.timed_hits += after.hits - before.hits
                self.timed_bytes += after.bytes_read - before.bytes_read
            elif self.bytes_per_epoch is not None:
                self.timed_bytes += self.bytes_per_epoch()

    @abc.abstractmethod
    def run_epoch(self) -> list[torch.Tensor]:
        """One epoch of the row's loop; the step losses, detached."""

    def learn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the cross-entropy of ``logits``; the loss, detached."""
        loss = nn.functional.cross_entropy(logits.float(), labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def report(self) -> dict[str, Any]:
        plan = self.cache.model.plan if self.cache is not None else None
        stats = self.cache.connection.stats if self.cache is not None else None
        return {
            "epoch_s": self.seconds, "best_s": min(self.seconds), "median_s": statistics.median(self.seconds),
            "fill_s": self.every[0], "warmup_s": self.every[1], "run_s": sum(self.every),
            "hits": self.timed_hits, "gb_s": self.timed_bytes / sum(self.seconds) / 1e9 if self.timed_bytes else 0.0,
            "puts": stats.puts if stats is not None else 0,
            "plan_mode": None if plan is None else plan.mode.value,
            "plan_reason": None if plan is None else plan.reason,
            "losses": self.losses,
        }


class LoopRow(Row):
    """The user's loop over a (wrapped or plain) DataLoader calling the user's network."""

    def __init__(self, name: str, setup: Setup, data: Tokens, cache_options: dict[str, Any] | None,
                 frozen_stages: int, daemon=None) -> None:
        super().__init__(name, setup)
        self.net = setup.build()
        loader = setup.loader(data)
        if cache_options is None:  # the plain loop: frozen by hand, recomputed every step
            bert = self.net.bert
            for module in (bert.embeddings, *bert.encoder.layer[: frozen_stages - 1]):
                module.requires_grad_(False).eval()
            self.loader = loader
        else:
            connection = ac.connect(daemon.socket, namespace=f"bench-backbone-{name}", strict=True)
            self.cache = ac.ActCache(self.net, connection, **cache_options)
            self.loader = self.cache.wrap(loader)
            self.cache.freeze(frozen_stages)
        self.opt = _optimizer(self.net)

    def run_epoch(self) -> list[torch.Tensor]:
        device, losses = self.setup.device, []
        for batch in self.loader:
            ids = batch["input_ids"].to(device, non_blocking=True)
            mask = batch["attention_mask"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with self.setup.autocast:
                logits = self.net(input_ids=ids, attention_mask=mask).logits
            losses.append(self.learn(logits, labels))
        return losses


class IdealRow(Row):
    """The frozen prefix's outputs held in memory (host or device), only the top trained."""

    def __init__(self, name: str, setup: Setup, data: Tokens, frozen_stages: int, on_device: bool) -> None:
        from actcache_client.layouts._stages import from_transformers

        super().__init__(name, setup)
        self.net = setup.build()
        bert = self.net.bert
        for module in (bert.embeddings, *bert.encoder.layer[: frozen_stages - 1]):
            module.requires_grad_(False).eval()
        self.staged, self.k = from_transformers(self.net), frozen_stages
        device, dtype = setup.device, DTYPES[setup.store_dtype]
        self.loader = setup.loader(data)
        hidden = torch.empty((len(data), setup.seq_len, setup.hidden), dtype=dtype,
                             pin_memory=device.type == "cuda" and not on_device,
                             device=device if on_device else "cpu")
        with torch.no_grad(), setup.autocast:
            for lo in range(0, len(data), setup.batch):
                ids = data.input_ids[lo: lo + setup.batch].to(device)
                mask = data.attention_mask[lo: lo + setup.batch].to(device)
                hidden[lo: lo + len(ids)] = self.staged.run((ids, mask), 0, self.k)[0].to(dtype)
        self.hidden = hidden
        # a ring of two pinned slots: a slot is refilled once its copy to the device is done
        self.slots = [] if on_device else [
            torch.empty((setup.batch, *hidden.shape[1:]), dtype=dtype, pin_memory=device.type == "cuda")
            for _ in range(2)]
        self.copied = [torch.cuda.Event() if device.type == "cuda" else None for _ in self.slots]
        self.bytes_per_epoch = lambda: hidden.numel() * hidden.element_size()
        self.opt = _optimizer(self.net)

    def run_epoch(self) -> list[torch.Tensor]:
        device, losses = self.setup.device, []
        for step, ids in enumerate(self.loader.batch_sampler):
            index = torch.as_tensor(ids)
            if not self.slots:
                hidden = self.hidden.index_select(0, index.to(self.hidden.device))
            else:
                slot, copied = self.slots[step % 2], self.copied[step % 2]
                if copied is not None:
                    copied.synchronize()
                rows = slot[: len(ids)]
                torch.index_select(self.hidden, 0, index, out=rows)
                hidden = rows.to(device, non_blocking=True)
                if copied is not None:
                    copied.record()
            mask = self.loader.dataset.attention_mask[index].to(device, non_blocking=True)
            labels = self.loader.dataset.targets[index].to(device, non_blocking=True)
            with self.setup.autocast:
                logits = self.staged.run((hidden.float(), mask), self.k)
            losses.append(self.learn(logits, labels))
        return losses


class Planes(Dataset):
    """Per-sample float tensors of ``kib`` KiB (``(rows, 256)`` float32) and labels; ``targets`` lets the
    wrapped loader skip loading the inputs the cache serves."""

    def __init__(self, n: int, kib: int) -> None:
        g = torch.Generator().manual_seed(SEED)
        self.inputs = torch.randn(n, max(1, kib * 1024 // (256 * 4)), 256, generator=g)
        self.targets = torch.randint(0, LABELS, (n,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.inputs[i], self.targets[i]


class _Lift(nn.Module):
    """The frozen stage: its output is the input, copied (what the cache stores)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


class _FirstPosition(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, LABELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x[:, 0].float())


class PlaneRow(Row):
    """``data_plane``: entries served into a step whose own work is a linear head (module docstring)."""

    def __init__(self, name: str, setup: Setup, daemon) -> None:
        super().__init__(name, setup)
        torch.manual_seed(SEED)
        self.net = nn.Sequential(_Lift(), _FirstPosition()).to(setup.device)
        connection = ac.connect(daemon.socket, namespace=f"bench-backbone-{name}", strict=True)
        store = DTYPES[setup.store_dtype]
        self.cache = ac.ActCache(self.net, connection, planner=None,
                                 **({} if store is torch.float32 else {"store_dtype": store}))
        data = Planes(setup.plane_samples, setup.plane_kib)
        self.loader = self.cache.wrap(DataLoader(data, batch_size=setup.batch, shuffle=True,
                                                 generator=torch.Generator().manual_seed(1)))
        self.cache.freeze(1)
        self.opt = _optimizer(self.net)

    def run_epoch(self) -> list[torch.Tensor]:
        device, losses = self.setup.device, []
        for x, y in self.loader:
            losses.append(self.learn(self.net(x.to(device, non_blocking=True)), y.to(device)))
        return losses


def make_row(name: str, setup: Setup, data: Tokens, daemon) -> Row:
    k, store = setup.frozen + 1, DTYPES[setup.store_dtype]
    if name == "plain":
        return LoopRow(name, setup, data, None, k)
    if name.startswith("ideal_"):
        return IdealRow(name, setup, data, k, on_device=name == "ideal_device")
    if name == "data_plane":
        return PlaneRow(name, setup, daemon)
    options: dict[str, Any] = {
        "actcache_default": {},
        "actcache_bf16": {"store_dtype": torch.bfloat16},
        "actcache_planner": {"store_dtype": store,
                             "planner": ac.CachePlanner(ac.PlannerConfig(total_epochs=setup.total_epochs))},
        "actcache_off": {"store_dtype": store, "planner": ac.CachePlanner(ac.PlannerConfig(min_gain=1.0))},
    }[name]
    if options.get("store_dtype") is torch.float32:
        del options["store_dtype"]  # the default
    return LoopRow(name, setup, data, options, k, daemon)


def raw_lmdb_gb_s(directory: Path, namespace: str) -> dict[str, float]:
    """Every entry of ``namespace`` read in this process from the daemon's LMDB: get, checksum and decode
    (``decode_entry``), copy into a buffer; GB/s of stored bytes (as ``ClientStats.bytes_read``), the
    median of ``RAW_PASSES`` passes over them all."""
    import lmdb

    from actcache.codec import decode_entry

    env = lmdb.open(str(directory), readonly=True, lock=False, max_dbs=8)
    try:
        with env.begin(db=env.open_db(b"namespaces", create=False)) as txn:
            ns = txn.get(namespace.encode())
        if ns is None:
            return {"gb_s": 0.0, "entries": 0, "bytes": 0, "seconds": 0.0}
        prefix = bytes(ns)[:4]
        entries = env.open_db(b"entries", create=False)
        out = np.empty(0, dtype=np.uint8)
        passes = []  # (seconds, bytes, entries) of each pass; the median pass is reported
        for _ in range(RAW_PASSES):
            nbytes = count = 0
            t0 = time.perf_counter()
            with env.begin(db=entries, buffers=True) as txn:
                cursor = txn.cursor()
                found = cursor.set_range(prefix)
                while found and bytes(cursor.key()[:4]) == prefix:
                    value = cursor.value()
                    _, raw = decode_entry(value)
                    if len(out) < len(raw):
                        out = np.empty(len(raw), dtype=np.uint8)
                    out[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
                    nbytes += len(value)
                    count += 1
                    found = cursor.next()
            passes.append((time.perf_counter() - t0, nbytes, count))
        seconds, nbytes, count = sorted(passes)[len(passes) // 2]
    finally:
        env.close()
    return {"gb_s": nbytes / seconds / 1e9 if seconds > 0 else 0.0, "entries": count, "bytes": nbytes,
            "seconds": seconds}


def run_config(setup: Setup, rows: tuple[str, ...]) -> dict[str, Any]:
    """Every row of one configuration, taking turns epoch by epoch; their reports and the figures."""
    data = Tokens(setup.sequences, setup.seq_len, vocab=30522)
    with run_daemon() as daemon:
        built: dict[str, Row] = {}
        try:
            for name in rows:
                if name == "ideal_device" and not _fits_on_device(setup):
                    print(f"ideal_device: skipped, {_hidden_bytes(setup) / 2**30:.1f} GiB of outputs do not fit in a "
                          "third of the device's free memory")
                    continue
                built[name] = make_row(name, setup, data, daemon)
            order = list(built.values())
            for epoch in range(setup.total_epochs):  # fill, warm-up, timed
                turn = epoch % len(order)
                for row in order[turn:] + order[:turn]:
                    row.epoch(epoch, timed=epoch >= 2)
            raw = raw_lmdb_gb_s(daemon.dir, "bench-backbone-data_plane") if "data_plane" in built else None
            reports = {name: row.report() for name, row in built.items()}
        finally:
            for row in built.values():
                row.close()
    return {"setup": {**dataclasses.asdict(setup), "device": str(setup.device)}, "rows": reports,
            "raw_lmdb": raw, "figures": figures(setup, reports, raw)}


def _hidden_bytes(setup: Setup) -> int:
    return setup.sequences * setup.seq_len * setup.hidden * DTYPES[setup.store_dtype].itemsize


def _fits_on_device(setup: Setup) -> bool:
    if setup.device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(setup.device)
    return _hidden_bytes(setup) < free / 3


def figures(setup: Setup, rows: dict[str, dict[str, Any]], raw: dict[str, float] | None) -> dict[str, float]:
    """The figures of the module docstring, where their rows ran."""
    out: dict[str, float] = {}
    median = {name: r["median_s"] for name, r in rows.items()}
    caching = "actcache_default" if setup.store_dtype == "float32" else "actcache_bf16"
    if raw and raw["gb_s"] > 0 and "data_plane" in rows:
        out["delivered_vs_raw"] = rows["data_plane"]["gb_s"] / raw["gb_s"]
    if "actcache_off" in median and "plain" in median:
        out["recompute_overhead"] = median["actcache_off"] / median["plain"]
    if "actcache_planner" in median and "plain" in median and caching in median:  # whole runs, fill included
        run = {name: r["run_s"] for name, r in rows.items()}
        out["costmodel_vs_best"] = run["actcache_planner"] / min(run["plain"], run[caching])
    if caching in rows:
        out["served_gb_s"] = rows[caching]["gb_s"]
        if "ideal_host" in median:
            out["cached_vs_ideal"] = median[caching] / median["ideal_host"]
    if "actcache_default" in rows and "plain" in rows:
        out["losses_equal"] = float(rows["actcache_default"]["losses"] == rows["plain"]["losses"])
    return out


FIGURES = ("delivered_vs_raw", "recompute_overhead", "costmodel_vs_best", "served_gb_s", "cached_vs_ideal",
           "losses_equal")


def print_config(result: dict[str, Any]) -> None:
    s, rows = result["setup"], result["rows"]
    print(f"BERT hidden {s['hidden']}, {s['layers']} layers, embeddings + {s['frozen']} frozen "
          f"({s['frozen'] + 1} stages), {s['sequences']} sequences x {s['seq_len']} tokens, batch {s['batch']}, "
          f"AdamW, {s['epochs']} timed epochs after fill and warm-up, entries {s['store_dtype']}, on {s['device']}")
    print(f"{'row':<20}{'best_s':>9}{'median_s':>10}{'vs_plain':>10}{'fill_s':>9}{'warm_s':>9}{'run_s':>9}"
          f"{'hits':>8}{'puts':>8}{'GB/s':>8}  plan")
    plain = rows.get("plain", {}).get("median_s")
    for name, r in rows.items():
        ratio = f"{r['median_s'] / plain:>10.3f}" if plain and name != "data_plane" else f"{'-':>10}"
        print(f"{name:<20}{r['best_s']:>9.3f}{r['median_s']:>10.3f}{ratio}{r['fill_s']:>9.3f}{r['warmup_s']:>9.3f}"
              f"{r['run_s']:>9.3f}{r['hits']:>8}{r['puts']:>8}{r['gb_s']:>8.2f}  {r['plan_mode'] or '-'}")
    for name, r in rows.items():
        if r["plan_reason"]:
            print(f"{name} plan: {r['plan_reason']}")
    raw = result["raw_lmdb"]
    if raw:
        print(f"raw LMDB read in process (data_plane's entries): {raw['entries']} entries, "
              f"{raw['bytes'] / 1e6:.1f} MB in {raw['seconds']:.3f} s = {raw['gb_s']:.2f} GB/s")
    print(f"({result['wall_s']:.0f} s for this configuration)\n", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the CPU-small configuration (under half a minute on 2 cores)")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS),
                        help="named configurations (default: h1024 h1024-bf16 h2048 on cuda, else the flags)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--frozen", type=int, default=6, help="encoder layers frozen (plus the embeddings)")
    parser.add_argument("--sequences", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--store-dtype", choices=sorted(DTYPES), default="float32",
                        help="entries of the planner, recompute and data-plane rows, and of the ideal's outputs")
    parser.add_argument("--epochs", type=int, default=None, help="timed epochs after the fill and warm-up "
                        "(default 2 on the GPU configurations, 5 on --quick, 3 otherwise)")
    parser.add_argument("--rows", nargs="+", choices=ALL_ROWS, help="rows to run (default: the configuration's)")
    parser.add_argument("--plane-kib", type=int, default=0,
                        help="data_plane's entry size in KiB (default: the hidden states', at least 256)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: 1 on the CPU, where the rows share a few cores; torch's on cuda)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device on this machine")
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    names = args.configs or (["quick"] if args.quick else ["h1024", "h1024-bf16", "h2048"] if args.device == "cuda"
                             else [])
    flags = dict(hidden=args.hidden, layers=args.layers, frozen=args.frozen, sequences=args.sequences,
                 seq_len=args.seq_len, store_dtype=args.store_dtype)
    setups = []
    for name in names or ["custom"]:
        given = {**flags, **CONFIGS.get(name, {})}
        if not 0 < given["frozen"] < given["layers"]:
            parser.error(f"--frozen must be between 1 and layers - 1 ({given['layers'] - 1}), got {given['frozen']}")
        epochs = args.epochs or {"quick": 5}.get(name, 2 if name in CONFIGS else 3)
        setups.append(Setup(name=name, batch=args.batch, epochs=epochs, device=device, plane_kib=args.plane_kib,
                            **given))
    with ExitStack() as stack:  # nothing here reaches a daemon other than the bench's own
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-backbone-"))
        os.environ["ACTCACHE_DIR"] = tmp
        results = {}
        for setup in setups:
            rows = tuple(args.rows or ROWS.get(setup.name, ALL_ROWS))
            if device.type != "cuda":
                rows = tuple(r for r in rows if r != "ideal_device")
            t0 = time.perf_counter()
            results[setup.name] = run_config(setup, rows)
            results[setup.name]["wall_s"] = time.perf_counter() - t0
            print_config(results[setup.name])
            flat = {}
            for name, result in results.items():
                for figure, value in result["figures"].items():
                    flat[figure if len(setups) == 1 else f"{figure}_{name.replace('-', '_')}"] = value
            if args.json:  # after each configuration: a run cut short keeps what it measured
                args.json.write_text(json.dumps({"configs": results, "figures": flat}, indent=2))
    for figure, value in flat.items():
        print(f"figure: {figure} = {value:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
