"""Bad input to ``actcache serve``: every flag and every ``ACTCACHE_*`` variable the daemon reads, each
with a bad value, ends in exit code 2 and one line on stderr naming the flag or variable, the value given
and what is accepted; never a traceback, and the daemon never starts. (ACTCACHE_SHM_DIR is not checked: a
directory where no segment can be made is the designed fallback to the bytes data plane.)

The CLI runs in this process (``actcache.cli.main``) with ``serve`` replaced by a start and stop of the
daemon, so a value wrongly accepted shows as exit code 0 instead of a daemon serving forever.
"""

from __future__ import annotations

import os
import re

import pytest

from actcache.cli import build_parser, main

BAD = "/proc/actcache/cannot-be-created"  # no directory can be made under /proc, root or not

# flag -> (arguments with a bad value, what the error line must say). Each case runs with a good --dir and
# --socket unless it names them; ``{tmp}`` is the test's temp dir, ``{pem}`` a readable file there.
FLAG_CASES = {
    "--dir": (["--dir", BAD], [f"--dir {BAD}", "No such file or directory", "pass --dir"]),
    "--socket": (["--socket", f"{BAD}/s.sock"], [f"--socket {BAD}/s.sock", "pass --socket"]),
    "--socket-mode": (["--socket-mode", "rw"], ["--socket-mode", "'rw'", "octal permission bits"]),
    "--socket-group": (["--socket-group", "no-such-group-here"], ["--socket-group 'no-such-group-here'", "group name or gid"]),
    "--listen": (["--listen", "localhost"], ["--listen", "HOST:PORT", "'localhost'"]),
    "--allow-remote": (["--allow-remote=yes"], ["--allow-remote", "ignored explicit argument 'yes'"]),
    "--token-file": (["--token-file", "{tmp}/no-token"], ["--token-file {tmp}/no-token", "No such file"]),
    "--tls-cert": (["--listen", "127.0.0.1:0", "--tls-key", "{pem}", "--tls-cert", "{tmp}/no.pem"],
                   ["--tls-cert {tmp}/no.pem", "readable file", "PEM"]),
    "--tls-key": (["--listen", "127.0.0.1:0", "--tls-cert", "{pem}", "--tls-key", "{tmp}/no.pem"],
                  ["--tls-key {tmp}/no.pem", "readable file", "PEM"]),
    "--budget": (["--budget", "lots"], ["--budget", "'lots'", "512MiB"]),
    "--namespace-budget": (["--namespace-budget", "-1"], ["--namespace-budget", "'-1'", "512MiB"]),
    "--reclaim-after": (["--reclaim-after=-5"], ["--reclaim-after", "-5", ">= 0"]),
    "--map-size": (["--map-size", "4KiB"], ["map_size_bytes", "4096", "at least 1 MiB", "--map-size"]),
    "--encoding": (["--encoding", "zstd:99"], ["encoding", "'zstd:99'", "-7..22", "--encoding"]),
    "--sync": (["--sync=maybe"], ["--sync", "ignored explicit argument 'maybe'"]),
    "--max-entry-bytes": (["--max-entry-bytes", "12"], ["max_entry_bytes", "12 bytes", "at least 1 KiB", "--max-entry-bytes"]),
    "--on-corrupt": (["--on-corrupt", "ignore"], ["--on-corrupt", "'ignore'", "'refuse', 'move-aside'"]),
    "--disk-reserve": (["--disk-reserve", "some"], ["--disk-reserve", "'some'", "512MiB"]),
    "--explicit-reads": (["--explicit-reads=no"], ["--explicit-reads", "ignored explicit argument 'no'"]),
    "--prefetch-bytes": (["--prefetch-bytes", "1KiB"], ["prefetch_bytes", "1024 bytes", "at least 1 MiB", "--prefetch-bytes"]),
    "--decode-threads": (["--decode-threads", "0"], ["decode_threads", "got 0", ">= 1", "--decode-threads"]),
    "--probe-threads": (["--probe-threads=-1"], ["probe_threads", "got -1", ">= 0", "--probe-threads"]),
    "--probe-bytes": (["--probe-bytes", "far"], ["--probe-bytes", "'far'", "512MiB"]),
    "--workers": (["--workers", "1"], ["workers", "got 1", ">= 2", "--workers"]),
    "--throttle-read-mbps": (["--throttle-read-mbps", "nan"], ["--throttle-read-mbps", "nan", ">= 0"]),
    "--idle-timeout": (["--idle-timeout", "soon"], ["--idle-timeout", "'soon'", "float value"]),
    "--parent-pid": (["--parent-pid", "me"], ["--parent-pid", "'me'", "int value"]),
    "--metrics-port": (["--metrics-port", "70000"], ["--metrics-port", "70000", "0..65535"]),
    "--metrics-host": (["--metrics-port", "0", "--metrics-host", "127.0.0.1:9100"],
                       ["--metrics-host", "'127.0.0.1:9100'", "such as 127.0.0.1"]),
    "--log-level": (["--log-level", "LOUD"], ["--log-level", "'LOUD'", "DEBUG, INFO, WARNING"]),
}

