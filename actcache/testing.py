"""Run a real daemon in a subprocess, for tests, benchmarks and the demo (``with run_daemon() as daemon:``);
``wait_until`` is the one polling helper for tests that observe another thread or process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from actcache.errors import DaemonUnavailable, LifecycleError
from actcache.node import wait_serving
from actcache.rpc_client import RpcClient

__all__ = ["DaemonProcess", "run_daemon", "wait_until"]


class DaemonProcess:
    """A daemon subprocess bound to one cache directory and socket; can be stopped, killed and restarted."""

    def __init__(self, cache_dir: Path, socket: Path, args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.dir = Path(cache_dir)
        self.socket = Path(socket)
        self.args = list(args)
        self.env = env
        self.log_path = self.socket.parent / "daemon.log"
        self.proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "daemon not started"
        return self.proc.pid

    def client(self, **kwargs) -> RpcClient:
        return RpcClient(self.target, **kwargs)

    def start(self, timeout_s: float = 30.0) -> None:
        cmd = [sys.executable, "-m", "actcache", "serve", "--dir", str(self.dir), "--socket", str(self.socket), *self.args]
        env = {**os.environ, **(self.env or {})}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        why = wait_serving(self.proc, self.target, timeout_s)
        if why is not None:
            self.kill()
            raise DaemonUnavailable(f"daemon {why}\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no daemon log)"

    def thread_dump(self, timeout_s: float = 5.0) -> str:
        """Every thread's stack, as the daemon writes it to its log on SIGUSR1; "" if it is not running or
        wrote nothing within ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return ""
        start = self.log_path.stat().st_size if self.log_path.exists() else 0

        def written() -> str:
            with open(self.log_path, "rb") as log:
                log.seek(start)
                return log.read().decode(errors="replace")

        self.proc.send_signal(signal.SIGUSR1)
        deadline, text = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = written()
            if now and now == text:  # a whole dump: nothing more came in 50 ms
                return text
            text = now
        return text

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise LifecycleError(f"daemon did not stop within {timeout_s:.0f} s of SIGTERM\n{self.log_tail()}") from None
        self.proc = None
        return code

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


# Daemons started by run_daemon and not yet stopped, with their temp dirs: SIGTERM stops them first.
_LIVE: dict[DaemonProcess, Path] = {}
_LIVE_LOCK = threading.RLock()  # reentrant: the handler may run in the main thread while it holds the lock


def _stop_live_daemons_then_die(signum, frame) -> None:
    """SIGTERM while run_daemon has daemons running: stop them and remove their temp dirs, then die of it."""
    with _LIVE_LOCK:
        live = list(_LIVE.items())
        _LIVE.clear()
    for daemon, tmp in live:
        try:
            daemon.stop()
        except Exception:  # dying anyway: a daemon that would not stop is killed
            daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


@contextmanager
def run_daemon(
    *args: str, cache_dir: Path | None = None, env: dict[str, str] | None = None, check_exit: bool = True
) -> Iterator[DaemonProcess]:
    """Start ``actcache serve`` with extra ``args`` on a socket in a temp dir, once it answers its health
    check; stop it on exit, raising LifecycleError if it did not exit with code 0 (``check_exit``). When the
    body raises, the daemon log's tail goes to stderr before the temp dir is removed.

    A process ended with SIGTERM (``kill``, a CI timeout) while inside stops its daemons first, then
    dies of SIGTERM as before (once its main thread next runs Python code).
    """
    tmp = Path(tempfile.mkdtemp(prefix="actcache-"))
    daemon = DaemonProcess(cache_dir or tmp / "cache", tmp / "daemon.sock", args, env)
    with _LIVE_LOCK:
        _LIVE[daemon] = tmp
    # Only from the main thread, and only over SIGTERM's default action: another handler is left alone.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop_live_daemons_then_die)
    failed = False
    try:
        daemon.start()
        yield daemon
    except BaseException:
        failed = True
        raise
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(daemon, None)
            last = not _LIVE
        if (last and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is _stop_live_daemons_then_die):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        running = daemon.proc is not None
        code = daemon.stop()
        log = daemon.log_tail()
        shutil.rmtree(tmp, ignore_errors=True)
        if failed:  # the log goes with the temp dir: keep its tail beside the failure
            print(f"actcache: the daemon's log when the code using it failed:\n{log}", file=sys.stderr)
        if check_exit and running and code != 0:
            raise LifecycleError(f"daemon exited with code {code}\n{log}")


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``predicate`` every 10 ms until it is true; AssertionError naming ``what`` after ``timeout`` s.
    Only for tests observing another thread or process: the code under test waits on conditions."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g} s")
        time.sleep(0.01)
