"""Access control against real daemons: namespace secrets and handles, TLS, loopback-only TCP, shared sockets."""

import grp
import os
import random
import re
import shutil
import stat
import subprocess
import sys

import pytest

from actcache.codec import DType, TensorSpec, encode_entry
from actcache.errors import DaemonUnavailable, NamespaceNotFound, PermissionDenied, Unauthenticated
from actcache.rpc_client import RpcClient
from actcache.testing import run_daemon

FP = bytes(range(16))
SPEC = [TensorSpec(DType.uint8, (1000,))]


def entry(seed: int) -> bytes:
    """Incompressible, so the daemon stores exactly these bytes."""
    return encode_entry(SPEC, [random.Random(seed).randbytes(1000)])


@pytest.mark.slow
def test_another_job_cannot_open_read_or_overwrite_a_protected_namespace(tmp_path):
    with run_daemon(cache_dir=tmp_path / "cache") as d:
        with d.client() as job_a, d.client() as job_b:
            handle = job_a.open("a", secret="correct horse").namespace_id
            assert handle >= 2**32  # a random 64-bit handle, not the small id
            job_a.put(handle, FP, 1, [(i, 0, entry(i)) for i in range(10)])

            with pytest.raises(PermissionDenied, match="wrong secret for namespace 'a'"):
                job_b.open("a", secret="battery staple")
            with pytest.raises(PermissionDenied, match="is protected by a secret; pass it to Open"):
                job_b.open("a")
            small_id = next(ns.namespace_id for ns in job_b.stats().namespaces if ns.name == "a")
            with pytest.raises(PermissionDenied, match="address it by the handle Open returned"):
                job_b.get(small_id, FP, 1, [0])
            with pytest.raises(PermissionDenied):
                job_b.put(small_id, FP, 1, [(0, 0, entry(99))])
            with pytest.raises(PermissionDenied):
                job_b.drop(small_id)
            rng = random.Random(0)
            for guess in [handle ^ 1, handle + 1, 2**32, 2**64 - 1, *(rng.randrange(2**32, 2**64) for _ in range(200))]:
                with pytest.raises(NamespaceNotFound, match="not known to this daemon"):
                    job_b.get(guess, FP, 1, [0])
            with pytest.raises(NamespaceNotFound):
                job_b.put(handle + 1, FP, 1, [(0, 0, entry(99))])

            assert [bytes(v) for v in job_a.get(handle, FP, 1, range(10))] == [entry(i) for i in range(10)]
            assert job_b.open("a", secret="correct horse").namespace_id == handle  # the secret is the authority
            public = job_b.open("b").namespace_id
            assert public < 2**32
            with pytest.raises(PermissionDenied, match="created without a secret"):
                job_a.open("b", secret="late")
        d.stop()
        d.start()
        with d.client() as job_a, d.client() as job_b:
            with pytest.raises(NamespaceNotFound, match="call Open again"):
                job_a.get(handle, FP, 1, [0])  # handles last one daemon run
            with pytest.raises(PermissionDenied, match="wrong secret"):
                job_b.open("a", secret="battery staple")  # the hash was persisted
            fresh = job_a.open("a", secret="correct horse").namespace_id
            assert fresh != handle
            assert bytes(job_a.get(fresh, FP, 1, [3])[0]) == entry(3)


def _self_signed(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make a self-signed certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


@pytest.mark.slow
def test_tcp_with_tls_and_token(tmp_path):
    cert, key = _self_signed(tmp_path)
    args = ("--listen", "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key", str(key))
    with run_daemon(*args, env={"ACTCACHE_TOKEN": "s3cret"}) as d:
        port = re.search(r"\(port (\d+)\) with TLS", d.log_path.read_text()).group(1)
        roots = cert.read_bytes()
        with RpcClient(f"localhost:{port}", token="s3cret", root_certificates=roots, retries=0) as good:
            assert good.open("tls").namespace_id >= 1
        with RpcClient(f"localhost:{port}", token="wrong", root_certificates=roots, retries=0) as bad:
            with pytest.raises(Unauthenticated):
                bad.open("tls")
        with RpcClient(f"127.0.0.1:{port}", token="s3cret", retries=0, timeout_s=5) as plain:
            with pytest.raises(DaemonUnavailable):  # no TLS handshake, no service
                plain.open("tls")
        out = subprocess.run(
            [sys.executable, "-m", "actcache", "stats", "--json", "--address", f"localhost:{port}", "--tls-ca", str(cert)],
            capture_output=True, text=True, timeout=60, env={**os.environ, "ACTCACHE_TOKEN": "s3cret"},
        )
        assert out.returncode == 0 and '"tls"' in out.stdout, out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "0.0.0.0:0"], "is not a loopback address; .* unless --allow-remote"),
        (["--listen", "example.org:7070"], "is not a loopback address"),
        (["--listen", "127.0.0.1:0", "--tls-cert", "c.pem"], "TLS needs both --tls-cert FILE and --tls-key FILE"),
        (["--socket-mode", "0666"], "would let every local user connect"),
        (["--socket-group", "no-such-group-here"], "is not a group on this machine"),
    ],
)
@pytest.mark.slow
def test_serve_refuses_unsafe_endpoints(tmp_path, args, message):
    out = subprocess.run(
        [sys.executable, "-m", "actcache", "serve", "--dir", str(tmp_path / "c"), "--socket", str(tmp_path / "s.sock"), *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, "ACTCACHE_TOKEN": "t"},
    )
    assert out.returncode == 2
    assert re.search(message, out.stderr), out.stderr


def test_allow_remote_accepts_any_host():
    from actcache.daemon.config import ServerConfig, is_loopback

    assert ServerConfig(listen="0.0.0.0:7070", token="t", allow_remote=True).allow_remote
    assert [is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "[::1]", "localhost", "0.0.0.0", "10.0.0.1", "host")] == [
        True, True, True, True, False, False, False]


@pytest.mark.slow
def test_socket_shared_with_a_group():
    others = [g for g in grp.getgrall() if g.gr_gid != os.getegid()]
    group = others[0] if os.geteuid() == 0 and others else grp.getgrgid(os.getegid())
    with run_daemon("--socket-mode", "0660", "--socket-group", group.gr_name) as d:
        st = os.stat(d.socket)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == group.gr_gid
        with d.client() as c:
            assert c.stats().server_version
