"""The README's examples run against a real daemon and resume with identical tokens."""

import os
import pathlib
import subprocess
import sys
from typing import Callable

import pytest

from ..conftest import Proc

pytest.importorskip("transformers")
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["hf_chat_park.py", "paged_park.py"])
def test_example(proc: Callable[..., Proc], script: str) -> None:
    p = proc()
    env = {**os.environ, "KVPARK_ADDRESS": p.address, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tokens match: True" in r.stdout, r.stdout
