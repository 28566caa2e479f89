"""The GPU check's collection rule (tests/skip_missing.py), run on modules outside the
tree through a child pytest that loads the hook as a plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pytest(tmp_path: Path, body: str, skip_missing: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_mod.py").write_text(body + "\n\ndef test_runs():\n    pass\n")
    (tmp_path / "test_other.py").write_text("def test_other():\n    pass\n")  # the run goes on past it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("KVPARK_TESTS_SKIP_MISSING", None)
    if skip_missing:
        env["KVPARK_TESTS_SKIP_MISSING"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p",
                           "tests.skip_missing", "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


def test_a_module_needing_a_missing_package_is_skipped_with_its_name_under_the_gpu_check(tmp_path: Path) -> None:
    r = _pytest(tmp_path, "import kvpark_no_such_package_xyz", skip_missing=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "needs kvpark_no_such_package_xyz, which is not installed here" in r.stdout
    assert "1 passed, 1 skipped" in r.stdout


@pytest.mark.parametrize("body", ["import kvpark_no_such_package_xyz", "import kvpark.no_such_module"])
def test_a_missing_package_stays_an_error_elsewhere_and_our_own_always(tmp_path: Path, body: str) -> None:
    r = _pytest(tmp_path, body, skip_missing="kvpark." in body)
    assert r.returncode != 0
    assert "error" in r.stdout.lower() and "skipped" not in r.stdout


def test_a_module_that_imports_runs_as_usual(tmp_path: Path) -> None:
    r = _pytest(tmp_path, "import json", skip_missing=True)
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout + r.stderr
