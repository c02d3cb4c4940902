"""Codecs and checksums on the benchmark workloads' own activations: ratio and CPU-s per GB, one core.

    python bench/bench_codec.py [--quick] [--data-dir ../shared/data]

Entries are what the cache stores: one sample's state each, from
ResNet-20 (untrained, on CIFAR-10 JPEGs) after the stem, after 4 blocks and
after 9 blocks (post-ReLU maps), and from MiniLM (all-MiniLM-L6-v2, on SST-2
sentences, unpadded) after the embeddings and after 3 encoder layers, each
in fp32, fp16 and bf16. Per codec: compression ratio (raw bytes / stored
bytes) and the process CPU seconds per GB of raw bytes to compress and to
decompress, called once per entry as the store does. Per checksum: CPU-s
per GB. Figures:

    figure: zstd1_ratio_relu = R           (ResNet-20 maps, fp32)
    figure: zstd1_ratio_transformer = R    (MiniLM states, fp32)
    figure: lz4_decode_vs_zstd1 = R        (zstd-1 decode CPU-s/GB / lz4's, ResNet-20 maps)
    figure: lz4_ratio_relu = R             (ResNet-20 maps, fp32)
    figure: xxh3_vs_crc32 = R              (zlib CRC32 CPU-s/GB / xxh3's)

Then the codec ``CachedForward(encoding="auto")`` chooses for each fp32 state
(actcache_client.engine._codec_choice: measured ratio and verify-and-decode cost
against the disk's speed and the page cache), on a cold 1 GB/s disk, a cold
200 MB/s disk, and with the entries in the page cache.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads.data import JpegSet, read_glue, resolve_data_dir, tokenize  # noqa: E402

import actcache_client as ac  # noqa: E402
from actcache.codec import CHECKSUMS, Codec, Encoding, compress_payload, decompress_payload, parse_header  # noqa: E402
from actcache_client.engine._codec_choice import choose_encoding
from actcache_client.models import resnet20  # noqa: E402
from actcache_client.transport._tensors import VarLen, encode_samples

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resnet_states(data_dir: Path, samples: int) -> dict[str, torch.Tensor]:
    """Per-sample ResNet-20 states after the stem, 4 blocks and 9 blocks."""
    torch.manual_seed(0)
    staged = ac.from_resnet(resnet20()).eval()
    images = JpegSet(data_dir, "train", limit=samples)
    x = torch.stack([images[i][0] for i in range(samples)])
    out = {}
    with torch.no_grad():
        state, done = x, 0
        for depth in (1, 5, 10):
            state = staged.run(state, done, depth)
            done = depth
            out[f"resnet20@{depth} {tuple(state.shape[1:])}"] = state.clone()
    return out


def minilm_states(data_dir: Path, samples: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-sample MiniLM states (hidden, mask) after the embeddings and after 3 encoder layers."""
    from actcache_client.bert import load_minilm

    model, tokenizer = load_minilm()
    staged = ac.from_bert(model.eval())
    sentences, _ = read_glue(data_dir, "sst2", "train")
    ids = tokenize(tokenizer, sentences[:samples])
    longest = max(len(t) for t in ids)
    input_ids = torch.zeros(len(ids), longest, dtype=torch.int64)
    mask = torch.zeros(len(ids), longest, dtype=torch.int64)
    for row, t in enumerate(ids):
        input_ids[row, : len(t)], mask[row, : len(t)] = t, 1
    out = {}
    with torch.no_grad():
        state, done = (input_ids, mask), 0
        for depth in (1, 4):
            state = staged.run(state, done, depth)
            done = depth
            out[f"minilm@{depth} (L, 384)"] = (state[0].clone(), state[1].clone())
    return out


def entries_of(state, dtype: torch.dtype) -> list[bytes]:
    """Uncompressed entries, one per sample (MiniLM: the real tokens only, as VarLen stores them)."""
    if isinstance(state, tuple):
        return encode_samples((state[0].to(dtype), state[1]), varlen=VarLen())
    return encode_samples(state.to(dtype))


CODECS = {"none": Encoding(), "zstd-5": Encoding(Codec.zstd, -5), "zstd-1": Encoding(Codec.zstd, -1),
          "zstd1": Encoding(Codec.zstd, 1), "zstd3": Encoding(Codec.zstd, 3), "lz4": Encoding(Codec.lz4)}


