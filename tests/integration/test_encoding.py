"""The client's codec choice reaches the daemon: entries stored as chosen, served back exactly."""

from __future__ import annotations

import uuid

import pytest

import actcache_client as ac
from tests.integration.test_store_dtype import N, train

# Every read from a 10 MB/s disk: the disk decides, not the per-entry cost of decoding these small
# entries (at 100 MB/s lz4 came out 9.6% faster than raw on a loaded machine, under the 10% rule).
COLD = ac.AutoEncoding(disk_read_bytes_per_s=1e7, page_cache_bytes=0)


def stored_bytes(daemon, namespace: str) -> int:
    with daemon.client() as client:
        return sum(g.bytes for g in client.stats().groups if g.namespace == namespace)


@pytest.mark.slow
def test_the_chosen_codec_stores_relu_outputs_compressed_and_training_is_unchanged(daemon):
    off = train(None)[0]
    sizes = {}
    for encoding in (COLD, "raw"):
        namespace = f"t-{uuid.uuid4().hex[:8]}"
        with ac.connect(daemon.socket, namespace=namespace, strict=True) as conn:
            on, model = train(conn, encoding=encoding)
            sent = conn.stats.bytes_written
        assert max(abs(a - b) for a, b in zip(off, on)) <= 1e-5
        assert [e.times.cached_samples for e in model.epoch_counters()] == [0, N]
        sizes[encoding if isinstance(encoding, str) else "auto"] = (stored_bytes(daemon, namespace), sent)
    (auto_stored, auto_sent), (raw_stored, raw_sent) = sizes["auto"], sizes["raw"]
    assert auto_sent == raw_sent == raw_stored  # entries travel raw; "raw" keeps them so
    assert auto_stored < 0.8 * raw_stored  # about half the ReLU outputs are zeros: a codec was chosen


def test_entries_that_fit_in_the_page_cache_stay_raw(daemon):
    warm = ac.AutoEncoding(disk_read_bytes_per_s=1e7, page_cache_bytes=float(1 << 40))
    for encoding, expected in ((COLD, ("lz4", "zstd")), (warm, ("raw",))):
        with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
            _, model = train(conn, epochs=1, encoding=encoding)
        choice = model.encoding_choice(2)
        assert choice is not None and choice.encoding in expected, choice
        assert choice.numbers["raw_cold_share"] == (1.0 if encoding is COLD else 0.0)
        assert model.encoding_choice(1) is None  # nothing was written at depth 1


def test_a_failed_measurement_leaves_the_choice_to_the_daemon_and_stores_everything(daemon, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("psutil could not read the memory")

    monkeypatch.setattr("actcache_client.engine._codec_choice.psutil.virtual_memory", broken)
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        _, model = train(conn)
        assert conn.stats.puts == N and conn.stats.hits == N
    choice = model.encoding_choice(2)
    assert choice.encoding == "" and "measuring the codecs failed" in choice.reason
