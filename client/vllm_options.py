"""The vLLM connector's ``kv_connector_extra_config``, parsed and checked without vLLM.

vLLM hands the connector whatever JSON the user wrote (``vllm serve ...
--kv-transfer-config '{...}'`` or ``KVTransferConfig(...)``): numbers may arrive as
strings, booleans as "false". Each key is read here once, checked, and a bad value is an
``InvalidArgument`` naming the key, at engine start rather than at the first save.

Primitives:
- ``ConnectorOptions``: the parsed keys (docs/vllm.md lists them).
- ``parse(extra, env=os.environ) -> ConnectorOptions``.
- ``flag(value) -> bool``: a JSON-ish boolean.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvpark.proto.errors import InvalidArgument

from .address import normalize

KEYS = ("address", "transport", "lookup_timeout_s", "load_timeout_s", "save_timeout_s", "stage_bytes",
        "save_queue_bytes", "save_submit_wait_s", "cpu_amx_init")
TRANSPORTS = ("auto", "cuda_ipc", "shm", "inline")


@dataclass(frozen=True)
class ConnectorOptions:
    address: str
    transport: str
    lookup_timeout_s: float
    load_timeout_s: float
    save_timeout_s: float
    stage_bytes: int
    save_queue_bytes: int
    save_submit_wait_s: float
    cpu_amx_init: bool


def flag(value: Any) -> bool:
    """A boolean extra-config value; JSON configs may carry it as a string."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


# The largest value a key takes: seconds past this overflow the waits they feed
# (threading's TIMEOUT_MAX, gRPC deadlines), and bytes past it are not a real machine's.
_MAX = {float: 1e6, int: 1 << 50}


def _number(extra: Mapping[str, Any], key: str, default: float, kind: type) -> Any:
    value = extra.get(key, default)
    if isinstance(value, bool):  # True is not 1 second, nor 1 byte
        raise InvalidArgument(f"kv_connector_extra_config.{key}: expected a number, got {value!r}")
    try:
        n = kind(value)
    except (TypeError, ValueError, OverflowError):  # int(inf) overflows
        raise InvalidArgument(f"kv_connector_extra_config.{key}: expected a number, got {value!r}") from None
    if not 0 < n <= _MAX[kind]:  # nan compares false with everything
        raise InvalidArgument(f"kv_connector_extra_config.{key}: must be a finite number above 0 and at most "
                              f"{_MAX[kind]:g}, got {value!r}")
    return n


def parse(extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorOptions:
    extra = dict(extra or {})
    env = os.environ if env is None else env
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise InvalidArgument(f"kv_connector_extra_config: unknown key {unknown[0]!r}; known: {', '.join(KEYS)}")
    transport = str(extra.get("transport", "auto"))
    if transport not in TRANSPORTS:
        raise InvalidArgument(f"kv_connector_extra_config.transport: {transport!r} is not one of "
                              f"{', '.join(TRANSPORTS)}")
    stage = _number(extra, "stage_bytes", 256 << 20, int)
    return ConnectorOptions(
        address=normalize(str(extra.get("address") or env.get("KVPARK_ADDRESS") or "127.0.0.1:50551")),
        transport=transport,
        lookup_timeout_s=_number(extra, "lookup_timeout_s", 0.5, float),
        load_timeout_s=_number(extra, "load_timeout_s", 10.0, float),
        save_timeout_s=_number(extra, "save_timeout_s", 10.0, float),
        stage_bytes=stage,
        save_queue_bytes=_number(extra, "save_queue_bytes", 2 * stage, int),
        save_submit_wait_s=_number(extra, "save_submit_wait_s", 0.005, float),
        cpu_amx_init=flag(extra.get("cpu_amx_init", True)),
    )
