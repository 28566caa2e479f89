"""Copy engine: coalesced runs, per-direction queues in priority order, duplex, chunks,
completion callbacks, a close that waits, bounded waits."""

import threading

import pytest
import torch

from kvpark.tiers.copy import D2H, H2D, CopyEngine, CopyJob, chunked, direction_of, runs

from ..conftest import wait_until


def test_runs_coalesce_contiguous_pieces() -> None:
    # Three adjacent source blocks landing in three adjacent destination slots: one run.
    assert runs([(0, 4), (4, 4), (8, 2)], [(100, 4), (104, 4), (108, 2)]) == [(0, 100, 10)]
    # A gap on either side splits the run.
    assert runs([(0, 4), (8, 4)], [(0, 4), (4, 4)]) == [(0, 0, 4), (8, 4, 4)]
    # Different partitions of the same payload.
    assert runs([(0, 6)], [(10, 2), (20, 4)]) == [(0, 10, 2), (2, 20, 4)]
    assert runs([], []) == []
    # A source that steps back (an allocation's tail packed in a lower slot than its full
    # slots) is a new run even where the destination goes on: only a piece that starts
    # exactly where the last one ended, on both sides, extends it.
    assert runs([(8, 4), (0, 4)], [(0, 4), (4, 4)]) == [(8, 0, 4), (0, 4, 4)]
    assert runs([(0, 4), (4, 4)], [(8, 4), (0, 4)]) == [(0, 8, 4), (4, 0, 4)]
    assert runs([(4, 4), (2, 2)], [(0, 4), (4, 2)]) == [(4, 0, 4), (2, 4, 2)]


def test_copies_complete_and_report() -> None:
    eng = CopyEngine()
    try:
        src = torch.arange(1000, dtype=torch.uint8)
        dst = torch.zeros(1000, dtype=torch.uint8)
        seen = []
        job = eng.submit([(dst[:500], src[500:]), (dst[500:], src[:500])], restore=True,
                         on_done=lambda j: seen.append(j.nbytes))
        assert job.wait(10) and job.done()
        assert torch.equal(dst, torch.cat([src[500:], src[:500]]))
        assert seen == [1000]
    finally:
        eng.close()


class Held(torch.Tensor):
    """A destination whose ``copy_`` waits for ``gate``: a copy that stays in flight
    (as a long DMA does) until the test lets it land."""

    gate = threading.Event()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.copy_:
            assert cls.gate.wait(20), "the test never let the held copy land"
        return super().__torch_function__(func, types, args, kwargs or {})


def held(n: int) -> torch.Tensor:
    Held.gate = threading.Event()
    return torch.zeros(n, dtype=torch.uint8).as_subclass(Held)


def in_flight(eng: CopyEngine, d: str) -> bool:
    with eng._cv:
        return eng._inflight[d] > 0


def test_a_direction_out_of_budget_holds_only_its_own_queue_in_priority_order() -> None:
    """D2H is busy with a held copy and has no budget left: queued D2H jobs wait, and
    leave in priority order (restores first); an H2D job runs meanwhile (duplex)."""
    eng = CopyEngine(max_inflight_bytes=1)
    order: list[str] = []
    t = torch.zeros(8, dtype=torch.uint8)
    try:
        first = eng.submit([(held(8), t)], restore=False, direction=D2H)
        assert wait_until(lambda: in_flight(eng, D2H))
        jobs = [
            eng.submit([(t[:1], t[1:2])], restore=False, direction=D2H, on_done=lambda j: order.append("demote-1")),
            eng.submit([(t[:1], t[1:2])], restore=False, direction=D2H, on_done=lambda j: order.append("demote-2")),
            eng.submit([(t[:1], t[1:2])], restore=True, direction=D2H, on_done=lambda j: order.append("restore")),
        ]
        other = eng.submit([(t[2:3], t[3:4])], restore=True, direction=H2D)
        assert other.wait(10), "an H2D copy waited behind a busy D2H link"
        assert order == []
        Held.gate.set()
        for j in [first, *jobs]:
            assert j.wait(10)
        assert order == ["restore", "demote-1", "demote-2"]
    finally:
        Held.gate.set()
        eng.close()


