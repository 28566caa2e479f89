#!/usr/bin/env python
"""LMCache's simple CPU server (``lmcache_server``) as a peer row for bench/transport.py.

Runs with an interpreter that has LMCache installed (it pins its own torch and many
dependencies, so it lives in a virtual environment of its own; bench/transport.py runs
this script with ``--lmcache-python``). It starts ``lmcache_server HOST PORT cpu`` as a
subprocess, then times, on one connection with LMCache's own wire messages
(``ClientMetaMessage`` / ``ServerMetaMessage``):

- put: ``n`` PUTs of ``chunk`` bytes (bf16 KV_2LTD chunks, as its connector sends),
  closed by one EXIST round trip so every byte has reached the server's store (PUT has
  no reply of its own);
- get: ``n`` GETs, each chunk received straight into a preallocated tensor
  (``recv_into``), like ``restore(into=...)``.

Prints one JSON object: ``{"put_s": [...], "get_s": [...], "version": ...}``; exit code
3 when LMCache cannot be imported (the caller skips the rows).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=1 << 20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    try:
        import torch
        from lmcache import _version
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage
    except Exception as e:  # noqa: BLE001 - any import failure means: no LMCache rows
        print(f"lmcache not importable: {e}", file=sys.stderr)
        return 3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("lmcache_server", path=os.path.dirname(sys.executable)) or "lmcache_server"
    server = subprocess.Popen([exe, "127.0.0.1", str(port), "cpu"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        sock = None
        for _ in range(600):
            try:
                sock = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.1)
        if sock is None:
            print("lmcache_server did not come up", file=sys.stderr)
            return 3
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        elems = args.chunk // 2
        shape = torch.Size([2, 1, elems // 2048, 1024])  # 2 x layers x tokens x hidden, bf16
        assert shape.numel() * 2 == args.chunk
        keys = [CacheEngineKey("kvpark-bench", 1, 0, i, torch.bfloat16) for i in range(args.n)]
        src = [torch.randint(0, 255, (args.chunk,), dtype=torch.uint8) for _ in range(args.n)]
        dst = [torch.zeros(args.chunk, dtype=torch.uint8) for _ in range(args.n)]
        rlen = ServerMetaMessage.packlength()

        def recv_exact(view: memoryview) -> None:
            pos = 0
            while pos < len(view):
                got = sock.recv_into(view[pos:], len(view) - pos)
                if not got:
                    raise ConnectionError("lmcache_server closed the connection")
                pos += got

        def meta(cmd: object, key: object, length: int) -> bytes:
            return ClientMetaMessage(cmd, key, length, MemoryFormat.KV_2LTD, torch.bfloat16, shape).serialize()

        def put_all() -> None:
            for k, t in zip(keys, src):
                sock.sendall(meta(ClientCommand.PUT, k, args.chunk))
                sock.sendall(memoryview(t.numpy()))
            sock.sendall(meta(ClientCommand.EXIST, keys[-1], 0))
            head = bytearray(rlen)
            recv_exact(memoryview(head))

        def get_all() -> None:
            head = bytearray(rlen)
            for k, t in zip(keys, dst):
                sock.sendall(meta(ClientCommand.GET, k, 0))
                recv_exact(memoryview(head))
                m = ServerMetaMessage.deserialize(bytes(head))
                if m.length != args.chunk:
                    raise RuntimeError(f"GET returned {m.length} bytes")
                recv_exact(memoryview(t.numpy()))

        def timed(fn: object) -> list[float]:
            out = []
            for i in range(args.warmup + args.reps):
                t0 = time.perf_counter()
                fn()  # type: ignore[operator]
                if i >= args.warmup:
                    out.append(time.perf_counter() - t0)
            return out

        put_s = timed(put_all)
        get_s = timed(get_all)
        ok = all(torch.equal(a, b) for a, b in zip(src, dst))
        print(json.dumps({"put_s": put_s, "get_s": get_s, "version": getattr(_version, "__version__", "?"),
                          "bytes_ok": ok}))
        sock.close()
        return 0
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    sys.exit(main())