# variable -> (bad value, extra arguments, what the error line must say, besides the variable's name).
ENV_CASES = {
    "ACTCACHE_DIR": (BAD, ["--no-dir"], [BAD, "No such file or directory"]),
    "ACTCACHE_SOCKET": (f"{BAD}/s.sock", ["--no-socket"], [f"{BAD}/s.sock"]),
    "ACTCACHE_SOCKET_MODE": ("0666", [], ["0o666", "0660"]),
    "ACTCACHE_SOCKET_GROUP": ("no-such-group-here", [], ["'no-such-group-here'", "group name or gid"]),
    "ACTCACHE_LISTEN": ("127.0.0.1:99999", [], ["'127.0.0.1:99999'", "port 0..65535"]),
    "ACTCACHE_ALLOW_REMOTE": ("maybe", [], ["'maybe'", "1, true, yes, on, 0, false, no, off"]),
    "ACTCACHE_TOKEN": ("", ["--listen", "127.0.0.1:0"], ["without a token", "empty"]),
    "ACTCACHE_TOKEN_FILE": ("{tmp}/no-token", [], ["{tmp}/no-token", "No such file"]),
    "ACTCACHE_TLS_CERT": ("{tmp}/no.pem", ["--listen", "127.0.0.1:0", "--tls-key", "{pem}"], ["{tmp}/no.pem", "PEM"]),
    "ACTCACHE_TLS_KEY": ("{tmp}/no.pem", ["--listen", "127.0.0.1:0", "--tls-cert", "{pem}"], ["{tmp}/no.pem", "PEM"]),
    "ACTCACHE_BUDGET": ("lots", [], ["'lots'", "512MiB"]),
    "ACTCACHE_NAMESPACE_BUDGET": ("-1", [], ["'-1'", "512MiB"]),
    "ACTCACHE_RECLAIM_AFTER": ("inf", [], ["inf", ">= 0"]),
    "ACTCACHE_MAP_SIZE": ("4KiB", [], ["4KiB", "at least 1 MiB"]),
    "ACTCACHE_ENCODING": ("gzip", [], ["'gzip'", "auto, raw, lz4, zstd"]),
    "ACTCACHE_SYNC": ("maybe", [], ["'maybe'", "1, true, yes, on, 0, false, no, off"]),
    "ACTCACHE_MAX_ENTRY_BYTES": ("12", [], ["'12'", "at least 1 KiB"]),
    "ACTCACHE_ON_CORRUPT": ("ignore", [], ["'ignore'", "'refuse' or 'move-aside'"]),
    "ACTCACHE_DISK_RESERVE": ("some", [], ["'some'", "512MiB"]),
    "ACTCACHE_EXPLICIT_READS": ("sometimes", [], ["'sometimes'", "1, true, yes, on, 0, false, no, off"]),
    "ACTCACHE_PREFETCH_BYTES": ("1KiB", [], ["1KiB", "at least 1 MiB"]),
    "ACTCACHE_DECODE_THREADS": ("two", [], ["'two'", "whole number"]),
    "ACTCACHE_PROBE_THREADS": ("-1", [], ["'-1'", ">= 0"]),
    "ACTCACHE_PROBE_BYTES": ("far", [], ["'far'", "512MiB"]),
    "ACTCACHE_WORKERS": ("1", [], ["'1'", ">= 2"]),
    "ACTCACHE_THROTTLE_READ_MBPS": ("-3", [], ["'-3'", ">= 0"]),
    "ACTCACHE_IDLE_TIMEOUT": ("soon", [], ["'soon'", "number of seconds"]),
    "ACTCACHE_PARENT_PID": ("me", [], ["'me'", "process id of the daemon's parent"]),
    "ACTCACHE_METRICS_PORT": ("nine", [], ["'nine'", "0..65535"]),
    "ACTCACHE_METRICS_HOST": ("host name", ["--metrics-port", "0"], ["'host name'", "such as 127.0.0.1"]),
    "ACTCACHE_LOG_LEVEL": ("chatty", [], ["'chatty'", "DEBUG, INFO, WARNING"]),
}