def test_a_small_restore_waits_for_one_chunk_of_a_large_demotion_not_all_of_it() -> None:
    eng = CopyEngine(max_inflight_bytes=1024, chunk_bytes=1024)
    order: list[str] = []
    src = torch.arange(16 * 1024, dtype=torch.int64).to(torch.uint8)
    try:
        dst = held(16 * 1024)
        big = eng.submit([(dst, src)], restore=False, direction=D2H, on_done=lambda j: order.append("big"))
        assert wait_until(lambda: in_flight(eng, D2H))
        small_dst = torch.zeros(64, dtype=torch.uint8)
        small = eng.submit([(small_dst, src[:64])], restore=True, direction=D2H,
                           on_done=lambda j: order.append("small"))
        Held.gate.set()
        assert big.wait(10) and small.wait(10)
        assert order == ["small", "big"]
        assert torch.equal(dst.as_subclass(torch.Tensor), src) and torch.equal(small_dst, src[:64])
    finally:
        Held.gate.set()
        eng.close()


def test_small_jobs_queued_in_one_direction_go_out_together_in_order() -> None:
    """Ten small demotions queued behind a held copy leave as one batch (one event, one
    completion wake-up) once it lands, each completing in order with its own bytes; a
    batch never goes past one chunk's worth or the direction's budget."""
    eng = CopyEngine(max_inflight_bytes=80, chunk_bytes=1024)
    order: list[int] = []
    src = torch.arange(80, dtype=torch.int64).to(torch.uint8)
    dsts = [torch.zeros(8, dtype=torch.uint8) for _ in range(12)]
    try:
        first = eng.submit([(held(80), src)], restore=False, direction=D2H)
        assert wait_until(lambda: in_flight(eng, D2H))
        jobs = [eng.submit([(dsts[i], src[8 * (i % 10) : 8 * (i % 10) + 8])], restore=False, direction=D2H,
                           on_done=lambda j, i=i: order.append(i)) for i in range(12)]
        assert eng.issued == 1
        Held.gate.set()
        assert first.wait(10) and all(j.wait(10) for j in jobs)
        assert order == list(range(12))
        assert eng.issued == 3, "ten jobs fill the 80-byte budget: one batch of ten, then one of two"
        assert all(torch.equal(dsts[i], src[8 * (i % 10) : 8 * (i % 10) + 8]) for i in range(12))
    finally:
        Held.gate.set()
        eng.close()


def test_a_restore_is_never_batched_with_the_demotions_queued_behind_it() -> None:
    """A batch completes as a whole: a restore that opened one and took the demotions
    queued after it would wait for their copies too. A fresh-eyes attack: 100 demotions
    queued behind a full budget, then a restore; the restore must land first."""
    eng = CopyEngine(max_inflight_bytes=1 << 20, chunk_bytes=64 << 20)
    lows = [torch.zeros(4096, dtype=torch.uint8) for _ in range(100)]
    seen: list[int] = []
    try:
        first = eng.submit([(held(1 << 20), torch.ones(1 << 20, dtype=torch.uint8))], restore=False, direction=H2D)
        assert wait_until(lambda: in_flight(eng, H2D))
        for dst in lows:
            eng.submit([(dst, torch.full((4096,), 7, dtype=torch.uint8))], restore=False, direction=H2D)
        r = eng.submit([(torch.zeros(4096, dtype=torch.uint8), torch.full((4096,), 9, dtype=torch.uint8))],
                       restore=True, direction=H2D, on_done=lambda j: seen.append(sum(int(d[0]) == 7 for d in lows)))
        Held.gate.set()
        assert first.wait(10) and r.wait(10)
        assert seen == [0], f"the restore landed after {seen} demotions queued behind it were copied"
    finally:
        Held.gate.set()
        eng.close()


def test_a_failed_job_in_a_batch_fails_alone() -> None:
    eng = CopyEngine(max_inflight_bytes=64, chunk_bytes=1024)
    src = torch.arange(64, dtype=torch.int64).to(torch.uint8)
    good = [torch.zeros(8, dtype=torch.uint8) for _ in range(2)]
    try:
        first = eng.submit([(held(64), src)], restore=False, direction=D2H)
        assert wait_until(lambda: in_flight(eng, D2H))
        a = eng.submit([(good[0], src[:8])], restore=False, direction=D2H)
        bad = eng.submit([(torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))], restore=False,
                         direction=D2H)  # sizes differ: copy_ raises
        b = eng.submit([(good[1], src[8:16])], restore=False, direction=D2H)
        Held.gate.set()
        assert first.wait(10) and a.wait(10) and b.wait(10)
        with pytest.raises(RuntimeError):
            bad.wait(10)
        assert torch.equal(good[0], src[:8]) and torch.equal(good[1], src[8:16])
    finally:
        Held.gate.set()
        eng.close()


