"""``actcache serve --idle-timeout``: a real daemon stops on its own once no call is in flight."""

import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from actcache.testing import run_daemon

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not


def test_daemon_exits_cleanly_after_its_idle_timeout():
    with run_daemon("--idle-timeout", "1") as d:
        with d.client() as c:
            c.open("touched")
        assert d.proc.wait(60) == 0  # bounded: the timeout is 1 s
        assert not d.socket.exists()  # the SIGTERM path: socket removed, LMDB closed
        log = d.log_tail()
        assert "no call for 1 s (--idle-timeout): stopping" in log and "actcache daemon stopped" in log


def test_a_stream_in_flight_keeps_it_up_and_its_end_lets_it_go():
    with run_daemon("--idle-timeout", "1") as d, grpc.insecure_channel(d.target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(subprocess.TimeoutExpired):
            d.proc.wait(3)  # three timeouts with a server stream open: still serving
        watch.cancel()
        assert d.proc.wait(60) == 0
