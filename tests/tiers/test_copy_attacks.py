"""Fresh-eyes attacks on the per-direction copy engine (CPU)."""

import random
import threading
import time

import pytest
import torch

import kvpark.tiers.copy as copymod
from kvpark.tiers.copy import D2D, D2H, H2D, CopyEngine, chunked

from ..conftest import wait_until
from .test_copy import Held, in_flight


class Boom(torch.Tensor):
    """A destination whose copy_ waits for ``gate`` and then fails."""

    gate = threading.Event()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.copy_:
            assert cls.gate.wait(20)
            raise RuntimeError("boom")
        return super().__torch_function__(func, types, args, kwargs or {})


def inflight(eng: CopyEngine) -> dict:
    with eng._cv:
        return dict(eng._inflight)


def test_failed_chunk_stops_the_rest_even_already_issued() -> None:
    """Budget for all chunks: the dispatcher issues chunk 2 while chunk 1 is still copying.
    Chunk 1 fails: chunk 2 must not be copied (CPU can skip it), the job fails once."""
    eng = CopyEngine(max_inflight_bytes=1 << 20, chunk_bytes=8)
    Boom.gate = threading.Event()
    bad = torch.zeros(8, dtype=torch.uint8).as_subclass(Boom)
    src = torch.arange(8, dtype=torch.uint8)
    dst2 = torch.zeros(8, dtype=torch.uint8)
    calls = []
    try:
        job = eng.submit([(bad, src), (dst2, src + 1)], restore=False, direction=D2H,
                         on_done=lambda j: calls.append(j.error))
        assert wait_until(lambda: inflight(eng)[D2H] == 16)  # both chunks issued
        Boom.gate.set()
        with pytest.raises(RuntimeError, match="boom"):
            job.wait(10)
        assert len(calls) == 1
        assert wait_until(lambda: inflight(eng)[D2H] == 0)
        assert eng.completed == 1
        assert torch.count_nonzero(dst2) == 0, "a chunk after the failed one was still copied"
    finally:
        eng.close()


def test_failed_chunk_not_yet_issued_is_dropped() -> None:
    eng = CopyEngine(max_inflight_bytes=8, chunk_bytes=8)
    Boom.gate = threading.Event()
    bad = torch.zeros(8, dtype=torch.uint8).as_subclass(Boom)
    src = torch.arange(8, dtype=torch.uint8)
    dst2 = torch.zeros(8, dtype=torch.uint8)
    try:
        job = eng.submit([(bad, src), (dst2, src + 1)], restore=False, direction=D2H)
        assert wait_until(lambda: inflight(eng)[D2H] == 8)
        Boom.gate.set()
        with pytest.raises(RuntimeError):
            job.wait(10)
        after = eng.submit([(torch.zeros(4, dtype=torch.uint8), src[:4])], restore=False, direction=D2H)
        assert after.wait(10)
        assert torch.count_nonzero(dst2) == 0 and inflight(eng) == {H2D: 0, D2H: 0, D2D: 0}
        assert not any(eng._queues.values())
    finally:
        eng.close()


class Fatal(BaseException):
    pass


def test_base_exception_in_on_done_does_not_kill_the_direction() -> None:
    eng = CopyEngine()
    t = torch.zeros(8, dtype=torch.uint8)
    try:
        def cb(j):  # type: ignore[no-untyped-def]
            raise Fatal("callback")
        first = eng.submit([(t[:4], t[4:])], restore=True, direction=H2D, on_done=cb)
        assert first.wait(10)
        second = eng.submit([(t[:4], t[4:])], restore=True, direction=H2D)
        assert second.wait(5), "the H2D completion thread died with the callback's BaseException"
    finally:
        eng.close()


def test_exception_in_on_done_fails_nothing() -> None:
    eng = CopyEngine()
    t = torch.arange(8, dtype=torch.uint8)
    try:
        jobs = [eng.submit([(t[:4].clone(), t[4:])], restore=bool(i % 2), direction=D2H,
                           on_done=lambda j: 1 / 0) for i in range(20)]
        assert all(j.wait(10) for j in jobs)
        e = eng.submit([], restore=True, on_done=lambda j: 1 / 0)
        assert e.wait(1)
        assert eng.completed == 21
    finally:
        eng.close()


def test_zero_byte_empty_mixed_multidim_noncontiguous_dtype() -> None:
    eng = CopyEngine(max_inflight_bytes=16, chunk_bytes=10)
    try:
        seen = []
        empty = eng.submit([], restore=True, on_done=lambda j: seen.append("empty"))
        assert empty.wait(1) and seen == ["empty"]
        z = torch.zeros(0, dtype=torch.uint8)
        zero = eng.submit([(z, z), (z.clone(), z)], restore=False, on_done=lambda j: seen.append("zero"))
        assert zero.wait(5) and seen == ["empty", "zero"]
        src2d = torch.randn(8, 8)  # 256 bytes, way over budget and chunk: goes whole, no deadlock
        dst2d = torch.zeros(8, 8)
        strided_src = torch.arange(64, dtype=torch.int32)[::3]
        strided_dst = torch.zeros(64, dtype=torch.int32)[::3]
        f_src = torch.arange(100, dtype=torch.float32)
        f_dst = torch.zeros(100, dtype=torch.float32)
        mix_src = torch.arange(7, dtype=torch.uint8)
        mix_dst = torch.zeros(7, dtype=torch.uint8)
        conv_src = torch.arange(10, dtype=torch.uint8)
        conv_dst = torch.zeros(10, dtype=torch.float64)  # dtype mismatch: converted, whole
        j = eng.submit([(dst2d, src2d), (mix_dst, mix_src), (f_dst, f_src), (strided_dst, strided_src),
                        (conv_dst, conv_src), (z.clone(), z)], restore=True, direction=H2D)
        assert j.wait(10)
        assert torch.equal(dst2d, src2d) and torch.equal(f_dst, f_src) and torch.equal(mix_dst, mix_src)
        assert torch.equal(strided_dst, strided_src) and torch.equal(conv_dst, conv_src.double())
        assert inflight(eng) == {H2D: 0, D2H: 0, D2D: 0}
    finally:
        eng.close()


