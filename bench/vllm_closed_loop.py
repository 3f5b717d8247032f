"""vLLM's engine under bench/closed_loop.py's load: the same requests, C at a time, no HTTP.

Run with the vLLM venv's Python (`bash bench/vllm_env.sh .venv-vllm` builds it):

    for c in none ngram8; do VLLM_CPU_KVCACHE_SPACE=2 OMP_NUM_THREADS=1 \\
        .venv-vllm/bin/python bench/vllm_closed_loop.py --concurrency 16 --config $c --prefill; done

The requests are closed_loop.py's (the bench prompts, all categories round robin, at most 64
new tokens, round r from prompt r x requests, a warm-up from the middle); vLLM's offline
`LLM.generate` with `max_num_seqs` = C admits the next request as soon as one finishes, as
closed_loop's clients do. Per run it prints tokens/s and wall time; `--prefill` adds a run of
the same prompts for one token each (the prompts alone, C admitted at a time), the figure
`closed_loop.py --prefill` prints as "prefill alone". One configuration a process: a second
vLLM engine loaded beside the first slows it (its engine core polls while idle; README,
"vLLM's dtype").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from leapdecode.bench import workloads
from leapdecode.bench.command import PROMPTS
from leapdecode.config import SpecConfig
from leapdecode.paths import resolve_models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32, help="requests per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", default="none", help="none, or ngramK (K drafts)")
    ap.add_argument("--prefill", action="store_true", help="also time the prompts alone")
    ap.add_argument("--dtype", default="float32", help="float32 (the checkpoint's) or bfloat16")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    target, _ = resolve_models(None, None)
    tok = AutoTokenizer.from_pretrained(target)
    max_context = AutoConfig.from_pretrained(target).max_position_embeddings
    sets = workloads.load(PROMPTS)
    rows = [r for group in zip(*sets.values(), strict=False) for r in group]
    spec = SpecConfig()
    label, drafts = args.config, None
    if label.startswith("ngram") and label.removeprefix("ngram").isdigit():
        drafts = {
            "method": "ngram",
            "num_speculative_tokens": int(label.removeprefix("ngram")),
            "prompt_lookup_min": spec.prompt_lookup_min,
            "prompt_lookup_max": spec.prompt_lookup_max,
        }
    elif label != "none":
        raise SystemExit(f"unknown configuration {label!r}: use none or ngramK (ngram8, say)")
    llm = LLM(
        model=target,
        dtype=args.dtype,
        max_model_len=max_context,
        seed=0,
        enable_prefix_caching=False,
        max_num_seqs=args.concurrency,
        speculative_config=drafts,
    )

    def requests(start: int) -> list[tuple[list[int], int]]:
        picked = [rows[(start + i) % len(rows)] for i in range(args.requests)]
        return [(tok(r["prompt"])["input_ids"], min(64, r["max_new_tokens"])) for r in picked]

    def run(start: int, one_token: bool = False) -> dict:
        reqs = requests(start)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in reqs]
        params = [SamplingParams(temperature=0, max_tokens=1 if one_token else n) for _, n in reqs]
        t0 = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in out)
        name = label + (" prefill" if one_token else "")
        return {"config": name, "tok_s": round(tokens / wall, 1), "wall_s": round(wall, 2),
                "prompt_tokens": sum(len(i) for i, _ in reqs)}  # fmt: skip

    run(len(rows) // 2)  # warm-up
    results: list[float] = []
    prefill: list[float] = []
    for r in range(args.rounds):
        out = run(r * args.requests)
        results.append(out["tok_s"])
        print(json.dumps(out), flush=True)
        if args.prefill:
            out = run(r * args.requests, one_token=True)
            prefill.append(out["wall_s"])
            print(json.dumps(out), flush=True)
    print(f"vllm {label}: median {statistics.median(results):.1f} tokens/s")
    if prefill:
        print(f"vllm prefill alone: median {statistics.median(prefill):.2f} s")


if __name__ == "__main__":
    main()