@pytest.fixture
def serve_cli(tmp_path, monkeypatch, capsys):
    """Run ``actcache serve ARGS`` with ``env`` on top of an environment without ACTCACHE_* variables;
    returns (exit code, stderr lines). ``serve`` starts and stops the daemon instead of serving."""
    import actcache.daemon.service as service

    def start_and_stop(config):
        daemon = service.Daemon(config)
        try:
            daemon.start()
        finally:
            daemon.stop()
        return 0

    monkeypatch.setattr(service, "serve", start_and_stop)
    for name in [n for n in os.environ if n.startswith("ACTCACHE_")]:
        monkeypatch.delenv(name)
    (tmp_path / "cert.pem").write_text("not checked before start\n")

    def run(args: list[str], env: dict[str, str] | None = None) -> tuple[int, list[str]]:
        fill = {"tmp": str(tmp_path), "pem": str(tmp_path / "cert.pem")}
        args = [a.format(**fill) for a in args]
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value.format(**fill))
        base = [] if "--no-dir" in args else ["--dir", str(tmp_path / "cache")]
        base += [] if "--no-socket" in args or "--socket" in args else ["--socket", str(tmp_path / "s.sock")]
        args = [a for a in args if a not in ("--no-dir", "--no-socket")]
        if "--listen" in args and "ACTCACHE_TOKEN" not in (env or {}):
            monkeypatch.setenv("ACTCACHE_TOKEN", "t")
        try:
            code = main(["serve", *base, *args])
        except SystemExit as exc:  # argparse
            code = exc.code
        err = capsys.readouterr().err
        return code, err.splitlines()

    return run


def _serve_flags() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    return {opt for a in sub._actions for opt in a.option_strings if opt.startswith("--") and opt != "--help"} - {
        "--no-sync", "--no-explicit-reads"}


def test_every_serve_flag_and_variable_has_a_case():
    assert set(FLAG_CASES) == _serve_flags()
    assert set(ENV_CASES) == {f"ACTCACHE_{f[2:].replace('-', '_').upper()}" for f in _serve_flags()} | {
        "ACTCACHE_TOKEN"}


def _check(code: int, lines: list[str], names: str, expected: list[str], tmp: str) -> None:
    text = "\n".join(lines)
    assert code == 2, text
    assert "Traceback" not in text, text
    errors = [line for line in lines if line.startswith("actcache serve:")]  # argparse adds its usage above
    assert len(errors) == 1 and errors[0] == lines[-1], text
    for want in [names, *expected]:
        assert want.format(tmp=tmp) in errors[0], (want, errors[0])


@pytest.mark.parametrize("flag", sorted(FLAG_CASES))
def test_a_bad_flag_is_one_line_and_exit_2(serve_cli, tmp_path, flag):
    args, expected = FLAG_CASES[flag]
    code, lines = serve_cli(args)
    _check(code, lines, flag, expected, str(tmp_path))
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize("var", sorted(ENV_CASES))
def test_a_bad_environment_value_is_one_line_and_exit_2(serve_cli, tmp_path, var):
    value, args, expected = ENV_CASES[var]
    code, lines = serve_cli(args, {var: value})
    _check(code, lines, var, expected, str(tmp_path))
    assert not (tmp_path / "s.sock").exists()


def test_good_values_start(serve_cli, tmp_path):
    """The harness itself: the same flags and variables with good values start and stop the daemon."""
    code, lines = serve_cli(["--encoding", "zstd:3", "--socket-mode", "0660"], {"ACTCACHE_SYNC": "yes"})
    assert code == 0, lines


def test_flags_win_over_a_bad_variable(serve_cli):
    code, lines = serve_cli(["--sync"], {"ACTCACHE_SYNC": "maybe"})
    assert code == 0, lines
    assert not any(re.search("ACTCACHE_SYNC", line) for line in lines)


@pytest.mark.parametrize("command", [["stats"], ["ls"], ["drop", "ns"]])
def test_no_daemon_is_one_sentence_naming_where_it_looked_and_the_fix(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ACTCACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ACTCACHE_SOCKET", raising=False)
    assert main([*command, "--timeout", "2"]) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message
    assert f"no daemon at {tmp_path / 'daemon.sock'} (the node daemon's, of ACTCACHE_DIR={tmp_path})" in message
    assert "`actcache serve`" in message and "--socket or ACTCACHE_SOCKET" in message
