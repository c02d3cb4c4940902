"""Import boundaries: the daemon never imports torch; the client never imports the daemon."""

import importlib
import subprocess
import sys

import pytest


def _modules_after_import(*modules: str) -> set[str]:
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_daemon_and_cli_never_import_torch():
    loaded = _modules_after_import("actcache.cli", "actcache.daemon.server", "actcache.testing", "actcache.rpc_client")
    assert "torch" not in loaded
    assert not any(m.startswith("actcache_client") for m in loaded)


def test_client_never_imports_daemon_internals():
    loaded = _modules_after_import("actcache_client", "actcache_client.loader", "actcache_client.cached_forward")
    assert not any(m.startswith("actcache.daemon") for m in loaded), sorted(m for m in loaded if m.startswith("actcache"))


@pytest.mark.parametrize(
    "module",
    ["actcache.codec", "actcache.errors", "actcache.keys", "actcache.rpc", "actcache.rpc_client", "actcache.testing",
     "actcache.daemon.store", "actcache.daemon.config", "actcache_client", "actcache_client.cached_forward",
     "actcache_client.connection", "actcache_client.fingerprint", "actcache_client.loader", "actcache_client.lookahead",
     "actcache_client.bert", "actcache_client.stages", "actcache_client.staging", "actcache_client.tensors"],
)
def test_public_surface_is_explicit_and_sorted(module):
    mod = importlib.import_module(module)
    assert list(mod.__all__) == sorted(mod.__all__)
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.__all__ names missing {name}"
