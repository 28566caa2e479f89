"""Run a real vLLM engine (CPU backend) once, with or without kvpark, and print JSON.

Used by tests/vllm and bench/vllm_ttft.py, each run in its own process so engines never
share in-process state. Also builds the random-weight Llama models they use (the tests'
tiny one by default; ``--shape`` picks a bigger one where prefill is real work):

    python tests/vllm/engine.py make-model DIR [--shape tiny|medium]
    python tests/vllm/engine.py run --model DIR --spec JSON
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


# Random-weight Llama shapes. head_dim must be one the CPU attention backend supports
# (32, 64, 80, ...). "medium": 8 layers, hidden 1024, GQA 16/4, where a 2k-token prefill
# costs seconds on a CPU (bench/vllm_ttft.py).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=1024),
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64, max_position_embeddings=4096),
}


def make_model(out: str, shape: str = "tiny") -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = 512
    rng = random.Random(0)
    words = [f"w{i}" for i in range(2000)]
    corpus = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(500)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(vocab_size=vocab,
                                                               special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[shape], vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)


def _cpu_of(pid: int | None) -> float:
    """CPU seconds (user + system) a process has used so far; 0 when not asked or not readable."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{int(pid)}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def run(model: str, spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if spec.get("address"):
        extra = {"address": spec["address"], **spec.get("extra", {})}
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="KVParkConnector",
                                                    kv_connector_module_path="kvpark.client.vllm",
                                                    kv_role="kv_both", kv_connector_extra_config=extra)
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, block_size=32,
              kv_cache_memory_bytes=int(spec.get("kv_bytes", 64 << 20)),
              max_model_len=int(spec.get("max_model_len", 512)),
              enable_prefix_caching=spec.get("prefix_caching", True), **kw)
    start_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=int(spec.get("max_tokens", 16)), ignore_eos=True)
    # Rounds listed in "off_rounds" send their requests with kvpark turned off for them.
    sp_off = SamplingParams(temperature=0, max_tokens=int(spec.get("max_tokens", 16)), ignore_eos=True,
                            extra_args={"kv_transfer_params": {"kvpark": "off"}})
    off_rounds = set(spec.get("off_rounds", []))
    # "round_prompts": a prompt list per round (fresh prompts each round); else "prompts" every round.
    per_round = spec.get("round_prompts") or [spec["prompts"]] * int(spec.get("rounds", 1))
    rounds = []
    for prompt_ids in per_round:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        t = time.perf_counter()
        cpu, dcpu = time.process_time(), _cpu_of(spec.get("daemon_pid"))
        outs = llm.generate(prompts, sp_off if len(rounds) in off_rounds else sp, use_tqdm=False)
        wall = time.perf_counter() - t
        if spec.get("address") and spec.get("settle", False):
            from kvpark.client import vllm as kvv

            kvv.wait_for_saves()  # the round's background saves have committed (or failed), untimed
        rounds.append({
            "seconds": wall,
            # CPU seconds of this process (background saves included when settled) and of the daemon.
            "cpu_s": time.process_time() - cpu,
            "daemon_cpu_s": _cpu_of(spec.get("daemon_pid")) - dcpu,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
        })
        if spec.get("reset", True):
            assert llm.reset_prefix_cache()
        if spec.get("freeze_pid") and len(rounds) == 1:
            # A daemon that freezes after the first round, with that round's saves possibly in flight.
            os.kill(int(spec["freeze_pid"]), signal.SIGSTOP)
    stats = {}
    if spec.get("address"):
        from kvpark.client import vllm as kvv

        kvv.wait_for_saves()
        stats = dict(kvv.STATS)
    return {"start_s": start_s, "rounds": rounds, "stats": stats}


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("out")
    m.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--spec", required=True, help="JSON: prompts, address, rounds, reset, kv_bytes, ...")
    args = ap.parse_args()
    if args.cmd == "make-model":
        make_model(args.out, args.shape)
        return 0
    result = run(args.model, json.loads(args.spec))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
