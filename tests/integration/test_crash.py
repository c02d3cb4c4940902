"""kill -9 under write load: every acknowledged put survives, nothing is torn, restart needs no cleanup.

Three writer processes stream puts (ids of their own and ids shared with the
others; an entry's content is derived from its sample id alone, so a mix-up
shows). After each PutReply a writer appends the batch's ids to its ack file.
Twenty times, at a random moment while puts are in flight, the daemon is
killed with SIGKILL and restarted on the same directory and socket while the
writers pause; every id in the ack files must then read back bit-exact (the daemon checks each
entry's CRC, the test decodes and compares). Rounds alternate the default
(no fsync) and ``--sync``. At the end the LMDB file is scanned offline: every
stored entry verifies and has the right content, and the usage rows equal
what is stored.
"""

import multiprocessing
import os
import random
import struct
from pathlib import Path

import lmdb
import numpy as np
import pytest

from actcache.codec import DType, TensorSpec, decode_entry, encode_entry, verify_entry
from actcache.errors import ActCacheError
from actcache.keys import sample_id_of
from actcache.rpc_client import RpcClient
from actcache.testing import DaemonProcess

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

FP = bytes(range(100, 116))
DEPTH = 3
ROUNDS = 20
WRITERS = 3
SHARED_IDS = 400  # ids every writer puts (same content: derived from the id)


def content(sample_id: int) -> bytes:
    """The one correct entry for ``sample_id``: 0.5-9 KiB, about half zeros (so zstd applies to some)."""
    rng = np.random.default_rng(sample_id)
    n = 512 + (sample_id % 13) * 700
    data = rng.integers(0, 256, n, dtype=np.uint8) * (rng.random(n) < 0.5)
    specs = [TensorSpec(DType.uint8, (n,)), TensorSpec(DType.int64, (1,))]
    return encode_entry(specs, [data.astype(np.uint8), np.array([sample_id], np.int64)])


def same_tensors(stored, sample_id: int) -> bool:
    """``stored`` (as the daemon keeps it, maybe zstd-compressed) holds exactly the tensors of ``content(sample_id)``."""
    got, want = decode_entry(stored), decode_entry(content(sample_id))
    return got[0].specs == want[0].specs and bytes(got[1]) == bytes(want[1])


def _writer(target: str, worker: int, ack_path: str, seed: int, stop, go, acks, cond) -> None:
    rng = random.Random(seed)
    fd = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    client, ns, counter = None, None, 0
    while not stop.is_set():
        go.wait()
        if client is None:
            client, ns = RpcClient(target, timeout_s=10, retries=0), None
        ids = [(worker + 1) << 40 | (counter + k) for k in range(3)] + [rng.randrange(SHARED_IDS) for _ in range(2)]
        counter += 3
        try:
            if ns is None:
                ns = client.open("crash").namespace_id
            client.put(ns, FP, DEPTH, [(i, 0, content(i)) for i in ids])
        except ActCacheError:  # killed, or not back yet: reconnect with a fresh channel
            client.close()
            client = None
            stop.wait(0.05)
            continue
        os.write(fd, (" ".join(map(str, ids)) + "\n").encode())  # acknowledged
        with cond:
            acks.value += 1
            cond.notify_all()
    if client is not None:
        client.close()
    os.close(fd)


def acknowledged(paths: list[Path]) -> set[int]:
    ids: set[int] = set()
    for path in paths:
        text = path.read_text() if path.exists() else ""
        for line in text.splitlines(keepends=True):
            if line.endswith("\n"):  # a line being appended right now is not complete yet
                ids.update(int(i) for i in line.split())
    return ids


def verify(daemon: DaemonProcess, ids: set[int]) -> None:
    ordered = sorted(ids)
    with daemon.client(timeout_s=60) as client:
        ns = client.open("crash", create=False).namespace_id
        for start in range(0, len(ordered), 512):
            chunk = ordered[start : start + 512]
            for sample_id, value in zip(chunk, client.get(ns, FP, DEPTH, chunk)):
                assert value is not None, f"acknowledged entry {sample_id} was lost"
                assert same_tensors(value, sample_id), f"entry {sample_id} differs from what was acknowledged"


def scan_offline(cache_dir: Path) -> int:
    """Check every stored entry and the usage rows directly in data.mdb; returns the number of entries."""
    env = lmdb.open(str(cache_dir), max_dbs=8, readonly=True)
    try:
        entries, groups = env.open_db(b"entries"), env.open_db(b"groups")
        usage: dict[bytes, list[int]] = {}
        with env.begin() as txn:
            for key, value in txn.cursor(db=entries):
                verify_entry(value)
                sample_id = sample_id_of(key)
                assert same_tensors(value, sample_id), f"stored entry {sample_id} has wrong content"
                group = usage.setdefault(key[:22], [0, 0])
                group[0] += 1
                group[1] += len(value)
            rows = {bytes(k): list(struct.unpack(">QQ", v)) for k, v in txn.cursor(db=groups)}
        assert {k: v for k, v in rows.items() if v[0]} == usage
        return sum(n for n, _ in usage.values())
    finally:
        env.close()


def test_acknowledged_puts_survive_kill_9(tmp_path, capsys):
    seed = int(os.environ.get("ACTCACHE_CRASH_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    ctx = multiprocessing.get_context("spawn")
    stop, go, cond, acks = ctx.Event(), ctx.Event(), ctx.Condition(), ctx.Value("q", 0)
    daemon = DaemonProcess(tmp_path / "cache", tmp_path / "daemon.sock")
    ack_paths = [tmp_path / f"acks-{w}.txt" for w in range(WRITERS)]
    daemon.start()
    writers = [
        ctx.Process(target=_writer, args=(daemon.target, w, str(ack_paths[w]), seed + w, stop, go, acks, cond))
        for w in range(WRITERS)
    ]
    for p in writers:
        p.start()
    verified = 0
    try:
        for round_ in range(ROUNDS):
            go.set()
            with cond:
                target = acks.value + rng.randint(3, 40)
                assert cond.wait_for(lambda target=target: acks.value >= target, timeout=90), (
                    f"writers stalled in round {round_} (seed {seed})\n{daemon.log_tail()}"
                )
            stop.wait(rng.uniform(0, 0.02))  # a random moment, with puts in flight
            daemon.kill()
            go.clear()  # writers pause at their next attempt, until the restarted daemon is checked
            daemon.args = ["--sync"] if round_ % 2 else []
            daemon.start()  # same directory and socket, no cleanup
            ids = acknowledged(ack_paths)
            try:
                verify(daemon, ids)
            except AssertionError as exc:
                raise AssertionError(f"{exc} (round {round_}; random choices: ACTCACHE_CRASH_SEED={seed})") from None
            verified += len(ids)
    finally:
        stop.set()
        go.set()
        for p in writers:
            p.join(60)
        code = daemon.stop()
    assert all(p.exitcode == 0 for p in writers), [p.exitcode for p in writers]
    assert code == 0, daemon.log_tail()
    final = acknowledged(ack_paths)
    stored = scan_offline(tmp_path / "cache")
    assert stored >= len(final)
    with capsys.disabled():
        print(f"\nkill -9: {ROUNDS} rounds (seed {seed}), {len(final)} acknowledged entries, "
              f"{verified} entry checks after restarts, {stored} entries scanned offline")
