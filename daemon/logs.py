"""Log set-up for ``kvpark serve``: text for people, one JSON object per line for shippers.

Primitives:
- ``setup(level, fmt)``: configures the root logger on stderr; ``fmt`` is "text" or "json".
- ``JsonFormatter``: ``{"ts", "level", "logger", "msg"}`` plus ``"exc"`` when there is a
  traceback; ``ts`` is UTC ISO 8601 with milliseconds.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out = {"ts": ts, "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))


__all__ = ["JsonFormatter", "setup"]
