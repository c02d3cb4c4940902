"""Where the node daemon lives (actcache.node): directory, socket, idle timeout and budget from the environment."""

import os
from pathlib import Path

import pytest

from actcache.errors import ConfigError
from actcache.node import DEFAULT_BUDGET_CAP, DEFAULT_IDLE_TIMEOUT_S, NodeDaemon, default_budget, default_socket_path


def test_directory_from_actcache_dir_then_xdg_cache_home_then_home(tmp_path):
    node = NodeDaemon.from_env({"ACTCACHE_DIR": str(tmp_path / "a"), "XDG_CACHE_HOME": str(tmp_path / "x")})
    assert node.dir == tmp_path / "a" and node.socket == tmp_path / "a" / "daemon.sock"
    assert node.idle_timeout_s == DEFAULT_IDLE_TIMEOUT_S
    assert NodeDaemon.from_env({"XDG_CACHE_HOME": str(tmp_path / "x")}).dir == tmp_path / "x" / "actcache"
    assert NodeDaemon.from_env({}).dir == Path.home() / ".cache" / "actcache"
    assert NodeDaemon.from_env({"ACTCACHE_DIR": "rel"}).dir == Path.cwd() / "rel"


def test_a_directory_too_deep_for_a_unix_socket_puts_the_socket_in_the_runtime_dir(tmp_path):
    deep = "/tmp/" + "d" * 120
    node = NodeDaemon.from_env({"ACTCACHE_DIR": deep, "XDG_RUNTIME_DIR": str(tmp_path)})
    assert node.socket.parent == tmp_path / "actcache" and node.socket.name.startswith("node-")
    other = NodeDaemon.from_env({"ACTCACHE_DIR": deep + "x", "XDG_RUNTIME_DIR": str(tmp_path)})
    assert other.socket != node.socket  # one socket per directory
    assert NodeDaemon.from_env({"ACTCACHE_DIR": deep}).socket.parent == Path(f"/tmp/actcache-{os.getuid()}")
    assert len(str(node.socket)) <= 100


def test_idle_timeout_from_the_environment():
    assert NodeDaemon.from_env({"ACTCACHE_IDLE_TIMEOUT": "2"}).idle_timeout_s == 2
    assert NodeDaemon.from_env({"ACTCACHE_IDLE_TIMEOUT": "0"}).idle_timeout_s == 0
    for bad in ("later", "-5", "inf"):
        with pytest.raises(ConfigError, match="ACTCACHE_IDLE_TIMEOUT must be a number of seconds"):
            NodeDaemon.from_env({"ACTCACHE_IDLE_TIMEOUT": bad})


def test_default_budget_is_capped_and_at_most_half_the_disk(tmp_path):
    st = os.statvfs(tmp_path)
    budget = default_budget(tmp_path)
    assert 0 < budget <= DEFAULT_BUDGET_CAP
    assert budget <= max(1 << 20, st.f_bavail * st.f_frsize // 2 + (1 << 20))


def test_serve_connect_and_the_tools_agree_on_one_default_daemon(tmp_path, monkeypatch):
    from actcache.daemon.config import DaemonConfig

    env = {"ACTCACHE_DIR": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    assert default_socket_path(env) == NodeDaemon.from_env(env).socket == tmp_path / "daemon.sock"
    assert default_socket_path({**env, "ACTCACHE_SOCKET": "/x.sock"}) == Path("/x.sock")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("ACTCACHE_SOCKET", raising=False)
    config = DaemonConfig.from_sources({})  # `actcache serve` with no flags: the node daemon's dir and socket
    assert (config.store.dir, config.server.socket) == (tmp_path, tmp_path / "daemon.sock")
