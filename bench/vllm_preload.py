"""A/B: vLLM engines with and without the LD_PRELOAD of vLLM's CPU guide (tcmalloc + iomp)."""
import json, statistics, sys, time
sys.path.insert(0, "/work/main/src")
from transformers import AutoTokenizer
from leapdecode.bench.vllm_peer import VllmPeers, spec_config, preload
from leapdecode.bench import workloads

if __name__ == "__main__":
    target = "/work/main/models/leap-code-target"
    py = "/work/main/.venv-vllm/bin/python"
    print("preload:", preload(py), flush=True)
    tok = AutoTokenizer.from_pretrained(target)
    sets = workloads.load("/work/main/bench/prompts")
    rows = [r for c in sets.values() for r in c[:3]]
    suffix = spec_config("vllm-suffix", 16)
    off = {"_env": {"LD_PRELOAD": ""}}
    configs = [("none+pre", None), ("none-pre", dict(off)), ("suffix+pre", suffix),
               ("suffix-pre", suffix | off)]
    peers = VllmPeers(py, target, configs, "float32", 1024, 1, "/tmp/proto/logs",
                      warm_up=30, vocab_size=8192)
    res = {c[0]: [] for c in configs}
    try:
        for rnd in range(3):
            for r in rows:
                ids = tok.encode(r["prompt"])
                order = [c[0] for c in configs] if rnd % 2 == 0 else [c[0] for c in configs][::-1]
                for label in order:
                    s, toks, *_ = peers.generate(label, ids, r.get("max_new_tokens", 128))
                    res[label].append(len(toks) / s)
            print("round", rnd, {k: round(statistics.median(v), 1) for k, v in res.items()}, flush=True)
    finally:
        peers.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    print(json.dumps(med))
    print("none: with/without", med["none+pre"] / med["none-pre"])
    print("suffix: with/without", med["suffix+pre"] / med["suffix-pre"])
