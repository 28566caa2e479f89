"""The vLLM connector's data path without vLLM: the background saver and the lookup
that also acquires, against a real daemon.

The saver must never lose an accepted save silently, never hang its caller on a dead
or frozen daemon, and park the blocks as they were when the step snapshotted them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import socket
import threading
from typing import Callable, Iterator

import pytest
import torch

from kvpark.client import Client, InvalidArgument, LeaseExpired, TransportUnavailable
from kvpark.client import vllm_io
from kvpark.client.vllm_io import STATS, BackgroundSaver, Conn, gather_blocks, scatter_blocks, staging_for
from kvpark.daemon.server import Daemon

NUM_BLOCKS, HEADS, BS, DIM, L = 8, 2, 32, 64, 2  # CPU-backend layout: 16 KiB a block
ATTRS = {"layout": "test"}


def layers(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, HEADS, BS, 2 * DIM, generator=g).to(torch.bfloat16) for _ in range(L)]


def keys(prefix: str, n: int) -> list[str]:
    return [f"kvblk-{prefix}-{i}" for i in range(n)]


@pytest.fixture(autouse=True)
def clean_stats() -> Iterator[None]:
    STATS.clear()
    yield
    STATS.clear()


@pytest.fixture
def hung_address() -> Iterator[str]:
    """A TCP port that accepts connections and never answers: a frozen daemon."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join(2)
    for s in held:
        s.close()
    srv.close()