def cpu_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Process CPU seconds per call of ``fn`` (best of ``repeat``: the least disturbed)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def measure(payloads: list[memoryview], repeat: int) -> dict[str, dict[str, float]]:
    """Per codec: ratio, compress and decompress CPU-s per GB of raw bytes."""
    raw = sum(p.nbytes for p in payloads)
    rows = {}
    for name, encoding in CODECS.items():
        stored = [compress_payload(encoding, p) for p in payloads]
        sizes = [p.nbytes for p in payloads]
        views = [memoryview(s) for s in stored]
        assert all(bytes(decompress_payload(encoding.codec, v, n)) == bytes(p) for v, n, p in zip(views[:8], sizes, payloads))
        c = cpu_seconds(lambda encoding=encoding: [compress_payload(encoding, p) for p in payloads], repeat)
        pairs = list(zip(views, sizes))
        d = cpu_seconds(lambda codec=encoding.codec, pairs=pairs: [decompress_payload(codec, v, n) for v, n in pairs], repeat)
        rows[name] = {"ratio": raw / sum(len(s) for s in stored), "compress": c / raw * 1e9, "decompress": d / raw * 1e9}
    return rows


REGIMES = {"cold 1 GB/s": ac.AutoEncoding(page_cache_bytes=0),
           "cold 200 MB/s": ac.AutoEncoding(disk_read_bytes_per_s=2e8, page_cache_bytes=0),
           "page cache": ac.AutoEncoding(page_cache_bytes=float("inf"))}


def print_choices(states: dict[str, list[bytes]]) -> None:
    """The automatic codec choice per fp32 state and regime, with the serve cost it expects (s/GB)."""
    print("\nencoding=\"auto\" per fp32 state: chosen codec (expected serve CPU+disk s/GB: raw / lz4 / zstd)")
    print(f"{'state':<28}" + "".join(f"{regime:>30}" for regime in REGIMES))
    for name, entries in states.items():
        cells = []
        for config in REGIMES.values():
            c = choose_encoding(entries, samples=len(entries), config=config)
            costs = " / ".join(f"{c.numbers[f'{n}_serve_s_per_gb']:.2f}" for n in ("raw", "lz4", "zstd"))
            cells.append(f"{c.encoding} ({costs})")
        print(f"{name:<28}" + "".join(f"{cell:>30}" for cell in cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 images and 256 sentences, 3 repeats")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    if args.quick:
        args.samples, args.repeat = 256, 3
    torch.set_num_threads(1)
    data_dir = resolve_data_dir(args.data_dir)
    states: dict = {**resnet_states(data_dir, args.samples), **minilm_states(data_dir, args.samples)}
    print(f"{args.samples} samples per state, one core, CPU-s per GB of raw bytes (best of {args.repeat})")
    print(f"{'state':<28}{'dtype':<6}{'entry':>9}{'codec':>9}{'ratio':>8}{'comp s/GB':>11}{'dec s/GB':>10}")
    table: dict[tuple[str, str], dict] = {}
    checksum_inputs: list[memoryview] = []
    for name, state in states.items():
        for dtype_name, dtype in DTYPES.items():
            entries = entries_of(state, dtype)
            header = parse_header(entries[0]).header_len
            payloads = [memoryview(e)[header:] for e in entries]
            if dtype_name == "fp32":
                checksum_inputs.extend(payloads)
            rows = measure(payloads, args.repeat)
            table[(name, dtype_name)] = rows
            mean = sum(p.nbytes for p in payloads) // len(payloads)
            for codec, r in rows.items():
                print(f"{name:<28}{dtype_name:<6}{mean:>9}{codec:>9}{r['ratio']:>8.2f}{r['compress']:>11.3f}{r['decompress']:>10.3f}")
    total = sum(p.nbytes for p in checksum_inputs)
    print(f"\nchecksums over the fp32 entries ({total / 2**20:.0f} MiB, one call per entry)")
    speeds = {}
    for name, fn in CHECKSUMS.items():
        speeds[name] = cpu_seconds(lambda fn=fn: [fn(p) for p in checksum_inputs], args.repeat) / total * 1e9
        print(f"{name:<8}{speeds[name]:>8.3f} CPU-s/GB  ({1 / speeds[name]:.1f} GB/s)")
    relu = [r for (n, d), r in table.items() if n.startswith("resnet20") and d == "fp32"]
    text = [r for (n, d), r in table.items() if n.startswith("minilm") and d == "fp32"]
    figures = {
        "zstd1_ratio_relu": sum(r["zstd1"]["ratio"] for r in relu) / len(relu),
        "zstd1_ratio_transformer": sum(r["zstd1"]["ratio"] for r in text) / len(text),
        "lz4_decode_vs_zstd1": sum(r["zstd1"]["decompress"] for r in relu) / sum(r["lz4"]["decompress"] for r in relu),
        "lz4_ratio_relu": sum(r["lz4"]["ratio"] for r in relu) / len(relu),
        "xxh3_vs_crc32": speeds["crc32"] / speeds["xxh3"],
    }
    print_choices({name: entries_of(state, torch.float32) for name, state in states.items()})
    print()
    for name, value in figures.items():
        print(f"figure: {name} = {value:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
