"""Out-of-band transport (specbox/transport.py): tokens across processes, reference counts
and garbage collection, orphan sweeps after crashes, the inline path, read-only mappings,
clear errors, and the JSON-RPC baseline. No timed assertions (scripts/bench_transport.py
measures)."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aospec.specbox.transport import (
    SHM_DIR,
    SHM_PREFIX,
    ArtifactBudgetError,
    ArtifactClient,
    ArtifactRef,
    ArtifactServer,
    JsonRpcClient,
    JsonRpcServer,
    ProducerGoneError,
    TransportError,
    UnknownTokenError,
    fill_pattern,
    sweep_orphans,
)

MB = 1 << 20


def _segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)} if SHM_DIR.is_dir() else set()


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    before = _segments()
    yield
    leaked = _segments() - before
    assert not leaked, f"shared-memory segments leaked: {sorted(leaked)}"


class Producer:
    """``python -m aospec.specbox.transport`` in a child process."""

    def __init__(self, *args: str, preexec_fn: Any = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aospec.specbox.transport", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=preexec_fn,
        )
        word, self.address, self.rpc_address, pid = self._line().split()
        assert word == "ready" and int(pid) == self.proc.pid

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the producer exited"
        return line.strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def put(self, size: int, seed: int = 0) -> ArtifactRef:
        return ArtifactRef.from_json(json.loads(self.ask(f"put {size} {seed}")))

    def stats(self) -> dict[str, int]:
        return json.loads(self.ask("stats"))  # type: ignore[no-any-return]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            assert self.proc.wait(timeout=30) == 0
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _expected(size: int, seed: int = 0) -> bytes:
    buf = bytearray(size)
    fill_pattern(memoryview(buf), seed)
    return bytes(buf)


@pytest.mark.parametrize("backing", ["memfd", "shm"])
def test_a_token_round_trips_across_processes(backing: str) -> None:
    producer = Producer("--backing", backing)
    try:
        ref = producer.put(3 * MB + 5, seed=3)
        assert ref.token is not None and 0 <= ref.token < 1 << 64 and ref.size == 3 * MB + 5
        assert ArtifactRef.from_json(json.loads(json.dumps(ref.to_json()))) == ref  # travels in-band as JSON
        with ArtifactClient(ref.address) as client:  # type: ignore[arg-type]
            assert client.ping(ref) == producer.proc.pid
            with client.take(ref) as art:
                assert art.view.readonly and art.view.nbytes == ref.size
                assert art.view == _expected(ref.size, seed=3)
            assert producer.stats()["live"] == 0  # taken, then closed: freed
            with pytest.raises(UnknownTokenError):
                client.open(ref)
    finally:
        producer.close()


def test_reference_counts_and_garbage_collection() -> None:
    with ArtifactServer(threshold=0) as server, ArtifactClient(server.address) as client:
        ref = server.put(b"x" * MB)
        assert server.refcount(ref.token) == 1  # type: ignore[arg-type]
        a = client.open(ref)
        b = client.open(ref)
        assert server.refcount(ref.token) == 3  # type: ignore[arg-type]
        a.close()
        a.close()  # idempotent
        assert server.refcount(ref.token) == 2  # type: ignore[arg-type]
        server.release(ref)
        with pytest.raises(TransportError, match="already released"):
            server.release(ref)
        assert server.refcount(ref.token) == 1  # type: ignore[arg-type]
        assert b.view[:1] == b"x"
        b.close()
        assert server.refcount(ref.token) == 0 and server.stats.freed == 1 and server.stats.live == 0  # type: ignore[arg-type]

        # take: the token's reference moves to the consumer
        ref2 = server.put(b"y" * MB)
        with client.take(ref2) as c:
            assert server.refcount(ref2.token) == 1  # type: ignore[arg-type]
            with pytest.raises(TransportError, match="already released"):
                client.take(ref2)
            assert c.tobytes()[:1] == b"y"
        assert server.tokens() == []

        # a consumer that disconnects drops its leases
        ref3 = server.put(b"z" * MB)
        other = ArtifactClient(server.address)
        held = other.open(ref3)
        assert server.refcount(ref3.token) == 2  # type: ignore[arg-type]
        other.close()
        _wait_for(lambda: server.refcount(ref3.token) == 1)  # type: ignore[arg-type]
        assert held.view[-1:] == b"z"  # the mapping outlives the lease
        held.close()

        # a token nobody took is swept after its age
        assert server.sweep(max_age_s=3600) == 0
        assert server.sweep(max_age_s=0) == 1
        assert server.stats.live == 0 and server.stats.swept == 1


def _wait_for(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    import time

    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_a_crashed_consumer_leaks_no_lease() -> None:
    with ArtifactServer(threshold=0) as server:
        ref = server.put(b"q" * MB)
        code = textwrap.dedent(
            f"""
            import json, os, signal, sys
            from aospec.specbox.transport import ArtifactClient, ArtifactRef
            ref = ArtifactRef.from_json(json.loads({json.dumps(json.dumps(ref.to_json()))}))
            art = ArtifactClient(ref.address).open(ref)
            print(bytes(art.view[:1]).decode(), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            """
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == -signal.SIGKILL and proc.stdout.strip() == "q"
        _wait_for(lambda: server.refcount(ref.token) == 1)  # type: ignore[arg-type]
        server.release(ref)
        assert server.stats.live == 0


def test_orphan_segments_are_swept_after_a_killed_producer() -> None:
    producer = Producer("--backing", "shm")
    ref = producer.put(2 * MB)
    name = f"{SHM_PREFIX}{producer.proc.pid}-{ref.token:016x}"
    assert (SHM_DIR / name).exists()
    client = ArtifactClient(ref.address)  # type: ignore[arg-type]
    art = client.open(ref)
    producer.kill()
    producer.close()
    assert art.view[:4] == _expected(4)  # a mapping stays valid after the producer died
    art.close()  # the lease cannot be dropped any more: closing still works
    with pytest.raises(ProducerGoneError):
        client.open(ref)
    client.close()
    assert (SHM_DIR / name).exists()  # the crash left it behind
    assert name in sweep_orphans()
    assert not (SHM_DIR / name).exists()
    assert name not in sweep_orphans()


def test_a_killed_memfd_producer_leaves_nothing_named_and_mappings_valid() -> None:
    producer = Producer()
    ref = producer.put(4 * MB, seed=9)
    with ArtifactClient(ref.address) as client:  # type: ignore[arg-type]
        art = client.open(ref)
        producer.kill()
        producer.close()
        assert art.view == _expected(4 * MB, seed=9)
        art.close()
        with pytest.raises(ProducerGoneError):
            client.open(ref)
    with pytest.raises(ProducerGoneError, match="cannot reach"):
        ArtifactClient(ref.address)  # type: ignore[arg-type]
    assert not any(n.startswith(f"{SHM_PREFIX}{producer.proc.pid}-") for n in _segments())


def test_small_results_go_inline() -> None:
    with ArtifactServer(threshold=1024) as server:
        ref = server.put(b"tiny result")
        assert ref.is_inline and ref.token is None and ref.size == 11
        assert ref.to_json() == {"size": 11, "inline": "dGlueSByZXN1bHQ="}
        again = ArtifactRef.from_json(ref.to_json())
        assert again == ref
        with ArtifactClient(server.address) as client, client.open(again) as art:
            assert art.view == b"tiny result" and art.view.readonly
        big = server.put(b"b" * 1024)
        assert not big.is_inline
        server.release(big)
        assert server.stats.inline == 1 and server.stats.published == 1 and server.stats.live == 0
        assert server.put(b"").is_inline
    with pytest.raises(TransportError):
        ArtifactRef.from_json({"size": 3, "inline": "dGlueQ=="})  # size does not match


def test_mappings_are_read_only() -> None:
    with ArtifactServer(threshold=0) as server, ArtifactClient(server.address) as client:
        ref = server.put(b"r" * MB)
        with client.open(ref) as art:
            with pytest.raises(TypeError):
                art.view[0] = 0
            with pytest.raises(TypeError):
                art._mmap.write(b"w")  # type: ignore[union-attr]
        fd, size, lease = client.open_fd(ref)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
            with pytest.raises(PermissionError):
                mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"w", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 1)
        finally:
            os.close(fd)
            client.close_lease(lease)
        server.release(ref)


def test_a_writer_publishes_in_place_and_refuses_to_seal_under_a_live_view() -> None:
    with ArtifactServer() as server:
        with server.allocate(MB) as w:
            w.view[:3] = b"abc"
            held = w.view[:3]
            with pytest.raises(TransportError, match="release every view"):
                w.publish()
            held.release()
        assert server.stats.live == 0  # abandoned on leaving the block
        with server.allocate(MB) as w:
            w.view[:3] = b"abc"
            ref = w.publish()
        with ArtifactClient(server.address) as client, client.take(ref) as art:
            assert art.view[:3] == b"abc"


def test_bad_tokens_and_addresses_give_clear_errors() -> None:
    with ArtifactServer(threshold=0) as server, ArtifactClient(server.address) as client:
        with pytest.raises(UnknownTokenError, match="no artifact with token 00000000000000ff"):
            client.open(0xFF)
        with pytest.raises(UnknownTokenError, match="malformed token"):
            client.open("not-hex")
        with pytest.raises(UnknownTokenError, match="64-bit"):
            client.open(1 << 64)
        with pytest.raises(UnknownTokenError):
            server.release(12345)
        with pytest.raises(TransportError, match="served at"):
            client.open(ArtifactRef(10, 1, "@elsewhere"))
        assert client.ping(server.put(b"live")) == os.getpid()  # the connection survives bad requests
    with pytest.raises(ProducerGoneError):
        ArtifactClient("@aospec-no-such-server")
    with pytest.raises(ProducerGoneError):
        ArtifactClient(str(Path("/nonexistent/socket")))


def test_closing_the_server_frees_everything_and_ends_connections() -> None:
    server = ArtifactServer(threshold=0, backing="shm").start()
    ref = server.put(b"s" * MB)
    client = ArtifactClient(server.address)
    art = client.open(ref)
    server.close()
    assert art.view[:1] == b"s"
    art.close()
    with pytest.raises(ProducerGoneError):
        client.open(ref)
    client.close()
    with pytest.raises(TransportError, match="closed"):
        server.put(b"x")


def test_the_json_rpc_baseline_moves_the_same_bytes() -> None:
    producer = Producer()
    try:
        ref = producer.put(2 * MB + 1, seed=5)
        with JsonRpcClient(producer.rpc_address) as rpc:
            assert rpc.get(f"a{ref.token:016x}") == _expected(2 * MB + 1, seed=5)
            with pytest.raises(TransportError, match="JSON-RPC error"):
                rpc.get("missing")
        assert producer.ask(f"release {ref.token:016x}") == "ok"
        assert producer.stats()["live"] == 0
    finally:
        producer.close()
    with JsonRpcServer() as server:
        server.register("x", b"hello")
        with JsonRpcClient(server.address) as rpc:
            assert rpc.call("get", {"name": "x"}) == {"size": 5, "data": "aGVsbG8="}


def test_the_sweep_spares_live_producers_and_catches_reused_pids() -> None:
    mine = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-{'0' * 15}1"
    reused = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-{'0' * 15}2"
    for path in (mine, reused):
        path.write_bytes(b"x")
    try:
        hour_ago = mine.stat().st_mtime - 3600
        os.utime(reused, (hour_ago, hour_ago))  # made before this process started: its pid was reused
        removed = sweep_orphans()
        assert reused.name in removed and not reused.exists()
        assert mine.name not in removed and mine.exists()
    finally:
        for path in (mine, reused):
            path.unlink(missing_ok=True)


def test_ping_needs_a_live_token_so_the_pid_stays_private() -> None:
    """``ping`` answered anyone on the abstract socket with the server's pid (issue 20)."""
    with ArtifactServer(threshold=0) as server, ArtifactClient(server.address) as client:
        ref = server.put(b"x" * 10)
        assert client.ping(ref) == os.getpid()
        server.release(ref)
        for token in (ref.token, 0, "0" * 16):
            with pytest.raises(UnknownTokenError):
                client.ping(token)  # type: ignore[arg-type]
        with pytest.raises(TransportError, match="bad request"):
            client._request({"op": "ping"})


def test_held_bytes_are_bounded_the_oldest_untaken_freed_first() -> None:
    """Three exports of a 500 MB file held 1.5 GB of shared memory for the TTL (issue 20 #7)."""
    with (
        ArtifactServer(threshold=0, max_bytes=3 * MB, limit_flag="--max-held-mb") as server,
        ArtifactClient(server.address) as client,
    ):
        refs = [server.put(bytes([i]) * MB) for i in range(3)]
        assert server.stats.live_bytes == 3 * MB
        fourth = server.put(b"d" * MB)  # the oldest, published and never taken, makes room
        assert server.stats.evicted == 1 and server.stats.live_bytes == 3 * MB
        with pytest.raises(UnknownTokenError):
            client.open(refs[0])
        held = [client.open(r) for r in (refs[1], refs[2], fourth)]  # consumers read them all
        with pytest.raises(ArtifactBudgetError, match=r"3145728-byte limit on held artifacts.*--max-held-mb"):
            server.put(b"e" * MB)
        with pytest.raises(ArtifactBudgetError, match="over the 3145728-byte limit"):
            server.allocate(4 * MB)
        assert server.stats.refused == 2 and server.stats.live_bytes == 3 * MB
        held[0].close()
        server.release(refs[1])  # now nobody holds it: freed
        assert server.put(b"f" * MB).size == MB  # the freed megabyte is free again
        for art in held[1:]:
            art.close()


def test_connections_are_capped_and_the_next_waits_for_a_slot() -> None:
    """One thread per connection, without a cap (issue 20)."""
    with ArtifactServer(threshold=0, max_connections=2) as server:
        ref = server.put(b"x" * 10)
        first, second = ArtifactClient(server.address), ArtifactClient(server.address)
        assert first.ping(ref) == second.ping(ref) == os.getpid()
        third = ArtifactClient(server.address, timeout_s=1.0)  # connects into the listen backlog
        with pytest.raises(ProducerGoneError):
            third.ping(ref)  # not served while two connections are
        third.close()
        first.close()
        with ArtifactClient(server.address, timeout_s=30.0) as fourth:
            assert fourth.ping(ref) == os.getpid()  # a slot came free
        second.close()


def test_the_accept_loop_survives_running_out_of_descriptors() -> None:
    """The first EMFILE ended the accept loop for good (issue 20)."""
    import resource
    import socket

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    producer = Producer("--threshold", "0", preexec_fn=few_descriptors)
    try:
        ref = producer.put(100)
        flood = []
        for _ in range(80):  # more than the producer has descriptors for
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect("\0" + producer.address[1:])
            flood.append(sock)
        fds = Path(f"/proc/{producer.proc.pid}/fd")
        deadline = time.monotonic() + 60
        while len(os.listdir(fds)) < 47 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the producer has run out of descriptors
        for sock in flood:
            sock.close()
        deadline = time.monotonic() + 120  # a hang guard: the closed ones drain from the backlog first
        while True:
            try:
                client = ArtifactClient(producer.address, timeout_s=60.0)
                break
            except ProducerGoneError:  # the listen backlog is still full
                assert time.monotonic() < deadline, "the server stopped accepting"
                time.sleep(0.2)
        with client:
            assert client.ping(ref) == producer.proc.pid
    finally:
        producer.close()
