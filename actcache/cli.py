"""``actcache`` command line (serve, stats, ls, drop, clean, stop, bench disk): a registry of subcommands,
each an (add_parser, run) pair; ``actcache COMMAND --help`` describes each."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from actcache.daemon.config import format_size as _fmt
from actcache.daemon.config import parse_size
from actcache.errors import ActCacheError, ConfigError, DaemonUnavailable, NamespaceNotFound
from actcache.node import default_dir, default_socket_path, stop_daemon

__all__ = ["main"]

Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
#: "serve" -> its command; "bench disk" -> a subcommand of the group "bench" (described in GROUPS).
COMMANDS: dict[str, tuple[str, Command]] = {}
GROUPS: dict[str, str] = {"bench": "measure this node: what the cache's disk and LMDB deliver"}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    def register(run):
        COMMANDS[name] = (help, (add_arguments, run))
        return run

    return register


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ActCacheError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _connection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", help="daemon Unix socket (default: $ACTCACHE_SOCKET, else the node daemon's, "
                                    "in $ACTCACHE_DIR or ~/.cache/actcache)")
    p.add_argument("--address", help="daemon HOST:PORT instead of a socket")
    p.add_argument("--token-file", help="file holding the daemon's token (or set ACTCACHE_TOKEN)")
    p.add_argument("--tls-ca", help="PEM certificate(s) to verify a TLS daemon at --address")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon (default 10)")


def _client(args: argparse.Namespace):
    from actcache.rpc_client import RpcClient, target_for

    token = Path(args.token_file).read_text().strip() if args.token_file else os.environ.get("ACTCACHE_TOKEN")
    roots = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    return RpcClient(target_for(args.socket or default_socket_path(), args.address), token=token, timeout_s=args.timeout,
                     retries=1, root_certificates=roots)


def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="cache directory (env ACTCACHE_DIR; default: the node daemon's, ~/.cache/actcache)")
    p.add_argument("--socket", help="Unix socket path (env ACTCACHE_SOCKET; default: the node daemon's, DIR/daemon.sock)")
    p.add_argument("--socket-mode", help="permission bits of the socket (default 0600; 0660 shares it with --socket-group)")
    p.add_argument("--socket-group", help="group given the socket, e.g. a project's group")
    p.add_argument("--listen", help="also listen on TCP HOST:PORT (loopback only unless --allow-remote); requires a token")
    p.add_argument("--allow-remote", action="store_true", default=None,
                   help="allow --listen on a non-loopback address (use TLS)")
    p.add_argument("--token-file", help="file holding the TCP token (or set ACTCACHE_TOKEN)")
    p.add_argument("--tls-cert", help="PEM certificate chain for TLS on --listen")
    p.add_argument("--tls-key", help="PEM private key for TLS on --listen")
    p.add_argument("--budget", type=_size, help="byte budget of the whole cache, e.g. 100GiB (default unlimited)")
    p.add_argument("--namespace-budget", type=_size, help="byte budget of each namespace (default unlimited)")
    p.add_argument("--reclaim-after", type=float, metavar="SECONDS",
                   help="a put over a budget first reclaims dead generations: fingerprints no live schedule reads, "
                        "unused for this long (env ACTCACHE_RECLAIM_AFTER; default 600; 0 = only live schedules "
                        "protect a generation)")
    p.add_argument("--map-size", type=_size, help="initial LMDB map size (default 1GiB; grows as needed)")
    p.add_argument("--encoding", help="how entries sent raw are stored: auto (lz4 where it saves 30%%, the default), "
                                      "raw, lz4, zstd or zstd:LEVEL (-7..22)")
    p.add_argument("--sync", action=argparse.BooleanOptionalAction, default=None,
                   help="fsync every commit so acknowledged puts survive an OS crash (default off: they survive a daemon crash)")
    p.add_argument("--max-entry-bytes", type=_size, help="largest entry accepted (default 64MiB)")
    p.add_argument("--on-corrupt", choices=["refuse", "move-aside"],
                   help="LMDB files that are damaged or not an actcache store: refuse to start (default), "
                        "or rename them to *.corrupt-<time> and start empty")
    p.add_argument("--disk-reserve", type=_size,
                   help="free disk space puts leave untouched so that drops can commit (default 64MiB)")
    p.add_argument("--explicit-reads", action=argparse.BooleanOptionalAction, default=None,
                   help="read each value with one pread at its offset in data.mdb (default on; off: copy from the LMDB map)")
    p.add_argument("--prefetch-bytes", type=_size, help="memory for read-ahead entries, shared by all schedules (default 512MiB)")
    p.add_argument("--decode-threads", type=int,
                   help="threads verifying, decompressing and copying Fetch frames into shared memory, each stream's own "
                        "included: it splits a large frame with one of the others (default: one per core)")
    p.add_argument("--probe-threads", type=int,
                   help="threads looking entries up ahead of the readers for cold reads (default 8, 0 = off)")
    p.add_argument("--probe-bytes", type=_size, help="how far ahead of each reader those lookups run (default 64MiB)")
    p.add_argument("--workers", type=int, help="RPC threads (default 16)")
    p.add_argument("--throttle-read-mbps", type=float,
                   help="cap served bytes at this many MB/s, to reproduce a slow disk (experiments; default off)")
    p.add_argument("--idle-timeout", type=float, metavar="SECONDS",
                   help="exit (as on SIGTERM) once no call has been in flight for this long; a Fetch stream is a "
                        "call while it streams (env ACTCACHE_IDLE_TIMEOUT; default 0 = never)")
    p.add_argument("--parent-pid", type=int, metavar="PID",
                   help="exit (as on SIGTERM) once process PID, the daemon's parent, has exited: a trainer's private "
                        "daemon does not outlive a kill -9 (connect(embedded=True) passes it; default off)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this TCP port, 0 = any free port (default off)")
    p.add_argument("--metrics-host", help="address of the metrics endpoint (default 127.0.0.1)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING (default INFO)")


@command("serve", "run the cache daemon", _add_serve)
def _run_serve(args: argparse.Namespace) -> int:
    from actcache.daemon.config import DaemonConfig
    from actcache.daemon.service import serve

    config = DaemonConfig.from_sources(vars(args))
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Directories first, so a bad path is one line naming its flag (a group's socket directory: the daemon's job).
    try:
        config.store.dir.mkdir(parents=True, exist_ok=True)
        if not os.access(config.store.dir, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable", str(config.store.dir))
        if config.server.socket is not None and config.server.socket_group is None:
            config.server.socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return serve(config)
    except OSError as exc:
        error = _path_error(exc, config, vars(args))
        if error is None:
            raise
        raise error from exc


def _path_error(exc: OSError, config, flags: dict) -> ActCacheError | None:
    """A one-line error naming --dir or --socket when ``exc`` is about one of their paths, else None."""
    if exc.filename is None:
        return None
    failed = Path(os.fsdecode(exc.filename))
    directory, socket = config.store.dir, config.server.socket

    def within(path: Path | None) -> bool:
        return path is not None and (failed == path or failed in path.parents)

    if within(directory) or (directory in failed.parents and failed != socket):
        flag, path, what = "--dir", directory, "the cache directory"
    elif within(socket):
        flag, path, what = "--socket", socket, "the socket's directory"
    else:
        return None
    var = "ACTCACHE_" + flag[2:].upper()
    given = flag if flags.get(flag[2:]) is not None else var if os.environ.get(var) else f"{flag} (default)"
    why = "not a directory" if failed.exists() and not failed.is_dir() else exc.strerror
    return ConfigError(
        f"{given} {path}: cannot create or use {what} ({why}: {failed}); pass {flag} (or set {var}) "
        "to a path this user can create and write"
    )


@command("stats", "show the daemon's usage and counters", _connection_flags)
def _run_stats(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    with _client(args) as client:
        reply = client.stats()
    if args.json:
        as_dict = MessageToDict(reply, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)
        print(json.dumps(as_dict, indent=2))
        return 0
    budget = _fmt(reply.budget_bytes) if reply.budget_bytes else "unlimited"
    print(f"actcache {reply.server_version}, up {reply.uptime_seconds:.0f} s")
    print(f"stored   {_fmt(reply.used_bytes)} of {budget} budget; "
          f"file {_fmt(reply.file_bytes)}, map {_fmt(reply.map_size_bytes)}")
    print(f"reclaim  {_fmt(reply.reclaimable_bytes)} in dead generations ({_dead_rule(reply)}); reclaimed "
          f"{reply.reclaimed_generations_total} generations ({_fmt(reply.reclaimed_bytes_total)}) since start")
    hits, misses = reply.hits_total, reply.misses_total
    ratio = f"{hits / (hits + misses):.1%}" if hits + misses else "n/a"
    print(f"puts     {reply.puts_total} entries, {_fmt(reply.put_bytes_total)}")
    print(f"lookups  {reply.gets_total} Get calls, {reply.fetches_total} Fetch streams: {hits} hits, {misses} misses "
          f"(hit ratio {ratio}), served {_fmt(reply.served_bytes_total)}")
    print(f"corrupt  {reply.corrupt_total} entries deleted")
    if reply.page_layout_unrecognized_total:
        print("layout   LMDB's page layout not recognized at start: leaf-page hints and explicit reads are off")
    for ns in reply.namespaces:
        print(f"  {ns.name:<24} {ns.entries:>10} entries {_fmt(ns.bytes):>12}, {_fmt(ns.reclaimable_bytes)} reclaimable")
        for job in ns.jobs:
            print(f"    {_job_line(job, reply.now)}")
    print(f"prefetch budget {_fmt(reply.prefetch_budget_bytes)}, buffered {_fmt(reply.prefetch_buffered_bytes)} "
          f"(max {_fmt(reply.prefetch_max_buffered_bytes)}); {reply.schedules_total} schedules pushed, "
          f"{reply.fetches_total} fetches; reads: {reply.explicit_reads_total} explicit, "
          f"{reply.cached_copies_total} copied from the page cache, {reply.fallback_reads_total} from the map "
          f"(layout not recognized); shared-memory rings: {reply.rings_created_total} made, "
          f"{reply.rings_reused_total} reused; put segments: {reply.put_segments_total}")
    for ns in reply.prefetch:
        print(f"  {ns.namespace:<24} {_counters_line(ns.counters)}; {ns.schedules} live schedules, "
              f"read-ahead {ns.read_ahead_entries} entries ({_fmt(ns.buffered_bytes)})")
    for sc in reply.schedules:
        print(f"  {sc.namespace + '/' + sc.schedule_id:<24} {sc.state:<9} served {sc.served}/{sc.length} "
              f"(ready {sc.ready}, read {sc.read}), read-ahead {sc.read_ahead_entries} entries "
              f"({_fmt(sc.buffered_bytes)}); {_counters_line(sc.counters)}")
    return 0


def _ago(when: float, now: float) -> str:
    """``3m ago`` for a wall-clock time (on the daemon's clock ``now``); ``-`` for 0 (unknown)."""
    if not when:
        return "-"
    age = max(0.0, now - when)
    for unit, seconds in (("d", 86400), ("h", 3600), ("m", 60)):
        if age >= seconds:
            return f"{age // seconds:.0f}{unit} ago"
    return f"{age:.0f}s ago"


def _dead_rule(reply) -> str:
    after = reply.reclaim_after_seconds
    return f"no live schedule, unused for {after:g} s" if after else "no live schedule"


def _job_state(job, now: float) -> str:
    """``running``, ``ended 3m ago``, or, for a job on another host, that the daemon cannot tell."""
    if not job.local:
        return "on another host (running or not: not known here)"
    return f"ended {_ago(job.ended, now)}" if job.ended else "running"


def _job_line(job, now: float) -> str:
    info = job.job
    data = f", data {info.data_id!r}" if info.data_id else ""
    return (f"job pid {info.pid} on {info.host or '?'}, {_job_state(job, now)}, started {_ago(info.start_time, now)}"
            f"{data}: opened {job.opens} times, first {_ago(job.first_seen, now)}, last {_ago(job.last_seen, now)}")


def _counters_line(c) -> str:
    served = c.hits + c.misses
    ready = f"{c.ready_on_ask / served:.1%}" if served else "n/a"
    ratio = f"{c.hit_ratio:.1%}" if served else "n/a"
    return (f"{c.hits} hits, {c.misses} misses (hit ratio {ratio}, {c.corrupt} corrupt), ready when asked {ready}, "
            f"{c.stalls} stalls ({c.stall_seconds:.3f} s), read {_fmt(c.read_bytes)}, served {_fmt(c.served_bytes)} "
            f"({c.direct} entries read directly)")


@command("ls", "list namespaces, fingerprints and depths with their entries and bytes", _connection_flags)
def _run_ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        reply = client.stats()
    rows = [
        {"namespace": g.namespace, "fingerprint": g.fingerprint.hex(), "depth": g.depth, "entries": g.entries, "bytes": g.bytes,
         "last_write": g.last_write_time or None, "last_read": g.last_read_time or None,
         "reclaimable": g.reclaimable, "live_schedules": g.live_schedules}
        for g in reply.groups
    ]
    if args.json:  # times: wall clock seconds (null = unknown); jobs: `actcache stats --json`
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'NAMESPACE':<24} {'FINGERPRINT':<32} {'DEPTH':>5} {'ENTRIES':>10} {'BYTES':>12} "
          f"{'WRITTEN':>9} {'READ':>9}  RECLAIMABLE")
    for r in rows:
        live = r["live_schedules"]
        reclaim = "yes" if r["reclaimable"] else f"no ({live} live schedule{'s' * (live != 1)})" if live else "no"
        print(f"{r['namespace']:<24} {r['fingerprint']:<32} {r['depth']:>5} {r['entries']:>10} {_fmt(r['bytes']):>12} "
              f"{_ago(r['last_write'] or 0, reply.now):>9} {_ago(r['last_read'] or 0, reply.now):>9}  {reclaim}")
    print(f"(a generation, a namespace's fingerprint at every depth, is reclaimable when dead: {_dead_rule(reply)})")
    for ns in reply.namespaces:
        if ns.jobs:
            running = sum(j.local and not j.ended for j in ns.jobs)
            ended = sum(j.local and bool(j.ended) for j in ns.jobs)
            print(f"jobs of {ns.name}: {running} running, {ended} ended")
            for job in sorted(ns.jobs, key=lambda j: (bool(j.ended), -j.last_seen)):  # running first
                print(f"  {_job_line(job, reply.now)}")
    return 0