def test_snapshot_is_what_gets_saved_even_if_the_blocks_are_reused(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    kv = layers(0)
    ids, ks = [5, 1, 6], keys("snap", 3)
    expected = [torch.stack([layer[i] for layer in kv]) for i in ids]
    saver = BackgroundSaver(Conn(d.address, "auto"), timeout_s=10, max_pending_bytes=1 << 30)
    # Step: hold the saver's lock so its thread cannot start the park before the engine
    # reuses the blocks: the park must read the snapshot, never the live blocks.
    with saver._cv:
        assert saver.submit(ks, gather_blocks(kv, 0, ids), ATTRS)
        for layer in kv:
            layer.zero_()
    assert saver.drain(30) and saver.close() == 0
    with Client(d.address) as c:
        assert c.lookup(ks) == 3
        _, got = c.restore_many(ks)
        for g, e in zip(got, expected):
            assert torch.equal(g, e)
    assert STATS["saves"] == 1 and STATS["saved_blocks"] == 3 and not STATS["errors.save"]


def test_gather_and_scatter_round_trip_on_both_layouts() -> None:
    for dim, shape in ((0, (NUM_BLOCKS, HEADS, BS, 2 * DIM)), (1, (2, NUM_BLOCKS, BS, HEADS, DIM))):
        src = [torch.randn(shape) for _ in range(L)]
        dst = [torch.zeros(shape) for _ in range(L)]
        packed = gather_blocks(src, dim, [3, 0, 7])
        assert tuple(packed.shape[:2]) == (3, L)
        scatter_blocks(dst, dim, [1, 2, 4], packed)
        for s, t in zip(src, dst):
            for a, b in ((3, 1), (0, 2), (7, 4)):
                assert torch.equal(s.select(dim, a), t.select(dim, b))


def test_saves_in_flight_at_shutdown_are_completed(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    kv = layers(1)
    saver = BackgroundSaver(Conn(d.address, "auto"), timeout_s=10, max_pending_bytes=1 << 30)
    batches = [keys(f"shut{j}", 2) for j in range(6)]
    for j, ks in enumerate(batches):
        assert saver.submit(ks, gather_blocks(kv, 0, [j, j + 1]), ATTRS)
    # Step: close at once, with saves still queued: they are all parked, none dropped.
    assert saver.close() == 0
    with Client(d.address) as c:
        assert all(c.lookup(ks) == 2 for ks in batches)
    assert STATS["saves"] == 6 and not STATS["saves_abandoned"]
    # A closed saver refuses new work, and says so.
    assert not saver.submit(keys("late", 1), gather_blocks(kv, 0, [0]), ATTRS)
    assert STATS["saves_dropped"] == 1 and STATS["errors.save"] == 1


def test_a_save_stuck_at_shutdown_is_reported_not_silently_lost(hung_address: str) -> None:
    kv = layers(2)
    saver = BackgroundSaver(Conn(hung_address, "inline", connect_timeout_s=2), timeout_s=2,
                            max_pending_bytes=1 << 30)
    assert saver.submit(keys("stuck", 1), gather_blocks(kv, 0, [0]), ATTRS)
    assert saver.submit(keys("stuck2", 1), gather_blocks(kv, 0, [1]), ATTRS)
    # Step: the daemon never answers; shutdown gives up after its own bound and reports both.
    assert saver.close(timeout=0.5) == 2
    assert STATS["saves_abandoned"] == 2 and STATS["errors.save"] == 1
    saver._thread.join(10)  # the hung park ends at its own deadline (and counts there)
    assert not saver._thread.is_alive()


def test_a_dead_daemon_fails_saves_fast_and_counted(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    kv = layers(3)
    saver = BackgroundSaver(Conn(d.address, "auto"), timeout_s=5, max_pending_bytes=1 << 30)
    assert saver.submit(keys("alive", 1), gather_blocks(kv, 0, [0]), ATTRS)
    assert saver.drain(30)
    assert STATS["saves"] == 1
    # Step: the daemon dies between steps; later saves fail in the background, counted,
    # and neither submit nor drain raises or waits past the save deadline.
    d.stop(0.5)
    for j in range(3):
        assert saver.submit(keys(f"dead{j}", 1), gather_blocks(kv, 0, [j]), ATTRS)
    assert saver.drain(30)
    assert STATS["errors.save"] == 3 and STATS["saves"] == 1
    assert saver.close() == 0


def test_a_frozen_daemon_costs_each_save_its_deadline_and_no_more(hung_address: str) -> None:
    kv = layers(4)
    saver = BackgroundSaver(Conn(hung_address, "inline", connect_timeout_s=0.5), timeout_s=0.5, max_pending_bytes=1 << 30)
    assert saver.submit(keys("frozen", 1), gather_blocks(kv, 0, [0]), ATTRS)
    assert saver.drain(30), "a save past its deadline must fail, not hang"
    assert STATS["errors.save"] == 1 and not STATS["saves"]
    assert saver.close() == 0


def test_a_full_queue_drops_the_save_after_its_deadline(hung_address: str) -> None:
    kv = layers(5)
    one = gather_blocks(kv, 0, [0])
    saver = BackgroundSaver(Conn(hung_address, "inline", connect_timeout_s=0.5), timeout_s=0.5, max_pending_bytes=one.numel() * 2)
    assert saver.submit(keys("q0", 1), one, ATTRS)  # always accepted, even alone over the bound
    # Step: the queue is full while the first save hangs; the next submit waits at most
    # its own deadline, then the snapshot is dropped and counted. Its deadline ends well
    # before the first save's can (0.2 s against 0.5 s), so the first cannot fail and
    # make room while it waits, however slow the machine.
    saver.timeout_s = 0.2
    assert not saver.submit(keys("q1", 1), gather_blocks(kv, 0, [1]), ATTRS)
    assert STATS["saves_dropped"] == 1
    assert saver.drain(30) and saver.close() == 0


def test_a_full_queue_drops_the_save_after_a_few_ms_not_its_deadline(hung_address: str) -> None:
    """The wait for room is inside the engine's step: bounded by ``max_wait_s``, not by
    the save's deadline. The first save hangs on a connect that gives up after 3 s and
    frees the queue; a submit that waited up to its 30 s deadline would then be accepted."""
    kv = layers(6)
    one = gather_blocks(kv, 0, [0])
    saver = BackgroundSaver(Conn(hung_address, "inline", connect_timeout_s=3), timeout_s=30,
                            max_pending_bytes=one.numel() * 2, max_wait_s=0.005)
    assert saver.submit(keys("w0", 1), one, ATTRS)
    assert not saver.submit(keys("w1", 1), gather_blocks(kv, 0, [1]), ATTRS)
    assert STATS["saves_dropped"] == 1 and STATS["saves_queued"] == 1
    assert saver.drain(30) and saver.close() == 0


def test_the_saver_reads_a_snapshot_only_once_its_gather_event_is_done(daemon: Callable[..., Daemon]) -> None:
    """``ready`` is waited on before the first byte is read: an event that is not done
    holds the save back (on CPU a stand-in event object; on a GPU the gather's CUDA event,
    tests/daemon/test_cuda_paths.py)."""
    d = daemon()
    kv = layers(7)
    saver = BackgroundSaver(Conn(d.address, "auto"), timeout_s=10, max_pending_bytes=1 << 30)

    class Gate:  # what the saver needs of an event: synchronize()
        def __init__(self) -> None:
            self.open = threading.Event()

        def synchronize(self) -> None:
            assert self.open.wait(10)

    gate = Gate()
    packed = gather_blocks(kv, 0, [2, 3])
    assert saver.submit(keys("ev", 2), packed, ATTRS, gate)
    assert not saver.drain(0.3), "the save ran before its gather's event was done"
    gate.open.set()
    assert saver.drain(30) and STATS["saves"] == 1
    with Client(d.address) as c:
        (got,) = c.restore(keys("ev", 2)[1])
        assert torch.equal(got, packed[1])
    saver.close()


def test_wait_for_saves_drains_every_saver(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    kv = layers(6)
    savers = [BackgroundSaver(Conn(d.address, "auto"), timeout_s=10, max_pending_bytes=1 << 30) for _ in range(2)]
    for j, s in enumerate(savers):
        assert s.submit(keys(f"w{j}", 2), gather_blocks(kv, 0, [0, 1]), ATTRS)
    assert vllm_io.wait_for_saves(30)
    assert all(s.pending == 0 for s in savers)
    with Client(d.address) as c:
        assert c.lookup(keys("w0", 2) + keys("w1", 2)) == 4
    for s in savers:
        s.close()


# ---------------------------------------------------------------- lookup + acquire in one call


def park_blocks(c: Client, ks: list[str], kv: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    packed = gather_blocks(kv, 0, ids)
    c.park_batch({k: [packed[j]] for j, k in enumerate(ks)}, attrs=ATTRS)
    return packed


def test_lookup_acquire_small_hit_comes_inline_in_one_round_trip(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    kv = layers(7)
    ks = keys("small", 4)
    with Client(d.address) as c:
        packed = park_blocks(c, ks, kv, [0, 1, 2, 3])
        hit, grant = c.lookup_acquire(ks + ["kvblk-missing"], skip=1)
        assert hit == 4 and grant is not None
        assert grant.inlined and grant.count == 3 and not grant.lease_id
        out = staging_for(kv, 0, 3)
        c.restore_grant(grant, into_flat=out)
        assert torch.equal(out, packed[1:])
        # max_ids bounds what is acquired; the prefix is still the whole hit.
        hit, grant = c.lookup_acquire(ks, skip=0, max_ids=2)
        assert hit == 4 and grant is not None and grant.count == 2 and grant.nbytes == 2 * packed[0].nbytes
        # Nothing past skip: no grant.
        assert c.lookup_acquire(ks, skip=4) == (4, None)
        with pytest.raises(InvalidArgument):
            c.lookup_acquire(ks, skip=-1)


def test_lookup_acquire_large_hit_is_leased_until_released(daemon: Callable[..., Daemon]) -> None:
    d = daemon()
    kv = [torch.randn(NUM_BLOCKS, HEADS, BS, 2 * DIM).to(torch.bfloat16) for _ in range(8)]  # 64 KiB a block
    ks = keys("large", 6)
    with Client(d.address) as c:
        packed = park_blocks(c, ks, kv, [0, 1, 2, 3, 4, 5])
        hit, grant = c.lookup_acquire(ks, skip=2)
        assert hit == 6 and grant is not None and not grant.inlined and grant.lease_id
        out = staging_for(kv, 0, 4)
        c.restore_grant(grant, into_flat=out, release=False)
        assert torch.equal(out, packed[2:])
        assert d.engine is not None and d.engine.leases.count == 1  # held until released
        c.release_grant(grant)
        assert d.engine.leases.count == 0
        # A grant too old to read safely (its lease could be near its end) is refused.
        _, grant = c.lookup_acquire(ks, skip=0)
        assert grant is not None
        with pytest.raises(LeaseExpired):
            c.restore_grant(dataclasses.replace(grant, usable_until=0.0), into_flat=staging_for(kv, 0, 6))
        c.release_grant(grant)
        # A client without the arena cannot copy a leased grant: it says so.
        _, grant = c.lookup_acquire(ks, skip=0)
        assert grant is not None
        with Client(d.address, transport="inline") as remote:
            with pytest.raises(TransportUnavailable):
                remote.restore_grant(grant, into_flat=staging_for(kv, 0, 6))
            remote.release_grant(grant)
        assert d.engine.leases.count == 0


def test_lookup_acquire_leaves_disk_reads_to_the_caller(daemon: Callable[..., Daemon], tmp_path) -> None:
    d = daemon()
    kv = layers(8)
    ks = keys("disk", 3)
    with Client(d.address) as c:
        park_blocks(c, ks, kv, [0, 1, 2])
    d.stop(0.5)  # flushes to disk
    d2 = daemon()
    with Client(d2.address) as c:
        assert {s.tier for s in c.list()} == {"disk"}
        assert c.lookup_acquire(ks, skip=0) == (3, None)


def test_lookup_acquire_stays_inside_the_tenant(daemon: Callable[..., Daemon]) -> None:
    tokens = {"alice": "alice-secret-token", "bob": "bob-secret-token"}
    d = daemon(**{f"tenants.{n}.token_sha256": hashlib.sha256(t.encode()).hexdigest() for n, t in tokens.items()},
               **{"tenants.alice.trusted_local": True})
    ks = keys("tenant", 2)
    with Client(d.address, token=tokens["alice"]) as a, Client(d.address, token=tokens["bob"]) as b:
        mine, theirs = park_blocks(a, ks, layers(9), [0, 1]), park_blocks(b, ks, layers(10), [0, 1])
        # Step: the same ids in two namespaces: each tenant's lookup acquires its own bytes.
        hit, grant = a.lookup_acquire(ks)
        assert hit == 2 and grant is not None
        out = staging_for(layers(9), 0, 2)
        a.restore_grant(grant, into_flat=out)
        assert torch.equal(out, mine) and not torch.equal(out, theirs)
        # A tenant without the local paths gets the prefix, and no grant (it restores inline).
        assert b.lookup_acquire(ks) == (2, None)


def test_block_dim_of_names_the_block_dimension_of_each_known_layout() -> None:
    flash = [torch.zeros(2, NUM_BLOCKS, BS, HEADS, DIM) for _ in range(L)]
    cpu = [torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * DIM) for _ in range(L)]
    assert vllm_io.block_dim_of(flash, BS) == 1 and vllm_io.block_dim_of(cpu, BS) == 0
    assert vllm_io.block_dim_of(cpu[:1], BS) == 0  # one layer is a layout too
    assert vllm_io.block_dim_of(cpu, BS + 1) is None  # not this block size
    assert vllm_io.block_dim_of([torch.zeros(NUM_BLOCKS, BS, HEADS, 2 * DIM)], BS) is None  # block size elsewhere
    assert vllm_io.block_dim_of([], BS) is None
    assert vllm_io.block_dim_of([cpu[0], torch.zeros(NUM_BLOCKS + 1, HEADS, BS, 2 * DIM)], BS) is None  # mixed


class ChunkCounter(Client):
    """A real client that notes how many ids each batched park and restore carries."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.parks: list[int] = []
        self.restores: list[int] = []

    def park_batch(self, seqs, **kw):  # type: ignore[no-untyped-def,override]
        self.parks.append(len(seqs))
        return super().park_batch(seqs, **kw)

    def restore_many(self, seq_ids, **kw):  # type: ignore[no-untyped-def,override]
        self.restores.append(len(seq_ids))
        return super().restore_many(seq_ids, **kw)


def test_save_and_load_in_several_chunks_keep_each_key_on_its_own_block(daemon: Callable[..., Daemon]) -> None:
    """A staging area of three blocks and seven blocks to move: three chunks, the last short."""
    d = daemon()
    kv = layers(9)
    ids, ks = [6, 0, 3, 7, 1, 5, 2], keys("chunks", 7)
    stage = 3 * vllm_io.block_bytes(kv, 0)
    with ChunkCounter(d.address) as c:
        assert vllm_io.save_blocks(c, kv, 0, ids, ks, ATTRS, stage) == 7 * vllm_io.block_bytes(kv, 0)
        assert c.parks == [3, 3, 1]  # never more than the staging area holds
        for i, k in zip(ids, ks):
            assert torch.equal(c.restore(k)[0], gather_blocks(kv, 0, [i])[0])
        out = [torch.zeros_like(t) for t in kv]
        assert vllm_io.load_blocks(c, out, 0, ids, ks, stage) == 7
        assert c.restores == [3, 3, 1]
        for t, src in zip(out, kv):
            assert torch.equal(t[ids], src[ids]) and not t[4].any()  # block 4 was never asked for


def test_drain_says_false_when_a_save_outlasts_its_timeout(hung_address: str) -> None:
    kv = layers(6)
    saver = BackgroundSaver(Conn(hung_address, "inline", connect_timeout_s=0.5), timeout_s=2.0, max_pending_bytes=1 << 30)
    assert saver.drain(0.01)  # nothing accepted yet
    assert saver.submit(keys("stuck", 1), gather_blocks(kv, 0, [0]), ATTRS)
    assert not saver.drain(0.05), "a drain that timed out said every save was done"
    assert saver.drain(30) and saver.close() == 0


def test_after_a_failed_connect_calls_fail_fast_until_the_retry_time(hung_address: str) -> None:
    """A daemon that did not answer is not dialled again by every call: for the back-off
    that follows, each call fails at once with ``ConnectionError`` (a miss), and the next
    one after it tries again."""
    conn = Conn(hung_address, "inline", connect_timeout_s=0.5)
    with pytest.raises(Exception) as first:
        conn.get()
    assert "retrying later" not in str(first.value)  # this one dialled
    for _ in range(3):
        with pytest.raises(ConnectionError, match="was unreachable; retrying later"):
            conn.get()
    conn._retry_at = 0.0  # the back-off is over: the next call dials again (and fails again)
    with pytest.raises(Exception) as again:
        conn.get()
    assert "retrying later" not in str(again.value)
