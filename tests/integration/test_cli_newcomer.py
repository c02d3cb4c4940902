"""The CLI as the README shows it: ended jobs told from running ones, a drop of nothing, the disk bench's default."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from actcache.rpc_client import JobInfo
from actcache.testing import run_daemon

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not


def actcache(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actcache", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_ls_says_which_jobs_run_and_which_ended_and_when(tmp_path):
    with run_daemon(cache_dir=tmp_path / "c") as d:
        job = textwrap.dedent(f"""
            from actcache.rpc_client import JobInfo, RpcClient
            with RpcClient("unix:{d.socket}") as c:
                c.open("vision", job=JobInfo.current("digits"))
            import os; print(os.getpid())
        """)
        ended = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, timeout=120, check=True)
        with d.client() as c:
            c.open("vision", job=JobInfo.current())
        out = actcache("ls", "--socket", str(d.socket))
    assert out.returncode == 0, out.stderr
    assert "jobs of vision: 1 running, 1 ended" in out.stdout, out.stdout
    running, finished = out.stdout.split("jobs of vision:")[1].splitlines()[1:3]
    assert re.match(rf"  job pid {os.getpid()} on \S+, running, started", running), running
    assert re.match(rf"  job pid {ended.stdout.strip()} on \S+, ended \d+s ago, started \d+s ago, data 'digits'",
                    finished), finished


def test_drop_of_a_missing_namespace_says_there_is_nothing_to_drop_and_lists_the_namespaces(tmp_path):
    with run_daemon(cache_dir=tmp_path / "c") as d:
        with d.client() as c:
            c.open("vision")
            c.open("text")
        out = actcache("drop", "nosuchns", "--socket", str(d.socket))
        as_json = actcache("drop", "nosuchns", "--socket", str(d.socket), "--json")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("nothing to drop: there is no namespace 'nosuchns' on ")
    assert "its namespaces: text, vision (`actcache ls` lists their entries)" in out.stdout
    assert json.loads(as_json.stdout) == {"entries": 0, "bytes": 0, "namespaces": ["text", "vision"]}


def test_bench_disk_measures_the_node_daemons_directory_by_default(tmp_path):
    env = {**os.environ, "ACTCACHE_DIR": str(tmp_path / "node")}
    out = actcache("bench", "disk", "--size", "8MiB", "--json", "--no-drop-caches", env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["dir"] == str(tmp_path / "node"), report
    assert list((tmp_path / "node").iterdir()) == []  # measured there, and nothing left behind