def test_chunks_cut_flat_pieces_into_views_and_keep_the_bytes() -> None:
    a, b = torch.arange(10_000, dtype=torch.int32), torch.zeros(10_000, dtype=torch.int32)
    c, d = torch.ones(3, 5), torch.zeros(3, 5)  # not flat: goes whole
    parts = chunked([(b, a), (d, c)], 4096)
    assert all(sum(x.numel() * x.element_size() for x, _ in ch) <= 4096 for ch in parts[:-1])
    assert sum(x.numel() * x.element_size() for ch in parts for x, _ in ch) == 40_000 + 60
    for ch in parts:
        for dst, src in ch:
            dst.copy_(src)
    assert torch.equal(a, b) and torch.equal(c, d)
    assert chunked([], 10) == []
    eng = CopyEngine(chunk_bytes=1 << 20)
    try:
        src, dst = torch.randint(0, 255, (10 << 20,), dtype=torch.uint8), torch.zeros(10 << 20, dtype=torch.uint8)
        assert eng.submit([(dst, src)], restore=True).wait(30)
        assert torch.equal(dst, src)
    finally:
        eng.close()


def test_the_direction_comes_from_the_pieces_then_the_hint_then_the_priority() -> None:
    t = torch.zeros(4)
    assert direction_of([(t, t)], restore=True) == H2D
    assert direction_of([(t, t)], restore=False) == D2H
    assert direction_of([(t, t)], restore=True, hint=D2H) == D2H  # a promotion from the device pool
    with pytest.raises(ValueError):
        direction_of([(t, t)], restore=True, hint="sideways")


def test_close_waits_for_copies_in_flight() -> None:
    eng = CopyEngine()
    job = eng.submit([(held(8), torch.ones(8, dtype=torch.uint8))], restore=False)
    closer = threading.Thread(target=eng.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and not job.done()  # the memory it writes must stay mapped
    Held.gate.set()
    closer.join(20)
    assert not closer.is_alive() and job.done()


def test_a_wait_on_a_copy_that_never_lands_is_unavailable_not_a_hang() -> None:
    from kvpark.daemon.mover import await_copy
    from kvpark.proto.errors import Unavailable

    never = CopyJob([], 1 << 20, restore=True)
    with pytest.raises(Unavailable, match="did not finish"):
        await_copy(never, timeout=0.05)


def test_a_failed_copy_is_raised_to_the_waiter_and_the_engine_survives() -> None:
    eng = CopyEngine()
    try:
        bad = eng.submit([(torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8))], restore=True)
        with pytest.raises(RuntimeError):
            bad.wait(10)
        ok = eng.submit([(torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8))], restore=True)
        assert ok.wait(10)
    finally:
        eng.close()


@pytest.mark.cuda
def test_cuda_streams_round_trip_under_concurrency() -> None:
    from kvpark.tiers.cuda import pin_host, unpin_host

    eng = CopyEngine(max_inflight_bytes=64 << 20, device=torch.device("cuda", 0))
    host = torch.empty(256 << 20, dtype=torch.uint8)
    pin_host(host)
    try:
        # Filled on the default stream, copied on the engine's: submit orders the copy
        # after the fill without any synchronize here.
        dev = torch.randint(0, 255, (256 << 20,), dtype=torch.uint8, device="cuda")
        back = torch.empty_like(dev)
        mb = 1 << 20
        # 64 D2H jobs and 64 H2D jobs interleaved; each H2D waits for its D2H first.
        downs = [eng.submit([(host[i * 4 * mb:(i + 1) * 4 * mb], dev[i * 4 * mb:(i + 1) * 4 * mb])], restore=False)
                 for i in range(64)]
        ups = []
        for i, d in enumerate(downs):
            d.wait(60)
            ups.append(eng.submit([(back[i * 4 * mb:(i + 1) * 4 * mb], host[i * 4 * mb:(i + 1) * 4 * mb])],
                                  restore=True))
        for u in ups:
            assert u.wait(60)
        torch.cuda.synchronize()
        assert torch.equal(back, dev)
    finally:
        eng.close()
        unpin_host(host)


