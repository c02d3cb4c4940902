"""The node daemon: one ``actcache serve`` per user and node, found or started on first use.

``actcache_client.connect()`` with no socket, address or ``$ACTCACHE_SOCKET`` lands here: every
local rank reaches the same daemon (docs/operating/node-daemon.md).

Invariants: only the holder of ``flock`` on ``DIR/start.lock`` starts a daemon, after checking again
that none answers, and holds it at most ``start_timeout_s`` plus DRAIN_TIMEOUT_S; a daemon starts only
after the previous one released DIR. A start that failed while a process waited for the lock
(``DIR/start.failed``) is raised, not retried, so N ranks do not each wait out the same failure.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import select
import shlex
import signal
import socket as socketlib
import struct
import subprocess
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from actcache.errors import ConfigError, DaemonUnavailable

__all__ = [
    "DEFAULT_BUDGET_CAP",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DRAIN_TIMEOUT_S",
    "NodeDaemon",
    "default_budget",
    "default_dir",
    "default_socket_path",
    "ensure_running",
    "healthy",
    "peer_pid",
    "stop_daemon",
    "wait_exit",
    "wait_serving",
]

DEFAULT_IDLE_TIMEOUT_S = 900.0
DEFAULT_BUDGET_CAP = 20 << 30
#: How long a starter waits for a daemon that still holds DIR (stopping) to exit.
DRAIN_TIMEOUT_S = 30.0
#: Longest socket path accepted (ServerConfig's limit; the kernel's is 107 bytes).
MAX_SOCKET_PATH = 100
_LOG_ROTATE_BYTES = 8 << 20
_DIR_LOCK = "daemon.lock"  # actcache.daemon.store._dirlock.LOCK_NAME; the client side does not import the daemon


@dataclass(frozen=True, kw_only=True)
class NodeDaemon:
    """Where this user's node daemon lives and how it is started."""

    dir: Path
    socket: Path
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    @property
    def log_path(self) -> Path:
        return self.dir / "daemon.log"

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "NodeDaemon":
        """The node daemon of ``env`` (default ``os.environ``); ConfigError for a malformed variable."""
        env = os.environ if env is None else env
        given = env.get("ACTCACHE_DIR") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "actcache"
        directory = Path(given).expanduser().absolute()
        text, idle = env.get("ACTCACHE_IDLE_TIMEOUT", ""), -1.0
        with suppress(ValueError):
            idle = float(text) if text else DEFAULT_IDLE_TIMEOUT_S
        if not 0 <= idle < float("inf"):
            raise ConfigError(f"ACTCACHE_IDLE_TIMEOUT must be a number of seconds >= 0 (0 = never), got {text!r}")
        return cls(dir=directory, socket=_socket_for(directory, env), idle_timeout_s=idle)


def _socket_for(directory: Path, env: Mapping[str, str]) -> Path:
    here = directory / "daemon.sock"
    if len(str(here)) <= MAX_SOCKET_PATH:
        return here
    name = f"node-{hashlib.sha256(str(directory).encode()).hexdigest()[:12]}.sock"
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and len(str(Path(runtime) / "actcache" / name)) <= MAX_SOCKET_PATH:
        return Path(runtime) / "actcache" / name
    return Path(f"/tmp/actcache-{os.getuid()}") / name


def default_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """The one default daemon of ``actcache serve``, ``connect()`` and every CLI command:
    ``$ACTCACHE_SOCKET``, else the node daemon's socket (of ``$ACTCACHE_DIR``, else ``~/.cache/actcache``)."""
    env = os.environ if env is None else env
    return Path(env["ACTCACHE_SOCKET"]) if env.get("ACTCACHE_SOCKET") else NodeDaemon.from_env(env).socket


def default_dir(env: Mapping[str, str] | None = None) -> Path:
    """The node daemon's directory: ``actcache serve``'s default ``--dir``."""
    return NodeDaemon.from_env(env).dir


