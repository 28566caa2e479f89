"""Small helpers the bench scripts share."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: str | os.PathLike[str], result: Any) -> None:
    """Write ``result`` as indented JSON (creating the folder) and say where."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2))
    rel = os.path.relpath(p)
    print(f"JSON written to {p if rel.startswith('..') else rel}")
