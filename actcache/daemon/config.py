"""Daemon configuration: dataclasses per concern, built from flags > ACTCACHE_* env > defaults."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from actcache.codec import Encoding
from actcache.errors import ConfigError, InvalidRequest
from actcache.node import default_dir, default_socket_path

__all__ = ["DaemonConfig", "MetricsConfig", "PrefetchConfig", "ServerConfig", "StoreConfig", "format_size",
           "is_loopback", "parse_size", "socket_gid"]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``100GiB``, ``512MiB``, ``1.5GB`` or ``4096``."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(f"cannot parse size {text!r}; use a number with an optional unit such as 512MiB or 100GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """Format a byte count for humans: ``1.5 GiB``."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP literal, ``[v6]`` or ``localhost``; other names count as remote) is loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """The LMDB activation store."""

    dir: Path
    #: Total stored bytes (values after the codec) across namespaces; 0 = unlimited.
    budget_bytes: int = 0
    #: Stored bytes per namespace; 0 = only the daemon budget applies.
    namespace_budget_bytes: int = 0
    #: Initial LMDB map size; the map doubles whenever it fills up.
    map_size_bytes: int = 1 << 30
    #: How entries sent raw are stored: auto (lz4 when it saves 30%), raw, lz4, zstd or zstd:LEVEL.
    encoding: str = "auto"
    #: fsync every commit (acknowledged puts survive an OS crash). Off: they survive a daemon crash; an
    #: OS crash may lose the writes since the last flush (every ``sync_interval_s``) or damage the file.
    sync: bool = False
    sync_interval_s: float = 5.0
    #: Largest single encoded entry accepted.
    max_entry_bytes: int = 64 << 20
    #: LMDB files damaged or not an actcache store: "refuse" to start, or "move-aside" (rename to
    #: *.corrupt-<time>) and start empty.
    on_corrupt: str = "refuse"
    #: Free disk space puts never eat into, so that drops can always commit; 0 = no check.
    disk_reserve_bytes: int = 64 << 20
    #: Read values with one ``pread`` each at their offset in data.mdb (fast when cold); off: copy them
    #: out of LMDB's memory map.
    explicit_reads: bool = True
    #: A generation (namespace, fingerprint) no live schedule reads, unused for this many seconds, is
    #: dead: a put over a budget reclaims those first. 0: only live schedules protect a generation.
    reclaim_after_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", Path(self.dir))
        if not 0 <= self.reclaim_after_s < float("inf"):
            raise ConfigError("--reclaim-after must be a number of seconds >= 0 (0 = no recency check), "
                              f"got {self.reclaim_after_s}")
        for name, flag in (("budget_bytes", "--budget"), ("namespace_budget_bytes", "--namespace-budget"),
                           ("disk_reserve_bytes", "--disk-reserve")):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}; pass {flag} SIZE")
        if self.map_size_bytes < 1 << 20:
            raise ConfigError(f"map_size_bytes must be at least 1 MiB, got {self.map_size_bytes} bytes; raise --map-size")
        try:
            Encoding.parse(self.encoding)
        except InvalidRequest as exc:
            raise ConfigError(f"encoding {self.encoding!r} is not valid ({exc}); "
                              "pass --encoding auto|raw|lz4|zstd|zstd:LEVEL") from None
        if self.on_corrupt not in ("refuse", "move-aside"):
            raise ConfigError(f"on_corrupt must be 'refuse' or 'move-aside', got {self.on_corrupt!r}; "
                              "pass --on-corrupt refuse|move-aside")
        if self.max_entry_bytes < 1024:
            raise ConfigError(f"max_entry_bytes must be at least 1 KiB, got {self.max_entry_bytes} bytes; "
                              "raise --max-entry-bytes")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The gRPC endpoint."""

    socket: Path | None = None
    #: Permission bits of the socket; 0o660 with ``socket_group`` shares it with a group.
    socket_mode: int = 0o600
    #: Group (name or gid) given the socket.
    socket_group: str | None = None
    #: ``HOST:PORT`` for TCP; requires a token. Loopback hosts only unless ``allow_remote``.
    listen: str | None = None
    allow_remote: bool = False
    token: str | None = field(default=None, repr=False)
    #: PEM certificate chain and private key: TLS on the TCP listener.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_message_bytes: int = 128 << 20
    workers: int = 16
    #: Seconds in-flight calls get to finish on SIGTERM.
    grace_s: float = 10.0
    #: Cap on served bytes/s (in MB/s), to reproduce a slow disk; 0 = off.
    throttle_read_mbps: float = 0.0
    #: Stop (as on SIGTERM) once no call has been in flight for this many seconds; 0 = never.
    idle_timeout_s: float = 0.0
    #: Stop (as on SIGTERM) once this process, the daemon's parent, has exited; None = never.
    parent_pid: int | None = None

    def __post_init__(self) -> None:
        port = re.fullmatch(r".+:(\d+)", self.listen or "")
        if self.listen and (port is None or int(port.group(1)) > 65535):
            raise ConfigError(f"--listen must be HOST:PORT with a port 0..65535, got {self.listen!r}")
        if self.listen and not self.token:
            raise ConfigError(f"refusing to listen on TCP {self.listen} without a token (none given, or an empty one); "
                              "pass --token-file FILE or set ACTCACHE_TOKEN")
        if self.listen and not self.allow_remote and not is_loopback(self.listen.rsplit(":", 1)[0]):
            raise ConfigError(f"--listen {self.listen} is not a loopback address; the daemon listens on 127.0.0.1, "
                              "::1 or localhost only, unless --allow-remote is given "
                              "(then use --tls-cert/--tls-key too)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both --tls-cert FILE and --tls-key FILE")
        if self.tls_cert is not None and not self.listen:
            raise ConfigError("--tls-cert/--tls-key secure the TCP listener; pass --listen HOST:PORT too")
        if not 0 <= self.socket_mode <= 0o777 or self.socket_mode & 0o600 != 0o600:
            raise ConfigError(f"--socket-mode {self.socket_mode:#o} must give the owner read and write (0600 or 0660)")
        if self.socket_mode & 0o007:
            raise ConfigError(f"--socket-mode {self.socket_mode:#o} would let every local user connect; "
                              "share the socket with a group instead (--socket-mode 0660 --socket-group GROUP)")
        if self.socket is not None and len(str(self.socket)) > 100:
            raise ConfigError(f"socket path {self.socket} is {len(str(self.socket))} characters; Unix sockets allow "
                              "about 100: pass a shorter --socket")
        if not 0 <= self.throttle_read_mbps < float("inf"):
            raise ConfigError(f"--throttle-read-mbps must be a number of MB/s >= 0 (0 = off), got {self.throttle_read_mbps}")
        if not 0 <= self.idle_timeout_s < float("inf"):
            raise ConfigError(f"--idle-timeout must be a number of seconds >= 0 (0 = never), got {self.idle_timeout_s}")
        if self.workers < 2:
            raise ConfigError(f"workers must be >= 2, got {self.workers}; pass --workers 2 or more")
        if self.socket_group is not None:
            socket_gid(self.socket_group)