def _add_drop(p: argparse.ArgumentParser) -> None:
    _connection_flags(p)
    p.add_argument("namespace", help="namespace to drop entries of")
    p.add_argument("--fingerprint", help="only this fingerprint (32 hex digits)")
    p.add_argument("--depth", type=int, help="only this depth (with --fingerprint)")
    p.add_argument("--secret-file", help="file holding the namespace's secret, if it was created with one")


@command("drop", "delete a namespace's entries, or one fingerprint's, or one depth's", _add_drop)
def _run_drop(args: argparse.Namespace) -> int:
    fingerprint = bytes.fromhex(args.fingerprint) if args.fingerprint else None
    with _client(args) as client:
        secret = Path(args.secret_file).read_bytes().strip() if args.secret_file else None
        try:
            ns = client.open(args.namespace, create=False, secret=secret)
        except NamespaceNotFound:
            names = sorted(n.name for n in client.stats().namespaces)
            print(json.dumps({"entries": 0, "bytes": 0, "namespaces": names}) if args.json else
                  f"nothing to drop: there is no namespace {args.namespace!r} on {client.target}; its namespaces: "
                  f"{', '.join(names) if names else '(none)'} (`actcache ls` lists their entries)")
            return 0
        reply = client.drop(ns.namespace_id, fingerprint, args.depth)
    print(json.dumps({"entries": reply.entries, "bytes": reply.bytes}) if args.json
          else f"dropped {reply.entries} entries ({_fmt(reply.bytes)}) from {args.namespace}")
    return 0


