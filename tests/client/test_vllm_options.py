"""The vLLM connector's extra config (client/vllm_options.py), parsed from the very
`vllm serve --kv-transfer-config` JSON the README and docs/vllm.md give, and checked key
by key. (tests/vllm validates the same string with vLLM's own KVTransferConfig.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvpark.client import InvalidArgument
from kvpark.client.vllm_options import parse

ROOT = Path(__file__).resolve().parents[2]


def one_liners() -> list[dict]:
    """Every `--kv-transfer-config '...'` JSON in the README and docs/vllm.md."""
    found = []
    for doc in (ROOT / "README.md", ROOT / "docs" / "vllm.md"):
        found += [json.loads(m) for m in re.findall(r"--kv-transfer-config '(\{.*?\})'", doc.read_text())]
    return found


def test_the_documented_one_liner_names_the_connector_and_parses() -> None:
    docs = one_liners()
    assert len(docs) >= 2  # README and docs/vllm.md
    for cfg in docs:
        assert cfg["kv_connector"] == "KVParkConnector" and cfg["kv_connector_module_path"] == "kvpark.client.vllm"
        assert cfg["kv_role"] == "kv_both"
        o = parse(cfg["kv_connector_extra_config"], env={})
        assert o.address == "127.0.0.1:50551" and o.transport == "auto" and o.cpu_amx_init


def test_defaults_strings_and_the_address_rule() -> None:
    o = parse({}, env={"KVPARK_ADDRESS": "kv-host"})
    assert o.address == "kv-host:50551" and o.lookup_timeout_s == 0.5 and o.stage_bytes == 256 << 20
    assert o.save_queue_bytes == 2 * o.stage_bytes
    o = parse({"stage_bytes": "1048576", "save_timeout_s": "2.5", "cpu_amx_init": "false"}, env={})
    assert o.stage_bytes == 1 << 20 and o.save_queue_bytes == 2 << 20 and o.save_timeout_s == 2.5
    assert not o.cpu_amx_init


@pytest.mark.parametrize("extra, words", [
    ({"adress": "x"}, "unknown key 'adress'"),
    ({"transport": "tcp"}, "transport: 'tcp' is not one of"),
    ({"stage_bytes": "lots"}, "stage_bytes: expected a number"),
    ({"load_timeout_s": 0}, "load_timeout_s: must be a finite number above 0"),
    ({"save_submit_wait_s": "nan"}, "save_submit_wait_s: must be a finite number above 0"),
    ({"save_timeout_s": 1e10}, "save_timeout_s: must be a finite number above 0 and at most 1e+06"),
    ({"stage_bytes": float("inf")}, "stage_bytes: expected a number"),
    ({"save_queue_bytes": "-inf"}, "save_queue_bytes: expected a number"),
    ({"load_timeout_s": True}, "load_timeout_s: expected a number"),
    ({"address": "http://127.0.0.1:50551"}, "not http://"),
])
def test_bad_extra_config_is_refused_naming_the_key(extra: dict, words: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(words)):
        parse(extra, env={})
