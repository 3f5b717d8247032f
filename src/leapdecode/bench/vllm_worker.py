"""One vLLM engine (the offline `LLM` API) serving the bench's greedy requests over a pipe.

Run with the vLLM environment's interpreter, by path (`python vllm_worker.py`): it imports
only the standard library and vLLM, so it works in a virtual environment that does not
hold leapdecode (vLLM's pins differ from ours). `vllm_peer.py` starts one per
configuration and talks to it in JSON lines:

    -> {"op": "load", "model": ..., "dtype": ..., "max_model_len": ..., "speculative_config": ...}
    <- {"ok": true, "load_s": s}                         or {"error": "..."}
    -> {"op": "generate", "ids": [int], "max_new_tokens": n}
    <- {"tokens": [int], "seconds": s, "forwards": n, "drafts": n, "draft_tokens": n,
        "accepted": n}
    -> {"op": "quit"}

`seconds` is request in to last token out (prefill included): `LLM.generate` on one
tokenised prompt, timed as leapdecode's own `generate` is timed in the bench. The spec
counts are vLLM's own per-request metrics (`per_request_spec_decode_metrics="summary"`).

The protocol uses the pipe that was stdout; vLLM's own output (and its engine processes')
goes to stderr, which the bench sends to a log file.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def count_steps(llm) -> list[int]:
    """A counter of the engine's steps that produced tokens (one request at a time: each is a
    target forward of it, the prefill included), kept by wrapping the engine core client's
    get_output. vLLM's own acceptance counts are taken before it trims the output to
    max_tokens, so forwards are counted rather than derived from them."""
    core = llm.llm_engine.engine_core
    get_output, steps = core.get_output, [0]

    def counted():
        out = get_output()
        if out.outputs:
            steps[0] += 1
        return out

    core.get_output = counted
    return steps


def spec_counts(seq) -> dict[str, int]:
    """The request's own speculation counts (vLLM's per-request metrics, `summary`): verify
    steps that had drafts, draft tokens proposed, draft tokens accepted."""
    m = getattr(seq, "spec_decode_metrics", None)
    if m is None:  # no speculation
        return {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    return {
        "drafts": sum(m.histogram),
        "draft_tokens": m.num_draft_tokens,
        "accepted": sum(j * n for j, n in enumerate(m.histogram)),
    }


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed (vLLM, its engine processes) goes to the log
    llm = None
    params = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "quit":
                break
            if msg["op"] == "load":
                from vllm import LLM, SamplingParams

                spec = msg.get("speculative_config")
                extra = {"per_request_spec_decode_metrics": "summary"} if spec else {}
                t0 = time.perf_counter()
                llm = LLM(
                    model=msg["model"],
                    dtype=msg["dtype"],
                    max_model_len=msg["max_model_len"],
                    seed=0,
                    speculative_config=spec,
                    **extra,
                    **msg.get("engine_args", {}),
                )
                params = SamplingParams
                steps = count_steps(llm)
                reply = {"ok": True, "load_s": time.perf_counter() - t0}
            elif msg["op"] == "generate":
                from vllm.inputs import TokensPrompt

                sampled = msg.get("temperature", 0.0) > 0
                sp = params(
                    temperature=msg.get("temperature", 0.0),
                    seed=msg.get("seed") if sampled else None,
                    max_tokens=msg["max_new_tokens"],
                    ignore_eos=msg.get("ignore_eos", False),
                )
                steps[0] = 0
                t0 = time.perf_counter()
                out = llm.generate([TokensPrompt(prompt_token_ids=msg["ids"])], sp, use_tqdm=False)
                seconds = time.perf_counter() - t0
                seq = out[0].outputs[0]
                reply = {
                    "tokens": list(seq.token_ids),
                    "seconds": seconds,
                    "forwards": steps[0],
                    **spec_counts(seq),
                }
            else:
                reply = {"error": f"unknown op {msg['op']!r}"}
        except Exception as e:  # noqa: BLE001 - the bench reports it and goes on
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
