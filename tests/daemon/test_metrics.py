"""actcache.daemon.service._metrics: families read live state at scrape time; config of the endpoint."""

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from actcache.daemon.config import DaemonConfig, MetricsConfig, PrefetchConfig, StoreConfig
from actcache.daemon.prefetch import Prefetcher
from actcache.daemon.service._metrics import DaemonCollector, Family, daemon_families
from actcache.daemon.service._service import ActCacheService
from actcache.daemon.store import Store
from actcache.errors import ConfigError


def exposition(collector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_family_is_one_line_and_is_read_at_scrape_time():
    stalls = {("ns", "epoch-3"): 1.5}
    collector = DaemonCollector()
    collector.add(Family("actcache_prefetch_stall_seconds", "Seconds consumers waited", "counter",
                         lambda: stalls, labels=("namespace", "schedule")))
    collector.add(Family("actcache_ready_bytes", "Bytes read ahead", "gauge", lambda: 7))
    assert exposition(collector) == {
        ("actcache_prefetch_stall_seconds_total", (("namespace", "ns"), ("schedule", "epoch-3"))): 1.5,
        ("actcache_ready_bytes", ()): 7,
    }
    stalls[("ns", "epoch-3")] = 2.0
    assert exposition(collector)[("actcache_prefetch_stall_seconds_total", (("namespace", "ns"), ("schedule", "epoch-3")))] == 2.0
    with pytest.raises(ValueError, match="already registered"):
        collector.add(Family("actcache_ready_bytes", "again", "gauge", lambda: 0))


def test_every_counters_field_is_exported(tmp_path):
    store = Store(StoreConfig(dir=tmp_path))
    try:
        service = ActCacheService(store, Prefetcher(store, PrefetchConfig()), max_message_bytes=1 << 20)
        service.counters.add(hits_total=4, served_bytes_total=4096)
        got = exposition(DaemonCollector(daemon_families(store, service)))
        for name, value in service.counters.snapshot().items():
            assert got[(f"actcache_{name}", ())] == value
        assert got[("actcache_hits_total", ())] == 4
    finally:
        store.close()


def test_metrics_config_from_flags_env_and_defaults(tmp_path):
    flags = {"dir": str(tmp_path), "socket": str(tmp_path / "s")}
    assert DaemonConfig.from_sources(flags, env={}).metrics == MetricsConfig()
    from_env = DaemonConfig.from_sources(flags, env={"ACTCACHE_METRICS_PORT": "9100"}).metrics
    assert (from_env.port, from_env.host) == (9100, "127.0.0.1")
    cfg = DaemonConfig.from_sources({**flags, "metrics_port": 0, "metrics_host": "0.0.0.0"},
                                    env={"ACTCACHE_METRICS_PORT": "9100"})
    assert (cfg.metrics.port, cfg.metrics.host) == (0, "0.0.0.0")
    assert cfg.non_defaults()["port"] == 0
    with pytest.raises(ConfigError, match="0..65535"):
        MetricsConfig(port=70000)
    with pytest.raises(ConfigError, match="must be a number"):
        DaemonConfig.from_sources(flags, env={"ACTCACHE_METRICS_PORT": "nine"})
