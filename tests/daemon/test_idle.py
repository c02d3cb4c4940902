"""The idle monitor: counts calls in flight and decides once, never while a call is in flight."""

import threading

import pytest

from actcache.daemon.config import DaemonConfig
from actcache.daemon.service._idle import IdleMonitor
from actcache.errors import ConfigError


def monitor(timeout_s: float) -> tuple[IdleMonitor, threading.Event]:
    fired = threading.Event()
    m = IdleMonitor(timeout_s, fired.set)
    return m, fired


def test_fires_once_nothing_was_called_and_then_refuses_calls():
    m, fired = monitor(0.05)
    m.start()
    assert fired.wait(30)
    assert m.idle and m.in_flight == 0
    assert m.enter() is False  # a call arriving after the decision is refused
    assert m.in_flight == 0
    m.close()


@pytest.mark.slow
def test_a_call_in_flight_holds_it_and_its_end_restarts_the_countdown():
    m, fired = monitor(0.05)
    assert m.enter() and m.enter()
    m.start()
    assert not fired.wait(0.5)  # ten timeouts with calls in flight: no decision
    m.leave()
    assert not fired.wait(0.5) and m.in_flight == 1
    m.leave()
    assert fired.wait(30)
    assert m.in_flight == 0
    m.close()


def test_close_prevents_the_decision():
    m, fired = monitor(0.05)
    m.enter()
    m.start()
    m.close()  # joins the thread
    m.leave()
    assert not fired.is_set() and not m.idle


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        IdleMonitor(0, lambda: None)


def test_idle_timeout_from_flag_env_and_default(tmp_path):
    base = {"dir": tmp_path, "socket": tmp_path / "s"}
    assert DaemonConfig.from_sources(base, env={}).server.idle_timeout_s == 0
    assert DaemonConfig.from_sources(base, env={"ACTCACHE_IDLE_TIMEOUT": "90"}).server.idle_timeout_s == 90
    cfg = DaemonConfig.from_sources({**base, "idle_timeout": 2.5}, env={"ACTCACHE_IDLE_TIMEOUT": "90"})
    assert cfg.server.idle_timeout_s == 2.5 and cfg.non_defaults()["idle_timeout_s"] == 2.5
    for bad in ("soon", "-1", "inf", "nan"):
        with pytest.raises(ConfigError, match="idle"):
            DaemonConfig.from_sources(base, env={"ACTCACHE_IDLE_TIMEOUT": bad})


def test_serve_parses_idle_timeout():
    from actcache.cli import build_parser

    assert build_parser().parse_args(["serve", "--idle-timeout", "2"]).idle_timeout == 2.0
    assert build_parser().parse_args(["serve"]).idle_timeout is None
