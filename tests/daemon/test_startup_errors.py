"""Configurations that cannot work stop ``kvpark serve`` with one line and exit code 2,
never a traceback: a device tier forced on without CUDA, a data dir that cannot be
written."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpark.tiers import cuda

from .test_arena_safety import serve


def _refused(tmp_path: Path, *sets: str) -> str:
    (tmp_path / "shm").mkdir(exist_ok=True)
    r = serve(tmp_path, f"tiers.host.shm_dir={tmp_path / 'shm'}", "tiers.host.capacity=16MiB", *sets)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "cannot start" in ln]
    assert len(lines) == 1, r.stderr
    assert list((tmp_path / "shm").iterdir()) == [], "no arena left behind"
    return lines[0]


@pytest.mark.skipif(cuda.cuda_available(), reason="needs a host without CUDA")
def test_device_tier_forced_on_without_cuda(tmp_path: Path) -> None:
    line = _refused(tmp_path, "tiers.device.enabled=true", "tiers.device.device=cuda:0")
    assert "CUDA is not available" in line and "tiers.device.enabled" in line


def test_data_dir_that_cannot_be_a_directory(tmp_path: Path) -> None:
    # Root may write anywhere, so "not writable" is made real as a file where the
    # data directory should be (serve passes --data-dir tmp_path/disk).
    bad = tmp_path / "disk"
    bad.write_text("x")
    line = _refused(tmp_path)
    assert str(bad) in line and "tiers.disk.path" in line
