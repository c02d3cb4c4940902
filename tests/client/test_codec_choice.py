"""The per-(fingerprint, depth) codec choice: measured ratios and decode costs, the page cache, the margin."""

from __future__ import annotations

import pytest
import torch

from actcache.errors import ConfigError, ConfigTypeError
from actcache_client import AutoEncoding, CachedForward, from_sequential
from actcache_client.engine._codec_choice import choose_encoding, choose_unmeasured, measure_codecs
from actcache_client.transport._tensors import encode_samples

SLOW_DISK = 1e8  # 100 MB/s: reading dominates any decoder's cost


def relu_maps() -> list[bytes]:
    """128 entries of 16 KiB, three quarters zeros, like a conv stage's ReLU output."""
    g = torch.Generator().manual_seed(0)
    return encode_samples(torch.relu(torch.randn(128, 16, 16, 16, generator=g) - 0.7))


def gaussian_states() -> list[bytes]:
    """128 entries of 16 KiB of normally distributed floats, like a transformer's hidden states."""
    g = torch.Generator().manual_seed(0)
    return encode_samples(torch.randn(128, 16, 256, generator=g))


def test_sparse_maps_read_from_disk_are_stored_compressed():
    choice = choose_encoding(relu_maps(), samples=None, config=AutoEncoding(disk_read_bytes_per_s=SLOW_DISK))
    assert choice.encoding in ("lz4", "zstd")
    assert choice.numbers[f"{choice.encoding}_ratio"] > 2
    assert choice.numbers["raw_cold_share"] == 1.0  # unknown dataset size: judged as read from disk
    assert choice.numbers[f"{choice.encoding}_serve_s_per_gb"] < 0.9 * choice.numbers["raw_serve_s_per_gb"]


def test_states_that_do_not_compress_stay_raw():
    choice = choose_encoding(gaussian_states(), samples=None, config=AutoEncoding(disk_read_bytes_per_s=SLOW_DISK))
    assert choice.encoding == "raw"
    assert choice.numbers["lz4_ratio"] < 1.1
    assert choice.reason.startswith("raw: no codec serves 10% faster")


def test_entries_that_fit_in_the_page_cache_stay_raw():
    entries = relu_maps()
    raw_total = 1000 * len(entries[0])
    fits = choose_encoding(entries, samples=1000, config=AutoEncoding(disk_read_bytes_per_s=SLOW_DISK,
                                                                     page_cache_bytes=2 * raw_total))
    assert fits.encoding == "raw" and fits.numbers["raw_cold_share"] == 0.0
    assert "fit in the page cache" in fits.reason and "lz4_ratio" not in fits.numbers  # chosen without measuring
    half = choose_encoding(entries, samples=1000, config=AutoEncoding(disk_read_bytes_per_s=SLOW_DISK,
                                                                     page_cache_bytes=raw_total / 2))
    assert half.numbers["raw_cold_share"] == pytest.approx(0.5)
    assert half.encoding != "raw"  # compressed, the whole depth fits in memory: only raw reads the disk
    assert half.numbers[f"{half.encoding}_cold_share"] == 0.0


def test_the_choice_needs_no_entries_when_they_fit_in_the_page_cache():
    config = AutoEncoding(page_cache_bytes=1e6)
    fits = choose_unmeasured(1000, samples=1000, config=config)  # 1 MB: fits
    assert fits is not None and fits.encoding == "raw" and fits.numbers["raw_cold_share"] == 0.0
    assert choose_unmeasured(1001, samples=1000, config=config) is None  # over: the codecs are measured
    assert choose_unmeasured(1, samples=None, config=config) is None  # the dataset's size unknown


def test_the_measurement_compresses_each_entry_and_stops_at_the_sample_size():
    entries = relu_maps()
    readings = measure_codecs(entries, ("lz4",), sample_bytes=4 * len(entries[0]))
    assert readings["raw"].ratio == 1.0
    assert readings["lz4"].ratio > 2 and readings["lz4"].decode_s_per_byte > 0


@pytest.mark.parametrize("options, message", [
    ({"candidates": ("raw",)}, "raw is always compared"),
    ({"candidates": ("brotli",)}, "unknown encoding 'brotli'"),
    ({"disk_read_bytes_per_s": 0}, "actcache bench disk"),
    ({"min_gain": 1.0}, "min_gain"),
    ({"page_cache_bytes": -1}, "page_cache_bytes"),
])
def test_bad_knobs_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        AutoEncoding(**options)


def test_cached_forward_checks_its_encoding():
    staged = from_sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), groups=[1, 1])
    for good in ("auto", "daemon", "raw", "lz4", "zstd:-3", AutoEncoding(min_gain=0.2)):
        CachedForward(staged, encoding=good)
    assert isinstance(CachedForward(staged).encoding, AutoEncoding)
    with pytest.raises(ConfigError, match="encoding='zip'"):
        CachedForward(staged, encoding="zip")
    with pytest.raises(ConfigTypeError, match="str or an AutoEncoding, got int 3"):
        CachedForward(staged, encoding=3)
