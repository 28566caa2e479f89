"""AMX tile permission (kvpark.client.amx): the answer matches the CPU, once per process."""

from __future__ import annotations

import subprocess
import sys


def _cpuinfo_has_amx() -> bool:
    with open("/proc/cpuinfo") as fh:
        return any(line.startswith("flags") and "amx_tile" in line.split() for line in fh)


def test_probe_agrees_with_cpuinfo() -> None:
    from kvpark.client.amx import cpu_has_amx

    assert cpu_has_amx() == _cpuinfo_has_amx()


def test_request_matches_the_cpu_and_is_asked_once() -> None:
    # A fresh interpreter: the answer is cached per process.
    code = (
        "from kvpark.client import amx\n"
        "a = amx.request_amx_permission(); b = amx.request_amx_permission()\n"
        "assert a == b, (a, b)\n"
        "print(a)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    result = out.stdout.strip()
    assert result == ("granted" if _cpuinfo_has_amx() else "no-amx"), out.stderr