def _add_clean(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", help="daemon Unix socket to check (default: $ACTCACHE_SOCKET, else the node daemon's)")
    p.add_argument("--dir", help="cache directory to check (default: $ACTCACHE_DIR; without it only the socket is checked)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


@command("clean", "reclaim leftovers of crashes: stale socket, stale LMDB reader slots, bench temp files", _add_clean)
def _run_clean(args: argparse.Namespace) -> int:
    from actcache.ops.clean import Action, clean

    directory = args.dir or os.environ.get("ACTCACHE_DIR")
    findings = clean(
        socket_path=Path(args.socket) if args.socket else default_socket_path(),
        directory=Path(directory) if directory else None,
    )
    if args.json:
        print(json.dumps([{**vars(f), "action": f.action.value} for f in findings], indent=2))
    else:
        for f in findings:
            print(f"{f.action.value:<8} {f.reclaimer:<13} {f.path}: {f.detail}")
    return 1 if any(f.action is Action.FAILED for f in findings) else 0


def _add_stop(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", help="Unix socket of the daemon to stop (default: $ACTCACHE_SOCKET, else this node's "
                                    "daemon, $ACTCACHE_DIR or ~/.cache/actcache)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for it to exit (default 30)")


@command("stop", "stop a daemon: SIGTERM to the process on its socket, then wait until it has exited", _add_stop)
def _run_stop(args: argparse.Namespace) -> int:
    socket = Path(args.socket) if args.socket else default_socket_path()
    pid = stop_daemon(socket, args.timeout)
    print(f"stopped the daemon on {socket} (pid {pid})" if pid else f"no daemon is listening on {socket}; nothing to stop")
    return 0


def _add_bench_disk(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="a directory on the filesystem to measure (default: the node daemon's, "
                                 "$ACTCACHE_DIR or ~/.cache/actcache, created if missing)")
    p.add_argument("--size", type=_size, default=1 << 30,
                   help="bytes of the test file and of the test LMDB, e.g. 4GiB (default 1GiB)")
    p.add_argument("--drop-caches", action=argparse.BooleanOptionalAction, default=True,
                   help="drop the whole page cache before cold phases when /proc/sys/vm/drop_caches is writable "
                        "(default on; off, only the bench's own files are evicted)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


@command("bench disk", "sequential and random 1 MiB read/write MB/s (O_DIRECT, cold, warm) and LMDB get throughput "
                      "of a directory's filesystem", _add_bench_disk)
def _run_bench_disk(args: argparse.Namespace) -> int:
    from actcache.ops.diskbench import run_disk_bench

    directory = Path(args.dir) if args.dir else default_dir()
    if not args.dir:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    report = run_disk_bench(directory, args.size, drop_caches=args.drop_caches, progress=sys.stderr.isatty())
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actcache", description="Activation cache daemon and tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups = {}  # group name -> its subparsers
    for name, (help_text, (add_arguments, run)) in COMMANDS.items():
        where, leaf = sub, name
        if " " in name:
            group, leaf = name.split(" ", 1)
            if group not in groups:
                g = sub.add_parser(group, help=GROUPS[group], description=GROUPS[group])
                groups[group] = g.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
            where = groups[group]
        p = where.add_parser(leaf, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(run=run, command_name=name)
    return parser


def _message(args: argparse.Namespace, exc: ActCacheError) -> str:
    """``exc``, or how to start a daemon when a command given no --address found none on its socket."""
    socket = getattr(args, "socket", None) or default_socket_path()
    if not isinstance(exc, DaemonUnavailable) or not hasattr(args, "socket") or getattr(args, "address", None) \
            or Path(socket).exists():
        return str(exc)
    whose = "given by --socket" if args.socket else "from ACTCACHE_SOCKET" if os.environ.get("ACTCACHE_SOCKET") \
        else f"the node daemon's, of ACTCACHE_DIR={os.environ['ACTCACHE_DIR']}" if os.environ.get("ACTCACHE_DIR") \
        else "the node daemon's, of ~/.cache/actcache"
    return (f"no daemon at {socket} ({whose}); start one with `actcache serve` (or a training run's connect()), "
            "or point --socket or ACTCACHE_SOCKET at a running daemon")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ActCacheError as exc:
        print(f"actcache {args.command_name}: {_message(args, exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