def test_chunked_never_exceeds_its_limit_for_flat_pieces() -> None:
    """The doc: chunks of at most ``limit`` bytes, a flat piece cut into views."""
    pieces = [(torch.zeros(7, dtype=torch.uint8), torch.zeros(7, dtype=torch.uint8)),
              (torch.zeros(4, dtype=torch.float32), torch.zeros(4, dtype=torch.float32))]
    sizes = [sum(d.numel() * d.element_size() for d, _ in c) for c in chunked(pieces, 10)]
    assert sum(sizes) == 23
    assert max(sizes) <= 10, sizes


def test_on_done_only_after_every_chunk_and_interleaved_jobs_bit_exact() -> None:
    eng = CopyEngine(max_inflight_bytes=64, chunk_bytes=16)
    rng = random.Random(1)
    try:
        results = []
        lock = threading.Lock()
        jobs = []
        for i in range(200):
            n = rng.choice([0, 1, 15, 16, 17, 100, 333])
            src = torch.randint(0, 256, (n,), dtype=torch.uint8)
            dst = torch.zeros(n, dtype=torch.uint8)
            k = rng.randint(0, 3)
            pieces = [(dst[:k], src[:k]), (dst[k:], src[k:])] if n >= k else [(dst, src)]

            def cb(j, dst=dst, src=src):  # type: ignore[no-untyped-def]
                with lock:
                    results.append(torch.equal(dst, src))
            jobs.append(eng.submit(pieces, restore=rng.random() < 0.5, direction=rng.choice([H2D, D2H, D2D]),
                                   on_done=cb))
        assert all(j.wait(20) for j in jobs)
        assert len(results) == 200 and all(results)
        assert eng.completed == 200 and inflight(eng) == {H2D: 0, D2H: 0, D2D: 0}
    finally:
        eng.close()


def test_many_tiny_jobs_no_starvation_of_a_direction_or_priority() -> None:
    eng = CopyEngine(max_inflight_bytes=4, chunk_bytes=4)
    t = torch.zeros(64, dtype=torch.uint8)
    try:
        jobs = {(d, r): [] for d in (H2D, D2H) for r in (True, False)}
        for i in range(3000):
            d, r = (H2D, D2H)[i % 2], bool((i // 2) % 2)
            jobs[(d, r)].append(eng.submit([(t[:4], t[4:8])], restore=r, direction=d))
        for js in jobs.values():
            assert all(j.wait(30) for j in js)
    finally:
        eng.close()


def test_piece_larger_than_budget_behind_a_held_copy() -> None:
    eng = CopyEngine(max_inflight_bytes=4, chunk_bytes=1 << 20)
    Held.gate = threading.Event()
    t = torch.zeros(64, dtype=torch.uint8)
    try:
        h = eng.submit([(torch.zeros(2, dtype=torch.uint8).as_subclass(Held), t[:2])], restore=False, direction=D2H)
        # The held copy is in flight before the big one comes (on busy cores its dispatch
        # could otherwise come second, and the big one would rightly run alone).
        assert wait_until(lambda: in_flight(eng, D2H), timeout=10)
        big = eng.submit([(torch.zeros(4, 4), torch.ones(4, 4))], restore=True, direction=D2H)
        assert not big.wait(0.3)
        Held.gate.set()
        assert h.wait(10) and big.wait(10)
    finally:
        eng.close()


def test_close_races_submit_and_finishes_every_accepted_job() -> None:
    for _ in range(20):
        eng = CopyEngine(max_inflight_bytes=8, chunk_bytes=8)
        accepted, refused = [], [0]
        src = torch.arange(32, dtype=torch.uint8)
        stop = threading.Event()

        def spam(d):  # type: ignore[no-untyped-def]
            while not stop.is_set():
                try:
                    accepted.append(eng.submit([(torch.zeros(32, dtype=torch.uint8), src)], restore=False,
                                               direction=d))
                except RuntimeError:
                    refused[0] += 1
                    return
        ths = [threading.Thread(target=spam, args=(d,)) for d in (H2D, D2H, D2D)]
        for th in ths:
            th.start()
        time.sleep(0.01)
        eng.close()
        stop.set()
        for th in ths:
            th.join(10)
        assert all(j.done() for j in accepted), "close returned with accepted jobs not finished"
        assert refused[0] == 3


def test_close_waits_at_most_close_wait_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copymod, "CLOSE_WAIT_S", 2.0)
    eng = CopyEngine(max_inflight_bytes=1)
    Held.gate = threading.Event()
    t = torch.zeros(8, dtype=torch.uint8)
    eng.submit([(torch.zeros(2, dtype=torch.uint8).as_subclass(Held), t[:2])], restore=False, direction=D2H)
    eng.submit([(t[:2], t[2:4])], restore=False, direction=D2H)  # queued behind it (no budget)
    assert wait_until(lambda: inflight(eng)[D2H] > 0)
    t0 = time.monotonic()
    eng.close()
    took = time.monotonic() - t0
    Held.gate.set()
    # One bound for the whole close (before: the dispatcher's, then the workers' again: 4 s).
    assert took < 3.5, f"close() waited {took:.2f} s with CLOSE_WAIT_S = 2"