def _ordered_after_the_callers_stream(device: torch.device) -> None:
    eng = CopyEngine(device=device)
    try:
        src = torch.zeros(64 << 20, dtype=torch.uint8, device=device)
        host = torch.full((64 << 20,), 1, dtype=torch.uint8)
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            # A long kernel, then the fill, both queued on the caller's stream: a copy
            # that does not wait for them reads zeros.
            torch.cuda._sleep(200_000_000)
            src.fill_(7)
        job = eng.submit([(host, src)], restore=False)
        assert job.wait(60)
        assert int(host.min()) == 7 and int(host.max()) == 7
    finally:
        eng.close()


@pytest.mark.cuda
def test_submit_waits_for_the_stream_that_produced_the_source() -> None:
    _ordered_after_the_callers_stream(torch.device("cuda", 0))


@pytest.mark.cuda
def test_a_pool_on_the_second_gpu_copies_on_that_gpu() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (only one is visible)")
    dev = torch.device("cuda", 1)
    eng = CopyEngine(device=dev)
    try:
        assert all(s.device == dev for s in eng._streams.values())
    finally:
        eng.close()
    # With the streams on cuda:0 the event would complete at once and this would race.
    _ordered_after_the_callers_stream(dev)


@pytest.mark.cuda
def test_a_refused_page_lock_is_a_warning_and_leaves_no_pending_cuda_error(caplog: pytest.LogCaptureFixture) -> None:
    from kvpark.tiers.cuda import pin_host, unpin_host

    t = torch.empty(4 << 20, dtype=torch.uint8)
    assert pin_host(t) is not None and t.is_pinned()
    try:
        # Registering the same range again is refused by the runtime: a warning, None.
        assert pin_host(t) is None
        assert "cannot page-lock" in caplog.text
        # The refusal must not surface at the next kernel launch check on this thread.
        x = torch.ones(1024, device="cuda")
        assert float((x * 2).sum()) == 2048.0
    finally:
        unpin_host(t)


def test_without_a_cuda_device_the_engine_creates_no_streams() -> None:
    eng = CopyEngine(device=torch.device("cpu"))
    try:
        assert not eng.cuda and eng.device is None and not hasattr(eng, "_streams")
    finally:
        eng.close()


@pytest.mark.cuda
def test_cuda_chunked_jobs_in_both_directions_at_once_are_exact() -> None:
    """A job of several chunks each way on the GPU, D2H and H2D in flight together, and a
    small restore submitted behind the large one: every byte lands, the small one first."""
    from kvpark.tiers.cuda import pin_host, unpin_host

    eng = CopyEngine(max_inflight_bytes=64 << 20, device=torch.device("cuda", 0), chunk_bytes=32 << 20)
    n = 160 << 20
    host_out, host_in = torch.empty(n, dtype=torch.uint8), torch.randint(0, 255, (n,), dtype=torch.uint8)
    pin_host(host_out)
    pin_host(host_in)
    order: list[str] = []
    try:
        dev_src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
        dev_dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        small_dst = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        down = eng.submit([(host_out, dev_src)], restore=False, on_done=lambda j: order.append("down"))
        up = eng.submit([(dev_dst, host_in)], restore=False, on_done=lambda j: order.append("up"))
        small = eng.submit([(small_dst, host_in[: 1 << 20])], restore=True, on_done=lambda j: order.append("small"))
        assert down.direction == D2H and up.direction == H2D and small.direction == H2D
        for j in (down, up, small):
            assert j.wait(60)
        torch.cuda.synchronize()
        assert torch.equal(host_out, dev_src.cpu()) and torch.equal(dev_dst.cpu(), host_in)
        assert torch.equal(small_dst.cpu(), host_in[: 1 << 20])
        assert order.index("small") < order.index("up")  # it passed the large H2D job's later chunks
    finally:
        eng.close()
        unpin_host(host_out)
        unpin_host(host_in)
