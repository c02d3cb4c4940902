"""The benchmark scripts import their helpers as ``workloads`` (bench/ is their sys.path[0]); do the same here."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import pytest  # noqa: E402

from actcache.testing import run_daemon  # noqa: E402


@pytest.fixture(scope="module")
def daemon():
    with run_daemon() as d:
        yield d
