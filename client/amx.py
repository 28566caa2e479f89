"""AMX tile permission for engine processes on Intel CPUs (Sapphire Rapids and later).

Linux hands out the AMX tile register state (XTILEDATA) only to processes that ask for
it (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); a process that executes an AMX instruction
without having asked is killed by SIGILL. vLLM's CPU attention kernel uses AMX tiles,
and in vLLM 0.32.0 the permission is requested only on the path of a forward that
computes a prefill from scratch. A fresh engine whose *first* forward attends over KV
that a connector loaded skips that path and dies. Asking once, before the first
forward, is harmless everywhere and fixes it.

Primitives:
- ``cpu_has_amx() -> bool``: the CPU advertises AMX tiles (torch's probe, else
  ``/proc/cpuinfo``'s ``amx_tile`` flag).
- ``request_amx_permission() -> str``: ask once per process; returns what happened:
  ``"granted"``, ``"no-amx"`` (nothing to do), ``"unsupported"`` (this torch build has
  no initialiser) or ``"refused"`` (the kernel said no). Never raises.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger("kvpark.amx")

_lock = threading.Lock()
_result: str | None = None


def cpu_has_amx() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe is not None:
        try:
            return bool(probe())
        except Exception:  # noqa: BLE001 - a probe that fails means "don't know": ask the kernel's view
            pass
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def request_amx_permission() -> str:
    """Ask the kernel for AMX tile permission once per process (idempotent, thread-safe)."""
    global _result
    with _lock:
        if _result is not None:
            return _result
        if not cpu_has_amx():
            _result = "no-amx"
            return _result
        init = getattr(torch.cpu, "_init_amx", None) or getattr(torch._C._cpu, "_init_amx", None)
        if init is None:
            log.warning("kvpark: this CPU has AMX but torch %s cannot request AMX permission; a vLLM CPU "
                        "engine whose first forward uses loaded KV may die with SIGILL", torch.__version__)
            _result = "unsupported"
            return _result
        try:
            ok = bool(init())
        except Exception as e:  # noqa: BLE001 - never fail the engine over this
            log.warning("kvpark: requesting AMX permission failed: %s", e)
            ok = False
        _result = "granted" if ok else "refused"
        if ok:
            log.info("kvpark: requested AMX tile permission for this process before its first forward")
        else:
            log.warning("kvpark: the kernel refused AMX tile permission; vLLM's CPU attention may fail")
        return _result