def socket_gid(group: str) -> int:
    """The gid of ``--socket-group`` (a name or a gid); ConfigError if there is no such group."""
    import grp

    try:
        return grp.getgrgid(int(group)).gr_gid if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"--socket-group {group!r} is not a group on this machine; "
                          "pass a group name or gid (see /etc/group)") from None


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """The Prometheus endpoint (``/metrics`` over HTTP)."""

    #: TCP port; None = no endpoint, 0 = any free port (logged at start).
    port: int | None = None
    #: Address to bind; loopback unless asked, as the endpoint has no authentication.
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ConfigError(f"--metrics-port must be 0..65535 (0 = any free port), got {self.port}")
        if not _is_host(self.host):
            raise ConfigError(f"--metrics-host must be an address or host name such as 127.0.0.1 or 0.0.0.0 "
                              f"(the port is --metrics-port), got {self.host!r}")


def _is_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return bool(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", host))


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig:
    """Schedule readers (Schedule/Fetch)."""

    #: Memory for read-ahead entries, shared fairly by every schedule being read.
    prefetch_bytes: int = 512 << 20
    #: Threads that verify and decompress Fetch frames, the Fetch's own included (it splits a large frame
    #: with one of the others). Default one per core.
    decode_threads: int = field(default_factory=_cpu_count)
    #: Threads that look entries up ahead of the readers and hint the kernel to read them; 0 = off.
    probe_threads: int = 8
    #: How far ahead of each reader (in value bytes) those lookups run.
    probe_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.prefetch_bytes < 1 << 20:
            raise ConfigError(f"prefetch_bytes must be at least 1 MiB, got {self.prefetch_bytes} bytes; raise --prefetch-bytes")
        if self.decode_threads < 1:
            raise ConfigError(f"decode_threads must be >= 1, got {self.decode_threads}; pass --decode-threads 1 or more")
        if self.probe_threads < 0:
            raise ConfigError(f"probe_threads must be >= 0 (0 = off), got {self.probe_threads}; pass --probe-threads 0 or more")
        if self.probe_bytes < 0:
            raise ConfigError(f"probe_bytes must be >= 0, got {self.probe_bytes}; pass --probe-bytes SIZE")


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    store: StoreConfig
    server: ServerConfig
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.prefetch.prefetch_bytes < self.store.max_entry_bytes:
            raise ConfigError(f"--prefetch-bytes {format_size(self.prefetch.prefetch_bytes)} is below "
                              f"--max-entry-bytes {format_size(self.store.max_entry_bytes)}: one entry would not fit; "
                              "raise --prefetch-bytes or lower --max-entry-bytes")

    def non_defaults(self) -> dict[str, Any]:
        """Fields that differ from their defaults, for the start-up log line."""
        out: dict[str, Any] = {}
        for part in (self.store, self.server, self.metrics, self.prefetch):
            for f in dataclasses.fields(part):
                value = getattr(part, f.name)
                if f.name == "token":
                    value = "***" if value else None
                default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                if value != default:
                    out[f.name] = value
        return out

    @classmethod
    def from_sources(cls, flags: Mapping[str, Any], env: Mapping[str, str] | None = None) -> "DaemonConfig":
        """Merge ``flags`` (None = not given) over ``ACTCACHE_<NAME>`` env vars (empty = not set) over defaults.
        A bad value is a ConfigError naming the flag (and the variable it came from), the value and the fix."""
        env = os.environ if env is None else env
        from_env: dict[str, str] = {}  # "--flag" -> "ACTCACHE_FLAG='value'", for the values taken from env

        def pick(name: str, convert: Callable[[Any], Any] = str, accepted: str = "") -> Any:
            flag, var = "--" + name.replace("_", "-"), f"ACTCACHE_{name.upper()}"
            if flags.get(name) is not None:
                raw, source = flags[name], ""
            elif env.get(var):
                raw, source = env[var], f" (from {var})"
                from_env[flag] = f"{var}={raw!r}"
            else:
                return None
            try:
                return convert(raw)
            except ValueError:  # ConfigError is one
                raise ConfigError(f"{flag} must be {accepted}, got {raw!r}{source}") from None

        try:
            return cls._build(pick)
        except ConfigError as exc:
            message = str(exc)
            blamed = [source for flag, source in from_env.items()
                      if re.search(rf"{re.escape(flag)}(?![\w-])", message) and source.split("=")[0] not in message]
            if not blamed:
                raise
            raise ConfigError(f"{message} (from {', '.join(blamed)})") from None

    @classmethod
    def _build(cls, pick: Callable[..., Any]) -> "DaemonConfig":
        size, count = _SIZE, "a whole number"
        directory = pick("dir", _path, "a directory path") or default_dir()
        token = pick("token")
        token_file = pick("token_file", _path, "a file path")
        if token_file:  # the file wins over ACTCACHE_TOKEN: it was asked for by name
            try:
                token = token_file.read_text().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read --token-file {token_file}: {exc.strerror}; "
                                  "pass a readable file holding the token") from exc
        store = StoreConfig(dir=directory, **_given(
            budget_bytes=pick("budget", parse_size, size),
            namespace_budget_bytes=pick("namespace_budget", parse_size, size),
            map_size_bytes=pick("map_size", parse_size, size),
            encoding=pick("encoding"),
            sync=pick("sync", _bool, _BOOL),
            max_entry_bytes=pick("max_entry_bytes", parse_size, size),
            disk_reserve_bytes=pick("disk_reserve", parse_size, size),
            on_corrupt=pick("on_corrupt"),
            explicit_reads=pick("explicit_reads", _bool, _BOOL),
            reclaim_after_s=pick("reclaim_after", float, "a number of seconds (0 = no recency check)"),
        ))
        prefetch = PrefetchConfig(**_given(
            prefetch_bytes=pick("prefetch_bytes", parse_size, size),
            decode_threads=pick("decode_threads", int, count),
            probe_threads=pick("probe_threads", int, count),
            probe_bytes=pick("probe_bytes", parse_size, size),
        ))
        listen = pick("listen")
        socket = pick("socket", _path, "a socket path")
        if socket is None and not listen:
            socket = default_socket_path()
        server = ServerConfig(socket=socket, listen=listen, token=token, **_given(
            workers=pick("workers", int, count),
            throttle_read_mbps=pick("throttle_read_mbps", float, "a number of MB/s (0 = off)"),
            idle_timeout_s=pick("idle_timeout", float, "a number of seconds (0 = never)"),
            parent_pid=pick("parent_pid", int, "the process id of the daemon's parent"),
            allow_remote=pick("allow_remote", _bool, _BOOL),
            tls_cert=pick("tls_cert", _path, "a PEM file"),
            tls_key=pick("tls_key", _path, "a PEM file"),
            socket_mode=pick("socket_mode", _octal, "octal permission bits such as 0600 or 0660"),
            socket_group=pick("socket_group"),
        ))
        for flag, path in (("--tls-cert", server.tls_cert), ("--tls-key", server.tls_key)):
            if path is not None and not (path.is_file() and os.access(path, os.R_OK)):
                raise ConfigError(f"{flag} {path} is not a readable file; pass a PEM file")
        metrics = MetricsConfig(**_given(port=pick("metrics_port", int, "a number 0..65535 (0 = any free port)"),
                                         host=pick("metrics_host")))
        return cls(store=store, server=server, metrics=metrics, prefetch=prefetch, log_level=pick("log_level") or "INFO")


#: What ``--log-level`` accepts (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_SIZE = "a size such as 512MiB or 100GiB (a number and an optional unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
_BOOLS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)
_BOOL = f"one of {', '.join(_BOOLS)}"


def _given(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _bool(value: Any) -> bool:
    flag = value if isinstance(value, bool) else _BOOLS.get(str(value).strip().lower())
    if flag is None:
        raise ValueError(value)
    return flag


def _path(value: Any) -> Path:
    if not str(value):
        raise ValueError(value)
    return Path(value)


def _octal(value: str | int) -> int:
    return value if isinstance(value, int) else int(value, 8)
