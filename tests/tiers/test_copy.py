"""Copy engine: coalesced runs, strict restore-before-demotion priority, completion callbacks."""

import threading

import pytest
import torch

from kvpark.tiers.copy import CopyEngine, runs


def test_runs_coalesce_contiguous_pieces() -> None:
    # Three adjacent source blocks landing in three adjacent destination slots: one run.
    assert runs([(0, 4), (4, 4), (8, 2)], [(100, 4), (104, 4), (108, 2)]) == [(0, 100, 10)]
    # A gap on either side splits the run.
    assert runs([(0, 4), (8, 4)], [(0, 4), (4, 4)]) == [(0, 0, 4), (8, 4, 4)]
    # Different partitions of the same payload.
    assert runs([(0, 6)], [(10, 2), (20, 4)]) == [(0, 10, 2), (2, 20, 4)]
    assert runs([], []) == []


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


def test_restores_leave_the_queue_before_demotions() -> None:
    eng = CopyEngine()
    gate = threading.Event()
    order: list[str] = []
    t = torch.zeros(8, dtype=torch.uint8)
    try:
        # The first job's completion callback runs on the dispatcher and holds it, so
        # everything submitted meanwhile queues up.
        first = eng.submit([(t[:1], t[1:2])], restore=False, on_done=lambda j: gate.wait(10))
        jobs = [
            eng.submit([(t[:1], t[1:2])], restore=False, on_done=lambda j: order.append("demote-1")),
            eng.submit([(t[:1], t[1:2])], restore=False, on_done=lambda j: order.append("demote-2")),
            eng.submit([(t[:1], t[1:2])], restore=True, on_done=lambda j: order.append("restore")),
        ]
        gate.set()
        for j in [first, *jobs]:
            assert j.wait(10)
        assert order == ["restore", "demote-1", "demote-2"]
    finally:
        gate.set()
        eng.close()


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
