"""The `vllm serve --kv-transfer-config` one-liner of the README and docs/vllm.md, read
by vLLM's own command-line parser, yields a config our connector's option parser
accepts (tests/client/test_vllm_options.py checks the keys without vLLM)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

from kvpark.client.vllm_options import parse  # noqa: E402

from ..client.test_vllm_options import one_liners  # noqa: E402


def test_vllm_serve_parses_the_documented_one_liner_into_our_connector_config() -> None:
    import json

    for cfg in one_liners():
        args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
            ["--kv-transfer-config", json.dumps(cfg)])
        kt = args.kv_transfer_config
        assert kt.kv_connector == "KVParkConnector" and kt.kv_connector_module_path == "kvpark.client.vllm"
        assert kt.kv_role == "kv_both"
        assert parse(kt.kv_connector_extra_config, env={}).address == "127.0.0.1:50551"