def default_budget(directory: Path) -> int:
    """min(DEFAULT_BUDGET_CAP, half of the free space of ``directory``'s file system plus what data.mdb occupies)."""
    st = os.statvfs(directory)
    held = 0
    with suppress(FileNotFoundError):
        held = (directory / "data.mdb").stat().st_blocks * 512
    return max(1 << 20, min(DEFAULT_BUDGET_CAP, (st.f_bavail * st.f_frsize + held) // 2))


def healthy(target: str, timeout_s: float = 5.0) -> bool:
    """Whether a daemon answers SERVING at ``target`` (``unix:PATH``); False at once when nothing listens."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def ensure_running(node: NodeDaemon, *, start_timeout_s: float = 60.0) -> None:
    """Make sure the node daemon answers on ``node.socket``, starting it if needed (module docstring);
    DaemonUnavailable, quoting the daemon's log, when it cannot be started."""
    if healthy(node.target):
        return
    waiting_since = time.time_ns()
    try:
        node.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if node.socket.parent != node.dir:
            _private_dir(node.socket.parent)
        lock = os.open(node.dir / "start.lock", os.O_RDWR | os.O_CREAT, 0o600)  # O_CLOEXEC: the daemon never holds it
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _start_locked(node, waiting_since, start_timeout_s)
        finally:
            os.close(lock)
    except OSError as exc:
        raise DaemonUnavailable(
            f"cannot start the node daemon in {node.dir}: {exc}; set ACTCACHE_DIR to a writable directory "
            "of your own, or ACTCACHE_SOCKET to a running daemon's socket"
        ) from exc


def _private_dir(path: Path) -> None:
    """A directory in a shared place (/tmp) that must be this user's alone, as another could swap the socket."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise DaemonUnavailable(
            f"the node daemon's socket directory {path} belongs to uid {st.st_uid} (you are {os.getuid()}) or "
            f"others may use it (mode {st.st_mode & 0o7777:o}, must be 700); remove it, or set ACTCACHE_DIR to "
            "a directory with a shorter path (the socket then lives there)"
        )


def _start_locked(node: NodeDaemon, waiting_since_ns: int, timeout_s: float) -> None:
    if healthy(node.target):
        return
    failed = node.dir / "start.failed"
    with suppress(FileNotFoundError):
        if failed.stat().st_mtime_ns >= waiting_since_ns:
            raise DaemonUnavailable(f"another process failed to start the node daemon just now: {failed.read_text()}")
    _wait_for_holder(node)
    try:
        proc, log_from = _spawn(node)
        why = wait_serving(proc, node.target, timeout_s)
        if why is not None:
            raise DaemonUnavailable(
                f"the node daemon (pid {proc.pid}, {node.dir}) {why}; its log {node.log_path} says:\n"
                f"{_log_tail(node.log_path, log_from)}\n"
                "Fix what it says, set ACTCACHE_DIR to another directory, or run a daemon yourself "
                "(`actcache serve`) and set ACTCACHE_SOCKET"
            )
    except DaemonUnavailable as exc:
        failed.write_text(str(exc))
        raise
    failed.unlink(missing_ok=True)


def _wait_for_holder(node: NodeDaemon) -> None:
    """Wait for the daemon still holding ``node.dir`` (stopping) to exit; DaemonUnavailable naming its pid
    when it serves another socket or hangs."""
    pid = _dir_holder(node.dir)
    if pid is None:
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if pid > 0 else []
    except OSError:
        cmdline = [os.fsencode(node.socket)]  # cannot tell: assume it is ours
    if os.fsencode(node.socket) not in cmdline:
        raise DaemonUnavailable(
            f"cache directory {node.dir} is in use by another actcache daemon (pid {pid}) that does not listen "
            f"on {node.socket}; point ACTCACHE_SOCKET at that daemon's socket, stop it, or set ACTCACHE_DIR "
            "to another directory"
        )
    if not wait_exit(pid, DRAIN_TIMEOUT_S) and _dir_holder(node.dir) == pid:
        raise DaemonUnavailable(
            f"the node daemon (pid {pid}) holds {node.dir} but does not answer on {node.socket} and did not exit "
            f"within {DRAIN_TIMEOUT_S:.0f} s; stop it (`actcache stop --socket {node.socket}` or `kill {pid}`) "
            f"and look at {node.log_path}"
        )


def _dir_holder(directory: Path) -> int | None:
    """The pid of the daemon holding ``directory`` (-1 when unrecorded), or None when none does."""
    try:
        fd = os.open(directory / _DIR_LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)


def _spawn(node: NodeDaemon) -> tuple[subprocess.Popen, int]:
    """Start the daemon detached; returns it and the log offset where its output begins."""
    cmd = [sys.executable, "-m", "actcache", "serve", "--dir", str(node.dir), "--socket", str(node.socket),
           "--idle-timeout", f"{node.idle_timeout_s:g}"]
    if not os.environ.get("ACTCACHE_BUDGET"):
        cmd += ["--budget", str(default_budget(node.dir))]
    # The daemon imports the same actcache as this process, wherever it came from (appended: shadows nothing).
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), root) if p)}
    with suppress(FileNotFoundError):
        if node.log_path.stat().st_size > _LOG_ROTATE_BYTES:
            os.replace(node.log_path, node.log_path.with_name("daemon.log.1"))
    with open(node.log_path, "ab") as log:
        log_from = log.tell()
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} started by pid {os.getpid()}: {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=node.dir,
                                env=env, start_new_session=True)
    return proc, log_from


def wait_serving(proc: subprocess.Popen, target: str, timeout_s: float) -> str | None:
    """Wait, on an event (not polling), until the daemon ``proc`` answers SERVING at ``target`` (returns None),
    exits or ``timeout_s`` passes (returns why, having killed it)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    settled = threading.Event()

    def reap() -> None:  # whenever the daemon exits while this process lives, it leaves no zombie
        proc.wait()
        settled.set()

    threading.Thread(target=reap, name="actcache-daemon-reaper", daemon=True).start()
    # Retry every 20-100 ms (gRPC's first backoff, 1 s, could outlast a short --idle-timeout).
    options = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.min_reconnect_backoff_ms", 20),
               ("grpc.max_reconnect_backoff_ms", 100)]
    with grpc.insecure_channel(target, options=options) as channel:
        future = health_pb2_grpc.HealthStub(channel).Check.future(
            health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True)
        future.add_done_callback(lambda _: settled.set())
        settled.wait(timeout_s + 5)
        try:
            if future.done() and future.result().status == health_pb2.HealthCheckResponse.SERVING:
                return None
            why = "did not answer SERVING"
        except grpc.RpcError as exc:
            why = f"did not answer its health check within {timeout_s:.0f} s ({exc.code().name})"
        finally:
            future.cancel()
    code = proc.poll()
    if code is None:
        proc.kill()
        return why
    return f"exited with code {code}"


def _log_tail(path: Path, start: int, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read it: {exc.strerror})"
    return "\n".join(text.splitlines()[-lines:]) or "(nothing)"


def peer_pid(socket: Path) -> int | None:
    """The pid of the process listening on the Unix socket ``socket`` (SO_PEERCRED), or None when none is."""
    with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as s:
        try:
            s.connect(str(socket))
        except (FileNotFoundError, ConnectionRefusedError):
            return None
        pid, uid, _gid = struct.unpack("3i", s.getsockopt(socketlib.SOL_SOCKET, socketlib.SO_PEERCRED, 12))
    if uid != os.getuid() and os.getuid() != 0:
        raise ConfigError(f"the daemon on {socket} (pid {pid}) belongs to uid {uid}; only its owner or root may stop it")
    return pid


def wait_exit(pid: int, timeout_s: float, sig: int | None = None) -> bool:
    """Whether process ``pid`` exits within ``timeout_s``, sent ``sig`` first (a pidfd: never a reused pid,
    and no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        if sig is not None:
            signal.pidfd_send_signal(fd, sig)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout_s * 1000))))
    except ProcessLookupError:
        return True
    finally:
        os.close(fd)


def stop_daemon(socket: Path, timeout_s: float = 30.0) -> int | None:
    """SIGTERM the daemon listening on ``socket`` and wait for it to exit; its pid, or None when none listens.
    DaemonUnavailable when it is still running after ``timeout_s``."""
    pid = peer_pid(socket)
    if pid is not None and not wait_exit(pid, timeout_s, signal.SIGTERM):
        raise DaemonUnavailable(
            f"the daemon (pid {pid}) on {socket} is still running {timeout_s:.0f} s after SIGTERM "
            f"(it lets calls in flight finish first); wait, or `kill -9 {pid}`"
        )
    return pid
