"""KVParkConnector inside a real vLLM engine (CPU backend) against a real kvpark daemon.

Runs only where vLLM is installed (its own venv: `make test-vllm`); skipped elsewhere.
Every engine runs in its own process (tests/vllm/engine.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.request
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("vllm")

from kvpark.client import Client  # noqa: E402
from kvpark.client.amx import cpu_has_amx  # noqa: E402
from kvpark.tiers.disk import HEADER, Manifest, block_key  # noqa: E402

from ..conftest import Proc  # noqa: E402

pytestmark = pytest.mark.slow
ENGINE = Path(__file__).with_name("engine.py")
PROMPT = [(i * 7) % 500 + 5 for i in range(100)]
OTHER = [(i * 11 + 3) % 500 + 5 for i in range(130)]


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("model")
    subprocess.run([sys.executable, str(ENGINE), "make-model", str(out)], check=True, capture_output=True,
                   timeout=300)
    return str(out)


def run_engine(model: str, **spec: Any) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return subprocess.run([sys.executable, str(ENGINE), "run", "--model", model, "--spec", json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=600)


def engine(model: str, **spec: Any) -> dict:
    r = run_engine(model, **spec)
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, f"engine exited {r.returncode}:\n{r.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])


def cpu_model_name() -> str:
    with open("/proc/cpuinfo") as fh:
        return next((l.split(":", 1)[1].strip() for l in fh if l.startswith("model name")), "unknown CPU")


@pytest.fixture(scope="session")
def baseline(model: str) -> dict:
    """Outputs without kvpark: what every kvpark run must reproduce."""
    return engine(model, prompts=[PROMPT, OTHER], rounds=1)["rounds"][0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lookup_tokens(metrics: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.labels["result"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "kvpark_lookup_tokens_total"}


def test_prefix_hit_after_reset_and_identical_tokens(model: str, baseline: dict,
                                                     proc: Callable[..., Proc]) -> None:
    metrics = f"127.0.0.1:{_free_port()}"
    d = proc("--set", f"metrics.listen={metrics}")
    out = engine(model, prompts=[PROMPT, OTHER], address=d.address, rounds=2)
    first, second = out["rounds"]
    assert first["tokens"] == baseline["tokens"]
    assert first["cached"] == [0, 0]
    # After reset_prefix_cache the engine's own cache is empty: the hit is kvpark's.
    assert second["cached"] == [96, 128]
    assert second["tokens"] == baseline["tokens"]
    assert out["stats"]["loaded_blocks"] == 3 + 4
    # Both loads came with the scheduler's lookup (one round trip), none needed its own acquire.
    assert out["stats"]["grant_loads"] == 2
    # Every block was saved from the background saver, none lost.
    assert out["stats"]["saved_blocks"] >= 3 + 4 and not out["stats"].get("errors.save")
    # The connector tells the daemon its block size: the hit rate in tokens is one PromQL line.
    tokens = _lookup_tokens(metrics)
    assert tokens["hit"] >= 96 + 128 and tokens["miss"] > 0, tokens


def test_a_prompt_of_whole_blocks_leaves_its_last_block_to_the_engine(model: str, proc: Callable[..., Proc]) -> None:
    """A prompt exactly 4 blocks long (32 tokens a block, as PROMPT's 96 cached tokens are
    3): the engine must compute at least its last token, so kvpark offers 3 blocks, never
    all 4, and the output is the one without kvpark."""
    exact = [(i * 13 + 1) % 500 + 5 for i in range(4 * 32)]
    alone = engine(model, prompts=[exact], rounds=1)["rounds"][0]
    d = proc()
    out = engine(model, prompts=[exact], address=d.address, rounds=2)
    first, second = out["rounds"]
    assert first["tokens"] == second["tokens"] == alone["tokens"]
    assert first["cached"] == [0] and second["cached"] == [3 * 32]
    assert out["stats"]["loaded_blocks"] == 3


def test_a_request_sent_with_kvpark_off_is_neither_looked_up_nor_saved(model: str, baseline: dict,
                                                                        proc: Callable[..., Proc]) -> None:
    d = proc()
    # Step: round 1 opts out per request; round 2 (opted in) finds nothing from it.
    out = engine(model, prompts=[PROMPT, OTHER], address=d.address, rounds=2, off_rounds=[0])
    first, second = out["rounds"]
    assert first["tokens"] == second["tokens"] == baseline["tokens"]
    assert second["cached"] == [0, 0]
    assert out["stats"]["lookups"] == 2 and out["stats"]["saved_blocks"] == 3 + 4


def test_noise_in_the_store_changes_the_output(model: str, baseline: dict, proc: Callable[..., Proc]) -> None:
    d = proc()
    engine(model, prompts=[PROMPT], address=d.address, rounds=1)
    # Step: overwrite every stored block with noise of the same shape.
    with Client(d.address) as c:
        blocks = [s for s in c.list() if s.seq_id.startswith("kvblk-")]
        assert blocks
        g = torch.Generator().manual_seed(0)
        for s in blocks:
            (meta,) = s.tensors
            noise = torch.randn(meta.shape, generator=g).to(getattr(torch, meta.dtype))
            c.park(s.seq_id, [noise], overwrite=True, attrs=s.attrs)
    out = engine(model, prompts=[PROMPT], address=d.address, rounds=1)
    assert out["rounds"][0]["cached"] == [96]
    assert out["rounds"][0]["tokens"] != baseline["tokens"][:1], "the loaded KV must be what the engine uses"


def test_cross_instance_and_restart(model: str, baseline: dict, proc: Callable[..., Proc], tmp_path: Path) -> None:
    d = proc()
    engine(model, prompts=[PROMPT], address=d.address, rounds=1)
    # A second engine (a new process) pointed at the same daemon gets the hit.
    second = engine(model, prompts=[PROMPT], address=d.address, rounds=1)["rounds"][0]
    assert second["cached"] == [96] and second["tokens"] == baseline["tokens"][:1]
    # After a daemon restart (SIGTERM, then start again) the hit is served from disk.
    assert d.terminate() == 0
    d2 = proc()
    with Client(d2.address) as c:
        assert {s.tier for s in c.list()} == {"disk"}
    third = engine(model, prompts=[PROMPT], address=d2.address, rounds=1)
    assert third["rounds"][0]["cached"] == [96] and third["rounds"][0]["tokens"] == baseline["tokens"][:1]
    assert third["stats"]["loaded_blocks"] == 3


def test_daemon_down_is_a_miss(model: str, baseline: dict) -> None:
    out = engine(model, prompts=[PROMPT, OTHER], address="127.0.0.1:1", rounds=2)
    for r in out["rounds"]:
        assert r["tokens"] == baseline["tokens"] and r["cached"] == [0, 0]
    assert out["stats"].get("errors.lookup", 0) + out["stats"].get("errors.save", 0) > 0
    assert out["stats"].get("loaded_blocks", 0) == 0


def test_a_daemon_that_freezes_during_background_saves_costs_misses_not_the_engine(
        model: str, baseline: dict, proc: Callable[..., Proc]) -> None:
    d = proc()
    try:
        # Step: the daemon is frozen (SIGSTOP) right after round 1, while that round's last
        # saves may still be in flight; round 2 then saves into a daemon that never answers.
        out = engine(model, prompts=[PROMPT, OTHER], address=d.address, rounds=2, freeze_pid=d.popen.pid,
                     extra={"save_timeout_s": 2})
    finally:
        d.popen.send_signal(signal.SIGCONT)
    for r in out["rounds"]:
        assert r["tokens"] == baseline["tokens"]
    assert out["rounds"][1]["cached"] == [0, 0]
    # Round 2's saves failed at their deadline, counted; the engine neither hung nor failed.
    assert out["stats"].get("errors.save", 0) >= 1, out["stats"]
    # The daemon itself is fine once it runs again, with round 1's blocks.
    with Client(d.address) as c:
        assert c.lookup([s.seq_id for s in c.list()]) >= 3


def test_corrupted_block_is_a_miss_not_an_error(model: str, baseline: dict, proc: Callable[..., Proc],
                                                tmp_path: Path) -> None:
    import lmdb

    d = proc()
    engine(model, prompts=[PROMPT], address=d.address, rounds=1)
    assert d.terminate() == 0  # flushes everything to disk
    env = lmdb.open(str(tmp_path / "disk"), max_dbs=4)
    blocks_db, manifests = env.open_db(b"blocks"), env.open_db(b"manifests")
    with env.begin(write=True) as txn:
        flipped = 0
        for key, raw in list(txn.cursor(db=manifests)):
            m = Manifest.decode(raw)
            k = block_key(m.seq_id, m.gen, 0)
            rec = bytearray(txn.get(k, db=blocks_db))
            rec[HEADER.size + 5] ^= 0x10
            txn.put(k, bytes(rec), db=blocks_db)
            flipped += 1
    env.close()
    assert flipped >= 3
    d2 = proc()
    out = engine(model, prompts=[PROMPT], address=d2.address, rounds=1)
    r = out["rounds"][0]
    assert r["tokens"] == baseline["tokens"][:1]  # recomputed, identical
    assert out["stats"]["load_failures"] >= 1 and out["stats"]["errors.load"] >= 1


def test_preempted_requests_get_their_kv_back(model: str, proc: Callable[..., Proc]) -> None:
    prompts = [[(i * 7 + r * 13) % 500 + 5 for i in range(100)] for r in range(4)]
    calm = engine(model, prompts=prompts, max_tokens=200, rounds=1, reset=False)["rounds"][0]
    d = proc()
    # 20 blocks of KV for 4 requests growing to 300 tokens each: preemption is certain.
    # The engine's own prefix cache is off, so resumed requests can only get KV from kvpark.
    tight = engine(model, prompts=prompts, max_tokens=200, rounds=1, reset=False, address=d.address,
                   kv_bytes=20 * 16384, prefix_caching=False)
    assert tight["rounds"][0]["tokens"] == calm["tokens"]
    assert tight["stats"]["loaded_blocks"] > 0, tight["stats"]


# Regression: vLLM's CPU attention dies with SIGILL on AMX CPUs when a fresh engine's first
# forward attends over KV loaded by the connector (AMX permission is only requested on the
# from-scratch prefill path). The connector requests it at start; these two tests show the
# fix where it matters and which case ran here.


def test_fresh_engine_whose_first_forward_uses_loaded_kv(model: str, baseline: dict,
                                                         proc: Callable[..., Proc]) -> None:
    has_amx = cpu_has_amx()
    d = proc()
    engine(model, prompts=[PROMPT], address=d.address, rounds=1)  # saves
    # Step: a new engine process whose very first forward starts from 96 loaded tokens.
    out = engine(model, prompts=[PROMPT], address=d.address, rounds=1)
    r = out["rounds"][0]
    assert r["cached"] == [96] and out["stats"]["loaded_blocks"] == 3
    assert r["tokens"] == baseline["tokens"][:1]
    expected = "amx.granted" if has_amx else "amx.no-amx"
    assert out["stats"].get(expected) == 1, (
        f"{cpu_model_name()} (AMX: {has_amx}): expected {expected} in {out['stats']}")


def test_without_amx_permission_the_first_loaded_forward_dies_on_amx(model: str,
                                                                      proc: Callable[..., Proc]) -> None:
    if not cpu_has_amx():
        pytest.skip(f"no AMX on this CPU ({cpu_model_name()}): the vLLM crash cannot happen here; the fixed "
                    "run ran as the no-AMX case")
    d = proc()
    engine(model, prompts=[PROMPT], address=d.address, rounds=1)
    # Step: the same fresh-engine load with the connector's AMX request turned off.
    r = run_engine(model, prompts=[PROMPT], address=d.address, rounds=1, extra={"cpu_amx_init": False})
    assert r.returncode == -signal.SIGILL, (
        f"expected vLLM 0.32's SIGILL without the AMX request, got exit {r.returncode}; if vLLM fixed it, "
        "the connector's request (kvpark.client.amx) can be retired.\n" + r.stderr[-2000:])
