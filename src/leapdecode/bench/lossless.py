"""Every lossless method must emit its reference's tokens; a difference is forgiven only at a
tie: where the reference's top-2 logits are closer than the dtype can tell apart.

References: leapdecode `none` for leapdecode methods, `hf-generate` for the transformers
peers, `vllm` (its plain decoding) for vLLM's speculative configurations, `llamacpp P` for
llama.cpp's at precision P, as for the other peers, and for the plain decodings of other code:
`hf-generate` for leapdecode `none` itself and leapdecode `none` for `vllm` and for `llamacpp P`
(same checkpoint at BF16, other kernels; at GGUF (quantized) other weights: its differences are
reported, not forgiven).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .runner import Record

# The logits' resolution: float32 rounding noise, or two units in the last place of the
# top logit for 16-bit models (bfloat16 keeps 8 significant bits, float16 11).
ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def tie_tolerance(top_logit: float, dtype: torch.dtype) -> float:
    return max(1e-4, 2 * ULP.get(dtype, 0.0) * abs(top_logit))


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check(
    records: list[Record],
    logits_fn,
    dtype: torch.dtype,
    prompts: dict[str, list[int]],
    sampled: bool = False,
) -> dict:
    """{(category, method): {"non_tie": n, "tie": n, "details": [...]}} over mismatching prompts.

    logits_fn(ours: bool, ids) -> the reference model's next-token logits [V] after ids.
    sampled: the run sampled (seeded), so each output is checked against its own repeats
    only (a seeded request repeats; the sampling tests prove the distribution)."""
    by_prompt: dict[str, dict[str, Record]] = defaultdict(dict)
    for r in records:
        by_prompt[r.prompt_id][r.method] = r
    out: dict = defaultdict(lambda: {"non_tie": 0, "tie": 0, "details": []})
    for pid, recs in by_prompt.items():
        for label, r in recs.items():
            if r.repeats_differing:  # greedy must repeat exactly: never a tie
                cell = out[(r.category, label)]
                cell["non_tie"] += 1
                cell["details"].append(
                    {
                        "prompt": pid,
                        "reference": "its own first round",
                        "repeats_differing": r.repeats_differing,
                        "tie": False,
                    }
                )
            if sampled:
                continue
            if r.name == "none":
                ref = recs.get("hf-generate")
            elif r.name == "hf-generate":
                continue
            elif r.name == "vllm":
                ref = recs.get("none")
            elif r.name.startswith("vllm"):
                ref = recs.get("vllm") or recs.get("none")
            elif r.name == "llamacpp":
                ref = recs.get("none")
            elif r.name.startswith("llamacpp"):  # its plain decoding at the same precision
                ref = recs.get("llamacpp " + label.rsplit(" ", 1)[-1]) or recs.get("none")
            else:
                ref = recs.get("none" if not r.name.startswith("hf-") else "hf-generate")
            if ref is None:
                continue
            pos = first_difference(r.tokens, ref.tokens)
            if pos is None:
                continue
            ours = not ref.name.startswith("hf-")
            logits = logits_fn(ours, prompts[pid] + ref.tokens[:pos]).float()
            top2 = torch.topk(logits, 2)
            margin = float(top2.values[0] - top2.values[1])
            pair = {
                ref.tokens[pos] if pos < len(ref.tokens) else None,
                r.tokens[pos] if pos < len(r.tokens) else None,
            }
            is_tie = pair == set(top2.indices.tolist()) and margin <= tie_tolerance(
                float(top2.values[0]), dtype
            )
            cell = out[(r.category, label)]
            cell["tie" if is_tie else "non_tie"] += 1
            cell["details"].append(
                {
                    "prompt": pid,
                    "reference": ref.method,
                    "position": pos,
                    "margin": margin,
                    "tie": is_tie,
                }
            )
    return dict(out)
