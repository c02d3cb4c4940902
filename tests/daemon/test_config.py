"""Daemon configuration from flags > ACTCACHE_* env > defaults."""

import os

import pytest

from actcache.daemon.config import DaemonConfig, PrefetchConfig
from actcache.errors import ConfigError


def test_prefetch_settings_from_flags_env_and_defaults(tmp_path):
    cfg = DaemonConfig.from_sources({"dir": tmp_path, "socket": tmp_path / "s"}, env={})
    assert cfg.prefetch.prefetch_bytes == 512 << 20
    assert cfg.prefetch.decode_threads == len(os.sched_getaffinity(0))
    assert cfg.store.explicit_reads is True
    env = {"ACTCACHE_PREFETCH_BYTES": "64MiB", "ACTCACHE_DECODE_THREADS": "3", "ACTCACHE_EXPLICIT_READS": "0"}
    cfg = DaemonConfig.from_sources({"dir": tmp_path, "socket": tmp_path / "s", "decode_threads": 5}, env=env)
    assert (cfg.prefetch.prefetch_bytes, cfg.prefetch.decode_threads, cfg.store.explicit_reads) == (64 << 20, 5, False)
    assert cfg.non_defaults()["prefetch_bytes"] == 64 << 20
    assert "probe_threads" not in cfg.non_defaults()


@pytest.mark.parametrize("flags, message", [
    ({"prefetch_bytes": "100KiB"}, "prefetch_bytes must be at least 1 MiB"),
    ({"decode_threads": 0}, "decode_threads must be >= 1"),
    ({"prefetch_bytes": "16MiB", "max_entry_bytes": "32MiB"}, "is below --max-entry-bytes"),
])
def test_bad_prefetch_settings_are_named(tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        DaemonConfig.from_sources({"dir": tmp_path, "socket": tmp_path / "s", **flags}, env={})


def test_prefetch_config_is_keyword_only():
    with pytest.raises(TypeError):
        PrefetchConfig(1 << 30)  # type: ignore[misc]


def test_reclaim_after_from_flags_env_and_default(tmp_path):
    base = {"dir": tmp_path, "socket": tmp_path / "s"}
    assert DaemonConfig.from_sources(base, env={}).store.reclaim_after_s == 600.0
    assert DaemonConfig.from_sources(base, env={"ACTCACHE_RECLAIM_AFTER": "0"}).store.reclaim_after_s == 0.0
    assert DaemonConfig.from_sources({**base, "reclaim_after": 30.0}, env={}).store.reclaim_after_s == 30.0
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(ConfigError, match="--reclaim-after must be a number of seconds"):
            DaemonConfig.from_sources(base, env={"ACTCACHE_RECLAIM_AFTER": bad})
