"""Small helpers the bench scripts share.

- ``write_json(path, result)``: the script's figures as JSON.
- ``serve_process(overrides)``: a ``kvpark serve`` in its own process on those config
  overrides (as in production: its own GIL and cores); yields its address and stops it
  with SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator


def write_json(path: str | os.PathLike[str], result: Any) -> None:
    """Write ``result`` as indented JSON (creating the folder) and say where."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2))
    rel = os.path.relpath(p)
    print(f"JSON written to {p if rel.startswith('..') else rel}")


@contextlib.contextmanager
def serve_process(overrides: dict[str, Any]) -> Iterator[str]:
    cmd = [sys.executable, "-m", "kvpark.daemon.cli", "serve", "--log-level", "info"]
    for k, v in overrides.items():
        cmd += ["--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK")}
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    assert p.stderr is not None
    try:
        for line in p.stderr:
            m = re.search(r"listening on (\S+)", line)
            if m:
                # Keep reading its log, or a chatty daemon blocks on a full pipe.
                threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()  # type: ignore[union-attr]
                yield m.group(1)
                return
        raise RuntimeError(f"the daemon did not start: {' '.join(cmd)}")
    finally:
        p.send_signal(signal.SIGTERM)
        if p.wait(60) != 0:
            raise RuntimeError(f"the daemon exited with {p.returncode}")
