"""Prometheus metrics of the daemon, read from its live state at each scrape, so they always equal
``actcache stats``. Names are in base units (bytes, seconds); the only label is ``namespace``."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Literal, Mapping

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from actcache import __version__
from actcache.daemon.config import MetricsConfig
from actcache.errors import ConfigError

if TYPE_CHECKING:
    from actcache.daemon.service._service import ActCacheService
    from actcache.daemon.store import Store

__all__ = ["DaemonCollector", "Family", "MetricsEndpoint", "daemon_families"]

Value = float | int
Reading = Value | Mapping[tuple[str, ...], Value]

_COUNTER_HELP = {
    "puts_total": "Entries stored by Put calls",
    "put_bytes_total": "Bytes received by Put calls (entries as sent, before compression)",
    "gets_total": "Get calls answered",
    "hits_total": "Entries found by Get calls",
    "misses_total": "Entries asked for by Get calls and not stored",
    "served_bytes_total": "Bytes of entries sent to clients",
    "corrupt_total": "Stored entries that failed their checksum on read (and were deleted)",
    "rings_created_total": "Shared-memory rings made for Fetch calls",
    "rings_reused_total": "Fetch calls served in the shared-memory ring of their client's previous Fetch",
    "put_segments_total": "Shared-memory segments made for PutShared calls",
}


@dataclass(frozen=True)
class Family:
    """One metric family: ``read()`` returns its value, or ``{label values: value}`` when it has ``labels``."""

    name: str
    help: str
    kind: Literal["counter", "gauge"]
    read: Callable[[], Reading]
    labels: tuple[str, ...] = ()


class DaemonCollector:
    """A prometheus_client collector that turns ``Family`` rows into metrics at scrape time."""

    def __init__(self, families: Iterable[Family] = ()) -> None:
        self._families: list[Family] = []
        for family in families:
            self.add(family)

    def add(self, family: Family) -> None:
        """Register ``family`` (before the collector is scraped)."""
        if any(f.name == family.name for f in self._families):
            raise ConfigError(f"metric family {family.name} is already registered")
        self._families.append(family)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            kind = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
            reading = family.read()
            if not isinstance(reading, Mapping):  # a family without labels
                yield kind(family.name, family.help, value=reading)
                continue
            metric = kind(family.name, family.help, labels=family.labels)
            for label_values, value in sorted(reading.items()):
                metric.add_metric(list(label_values), value)
            yield metric


_PREFETCH = {
    "hits": "Entries served by Fetch with their bytes",
    "misses": "Entries served by Fetch as misses",
    "stalls": "Times a Fetch consumer waited for its reader",
    "stall_seconds": "Seconds Fetch consumers waited for their readers",
    "read_bytes": "Value bytes prefetch readers read from the store",
    "served_bytes": "Entry bytes Fetch sent to consumers",
    "direct": "Entries Fetch read from the store in one pass per frame (warm, shared memory)",
}


def daemon_families(store: "Store", service: "ActCacheService") -> list[Family]:
    """Every family the daemon exports: usage per namespace, sizes, prefetch per namespace (no per-schedule
    or per-sample labels), the service's counters, uptime."""
    counters, prefetcher = service.counters, service.prefetcher

    def names() -> dict[int, str]:
        return {info.id: info.name for info, *_ in store.namespaces()}

    def stored(index: int) -> Callable[[], dict[tuple[str, ...], int]]:
        return lambda: {(info.name,): row[index] for info, *row in store.namespaces()}

    def reclaimable() -> dict[tuple[str, ...], int]:
        named = names()
        out: dict[tuple[str, ...], int] = {(name,): 0 for name in named.values()}
        for gen in store.generation_stats():
            if gen.dead:
                key = (named.get(gen.namespace_id, str(gen.namespace_id)),)
                out[key] = out.get(key, 0) + gen.bytes
        return out

    def prefetched(name: str) -> Callable[[], dict[tuple[str, ...], float]]:
        def read() -> dict[tuple[str, ...], float]:
            named, per_ns = names(), prefetcher.stats().namespaces
            return {(named.get(ns, str(ns)),): totals.get(name, 0) for ns, totals in per_ns.items()}

        return read

    def counter_field(name: str) -> Callable[[], float]:
        return lambda: counters.snapshot()[name]

    families = [
        Family("actcache_info", "actcache daemon version", "gauge", lambda: {(__version__,): 1}, labels=("version",)),
        Family("actcache_stored_bytes", "Bytes stored (after compression) per namespace", "gauge",
               stored(1), labels=("namespace",)),
        Family("actcache_stored_entries", "Entries stored per namespace", "gauge", stored(0), labels=("namespace",)),
        Family("actcache_budget_bytes", "Byte budget of the whole cache (0 = unlimited)", "gauge",
               lambda: store.config.budget_bytes),
        Family("actcache_namespace_budget_bytes", "Byte budget of each namespace (0 = unlimited)", "gauge",
               lambda: store.config.namespace_budget_bytes),
        Family("actcache_map_size_bytes", "Current LMDB map size (grows when full)", "gauge", store.map_size),
        Family("actcache_file_bytes", "Disk space the LMDB data file occupies (allocated blocks)", "gauge",
               store.file_bytes),
        Family("actcache_uptime_seconds", "Seconds since the daemon started", "gauge",
               lambda: time.monotonic() - service.started),
        Family("actcache_reclaimable_bytes", "Bytes of dead generations (reclaimed when a put needs room) per namespace",
               "gauge", reclaimable, labels=("namespace",)),
        Family("actcache_reclaimed_generations", "Dead generations reclaimed to make room for puts", "counter",
               lambda: store.generations.reclaimed_generations),
        Family("actcache_reclaimed_bytes", "Bytes of dead generations reclaimed to make room for puts", "counter",
               lambda: store.generations.reclaimed_bytes),
    ]
    families += [Family(f"actcache_prefetch_{name}", help_text, "counter", prefetched(name), labels=("namespace",))
                 for name, help_text in _PREFETCH.items()]
    families += [
        Family("actcache_prefetch_budget_bytes", "Memory for read-ahead entries (--prefetch-bytes)", "gauge",
               lambda: prefetcher.stats().budget_bytes),
        Family("actcache_prefetch_buffered_bytes", "Read-ahead bytes held now", "gauge",
               lambda: prefetcher.stats().buffered_bytes),
    ]
    for f in fields(counters):
        help_text = _COUNTER_HELP.get(f.name, f.name.replace("_", " "))
        kind: Literal["counter", "gauge"] = "counter" if f.name.endswith("_total") else "gauge"
        families.append(Family(f"actcache_{f.name.removesuffix('_total')}", help_text, kind, counter_field(f.name)))
    return families


class MetricsEndpoint:
    """``/metrics`` over HTTP on a daemon thread (prometheus_client's server), until :meth:`stop`."""

    def __init__(self, config: MetricsConfig, collector: DaemonCollector) -> None:
        registry = CollectorRegistry()
        registry.register(collector)
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, resident memory, open fds
        assert config.port is not None, "the daemon serves metrics only when given a port"
        try:
            self._server, self._thread = start_http_server(config.port, addr=config.host, registry=registry)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {config.host}:{config.port}: {exc.strerror or exc}; "
                "pass another --metrics-port (0 = any free port) or --metrics-host"
            ) from exc
        self.host = config.host
        self.port: int = self._server.server_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
