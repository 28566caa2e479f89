"""Regenerate the Python code for ``kvpark/v1/kvpark.proto``.

Primitives:
- ``render() -> dict[str, str]``: file name -> generated source, made in a temp dir.
- ``main()``: write the rendered files into ``proto/v1/`` (run ``python proto/generate.py``).

The generated modules are committed; ``tests/proto/test_generated.py`` fails when
they drift from the ``.proto``. grpc_tools emits absolute imports rooted at the
proto package (``from kvpark.v1 import ...``), which is not where the modules live,
so the one import line is rewritten to a relative one.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
PROTO = "kvpark/v1/kvpark.proto"
OUT = HERE / "v1"
NAMES = ("kvpark_pb2.py", "kvpark_pb2.pyi", "kvpark_pb2_grpc.py")


def render() -> dict[str, str]:
    from grpc_tools import protoc  # dev-only dependency

    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            [
                "protoc",
                f"-I{HERE}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                str(HERE / PROTO),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        gen = pathlib.Path(tmp) / "kvpark" / "v1"
        out = {}
        for name in NAMES:
            text = (gen / name).read_text()
            text = text.replace("from kvpark.v1 import kvpark_pb2", "from . import kvpark_pb2")
            out[name] = text
        return out


def main() -> int:
    OUT.mkdir(exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
    init = OUT / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf and gRPC modules for kvpark.v1 (do not edit)."""\n')
    print(f"wrote {', '.join(NAMES)} to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
