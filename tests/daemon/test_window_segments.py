"""A window's segments (what a windowed shm park or restore is told to write or read)
merge only extents that touch: slots that are not next to each other stay apart, so a
client never writes over the gap between them. Fragmented arenas are where this
matters, and the end-to-end tests mostly get contiguous slots."""

from __future__ import annotations

from kvpark.daemon.model import Window
from kvpark.proto.layout import TensorMeta
from kvpark.tiers.arena import Allocation
from kvpark.tiers.disk import Manifest

S = 1 << 20  # slot size


def _window(full_slots: tuple[int, ...]) -> Window:
    n = len(full_slots) * S
    m = Manifest(seq_id="w", gen=1, tensors=(TensorMeta("uint8", (n,), n),), nbytes=n, block_size=S, fingerprint=0)
    return Window(manifest=m, tier="host", alloc=Allocation(S, full_slots, None), size=n)


def test_segments_merge_only_touching_slots() -> None:
    assert _window((0, 2, 3)).segments(0) == [(0, S), (2 * S, 2 * S)]
    assert _window((5, 1, 2)).segments(0) == [(5 * S, S), (S, 2 * S)]
    assert _window((0, 1, 2)).segments(0) == [(0, 3 * S)]
    assert _window((4, 6, 8)).segments(0) == [(4 * S, S), (6 * S, S), (8 * S, S)]
