import pytest

from actcache.testing import run_daemon


@pytest.fixture(scope="module")
def daemon():
    with run_daemon() as d:
        yield d


@pytest.fixture
def client(daemon):
    with daemon.client(timeout_s=20) as c:
        yield c
