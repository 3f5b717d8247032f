"""Chain proposers replayed on the target's recorded greedy outputs: tokens per target forward
without running the target.

Under greedy decoding the target's output does not depend on the proposer, so each step can
be replayed from the recorded output: a draft keeps its longest prefix that the output
continues with, plus one token of the target's own. That gives each proposer's tokens per
forward (and its own time per step) in seconds, for trying proposer ideas before an engine
run. The first run records the outputs (prompt lookup, lossless) to --cache.

Configurations: ngramK (prompt lookup, k=K), suffixK[fF] (suffix decoding, k=K, draft cap
factor F, default 1), with `-tokens`: without matching the text's characters
(proposers/char_lookup.py), the trie matches only; `best:A+B+..`: at each step the best of
those drafts in hindsight (the ceiling of any rule choosing among them).

    python bench/chain_replay.py --category revision \\
        --configs ngram16,suffix16-tokens,suffix16,suffix16f4-tokens,suffix16f4
"""

from __future__ import annotations

import argparse
import json
import os
import time

from leapdecode.config import SamplingParams, SpecConfig
from leapdecode.proposers.ngram import NgramProposer
from leapdecode.proposers.suffix import SuffixProposer
from leapdecode.sequence import Sequence


def record(target: str, category: str, path: str) -> list[dict]:
    from tqdm import tqdm

    from leapdecode import LeapDecoder

    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "prompts", f"{category}.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    dec = LeapDecoder.from_pretrained(target, dtype="float32")
    out = []
    for r in tqdm(rows, desc=f"recording {category}"):
        ids = dec.encode(r["prompt"])
        res = dec.generate(ids, method="ngram", k=16, max_new_tokens=r["max_new_tokens"])
        out.append({"prompt": ids, "output": res.token_ids})
    with open(path, "w") as f:
        json.dump(out, f)
    return out


def proposer_for(name: str, strings: list[str]):
    """ngramK | suffixK[fF][-tokens] (-tokens: without matching characters) -> (k, spec,
    proposer)."""
    if name.startswith("ngram"):
        return int(name[5:]), SpecConfig(method="ngram"), NgramProposer()
    base, _, tokens_only = name[6:].partition("-")
    k, _, factor = base.partition("f")
    spec = SpecConfig(method="suffix", suffix_decoding_max_spec_factor=float(factor or 1),
                      suffix_decoding_char_match=not tokens_only)  # fmt: skip
    prop = SuffixProposer(max_cached_requests=0)
    prop.token_strings = strings
    return int(k), spec, prop


def replay(refs: list[dict], name: str, strings: list[str]) -> tuple[float, float]:
    """(tokens per forward, proposer ms per step) over every recorded output. A name
    `best:A+B+..` is a hindsight oracle: each step keeps the draft of A, B, .. that the output
    continues longest, a ceiling for any rule that picks among those proposers."""
    names = name[5:].split("+") if name.startswith("best:") else [name]
    forwards = tokens = 0
    spent = 0.0
    for i, r in enumerate(refs):
        runs = []
        for one in names:
            k, spec, prop = proposer_for(one, strings)
            seq = Sequence(i, list(r["prompt"]), len(r["prompt"]), SamplingParams(),
                           len(r["output"]), 10**6, frozenset(), spec=spec)  # fmt: skip
            prop.add([seq])
            runs.append((k, prop, seq))
        out, pos = r["output"], 0
        while pos < len(out):
            best = 0
            for k, prop, seq in runs:
                t0 = time.perf_counter()
                if isinstance(prop, SuffixProposer):
                    draft = prop.speculate(seq, k)[0]
                else:
                    draft = prop.lookup(seq, k)
                spent += time.perf_counter() - t0
                a = 0
                while a < len(draft) and pos + a < len(out) and draft[a] == out[pos + a]:
                    a += 1
                best = max(best, a)
            n = min(best + 1, len(out) - pos)
            for _, _, seq in runs:
                seq.tokens.extend(out[pos : pos + n])
            pos += n
            forwards += 1
            tokens += n
        for _, prop, seq in runs:
            prop.remove([seq])
    return tokens / forwards, 1000 * spent / forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="models/leap-code-target")
    ap.add_argument("--category", default="revision")
    ap.add_argument(
        "--cache", default=None, help="recorded outputs (default /tmp/replay-<cat>.json)"
    )
    ap.add_argument(
        "--configs", default="ngram16,suffix16-tokens,suffix16,suffix16f4-tokens,suffix16f4"
    )
    args = ap.parse_args()
    path = args.cache or f"/tmp/replay-{args.category}.json"
    if os.path.isfile(path):
        with open(path) as f:
            refs = json.load(f)
    else:
        refs = record(args.target, args.category, path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    strings = tok.convert_ids_to_tokens(list(range(len(tok))))
    print(f"| {args.category} | tokens / forward | proposer ms / step |\n|---|---|---|")
    for name in args.configs.split(","):
        tpf, ms = replay(refs, name, strings)
        print(f"| {name} | {tpf:.2f} | {ms:.3f} |")


if __name__ == "__main__":
    main()
