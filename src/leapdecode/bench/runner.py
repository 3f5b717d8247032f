"""Run every method on every prompt, interleaved, and keep the per-run records.

Order: one warm-up pass of every method (untimed), then for each prompt `repeats` rounds;
each round runs every method once, in ABBA order (`round_order`: every odd round reverses
the one before, and each pair of rounds starts half the list further on), so no method
keeps a slot or a neighbour. A (prompt, method) figure is the median of its rounds; its
counters come from the first round, and a later round whose tokens differ is recorded
(`repeats_differing`: greedy decoding must repeat exactly).

`suffix`'s global tree is frozen for the run: it holds the outputs of the prompts measured
before (`none`'s, added after each prompt, as a server would have seen them), never the
current prompt's own earlier runs.

A full run takes longer than some sessions last, so each finished prompt's records are
appended to a partial file; a run with the same settings resumes after the last finished
prompt; one with fewer of its methods (and nothing else changed) keeps those methods'
records. A partial file of other settings stops the run with the differences (rather than
being overwritten): pass --fresh to start over.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from ..api import LeapDecoder
from ..config import SpecConfig
from ..errors import LeapDecodeError
from ..proposers import registry
from .llamacpp_peer import NAMES as LLAMACPP_NAMES
from .vllm_peer import NAMES

# leapdecode method -> its Hugging Face transformers counterpart (vLLM's: vllm_peer.COUNTERPART)
COUNTERPART = {"none": "hf-generate", "draft": "hf-assisted", "ngram": "hf-lookup"}
PEERS = tuple(COUNTERPART.values())
VLLM = NAMES  # vLLM's configurations (vllm_peer.py)
LLAMACPP = LLAMACPP_NAMES  # llama.cpp's (llamacpp_peer.py), each at a precision
BASELINES = ("none", "hf-generate", "vllm")  # no speculation: no k in the label


OURS = (
    "none",
    "draft",
    "ngram",
    "ngram-tree",
    "suffix",
    "suffix-tree",
    "lookahead",
    "medusa",
    "eagle",
    "pard",
    "peagle",
    "auto",  # per step the method and k with the best expected goodput (engine/planner.py)
)


@dataclass(frozen=True)
class Method:
    # none | draft | ngram | ngram-tree | suffix | suffix-tree | lookahead | medusa | eagle |
    # hf-generate | hf-assisted | hf-lookup | vllm | vllm-ngram | ... (VLLM)
    # ("-tree": the method with use_tree_spec)
    name: str
    k: int = 0  # draft tokens (tree methods: nodes) per step
    opts: tuple = ()  # further SpecConfig fields, as (name, value) pairs

    @property
    def method(self) -> str:
        """The engine's method name."""
        return self.name.removesuffix("-tree")

    @property
    def options(self) -> dict:
        return dict(self.opts) | ({"use_tree_spec": True} if self.name.endswith("-tree") else {})

    @property
    def label(self) -> str:
        if self.llamacpp:  # "llamacpp GGUF", "llamacpp-draft k=3 BF16"
            base = self.name if self.name == "llamacpp" else f"{self.name} k={self.k}"
            return f"{base} {dict(self.opts)['precision']}"
        if self.name in BASELINES or self.name == "auto":  # no k of its own
            return self.name
        if self.name == "lookahead":
            o = self.options
            return (
                f"lookahead W{o['lookahead_window']} N{o['lookahead_ngram_size']} "
                f"G{o['lookahead_max_candidates']}"
            )
        if self.name == "eagle" and self.opts:
            return f"eagle k={self.k} d{dict(self.opts)['speculative_num_steps']}"
        label = f"{self.name} k={self.k}"
        factor = dict(self.opts).get("suffix_decoding_max_spec_factor")
        if factor is not None:  # suffix with a draft cap other than the default
            label += f" f{factor:g}"
        if dict(self.opts).get("suffix_decoding_char_match") is False:
            label += " tokens-only"
        return label

    @property
    def ours(self) -> bool:
        return not self.name.startswith(("hf-", "vllm", "llamacpp"))

    @property
    def vllm(self) -> bool:
        return self.name.startswith("vllm")

    @property
    def llamacpp(self) -> bool:
        return self.name.startswith("llamacpp")


def lookahead(w: int, n: int, g: int) -> Method:
    """Lookahead with window W, n-gram size N and G candidates: k = its tree's nodes."""
    opts = (("lookahead_window", w), ("lookahead_ngram_size", n), ("lookahead_max_candidates", g))
    return Method("lookahead", SpecConfig(method="lookahead", **dict(opts)).k, opts)


@dataclass
class Record:
    category: str
    prompt_id: str
    method: str  # label
    name: str
    k: int
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    target_forwards: int = 0  # the prefill included
    decode_steps: int = 0
    draft_forwards: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    propose_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    repeats_differing: int = 0  # later rounds whose tokens differ from the first's

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def method_list(
    draft_ks,
    ngram_ks,
    peer_ks,
    with_draft: bool,
    with_peers: bool,
    tree_ks=(),
    suffix_ks=(),
    lookaheads=(),
    medusa_ks=(),
    eagle_ks=(),
    eagle_depths=(4,),
    suffix_factors=(1.0,),
    suffix_tokens_only=False,
    pard_ks=(),
    peagle_ks=(),
    with_auto=False,
) -> list[Method]:
    """lookaheads: (W, N, G) triples; medusa_ks / eagle_ks: tree sizes (empty: no heads);
    pard_ks / peagle_ks: the parallel draft's and the parallel head's chains (empty: none);
    eagle_depths: the eagle tree's depths (speculative_num_steps) tried at each size;
    suffix_factors: suffix's draft caps (suffix_decoding_max_spec_factor) tried at each k;
    suffix_tokens_only: each suffix chain setting also without matching characters;
    with_auto: `auto` too (asked for by name: it profiles the step costs first)."""
    methods = [Method("none")]
    if with_draft:
        methods += [Method("draft", k) for k in draft_ks]
    methods += [Method("ngram", k) for k in ngram_ks]
    methods += [Method("ngram-tree", k) for k in tree_ks]

    def factor(f: float) -> tuple:  # the default cap keeps the plain label
        return (
            ()
            if f == SpecConfig().suffix_decoding_max_spec_factor
            else (("suffix_decoding_max_spec_factor", f),)
        )

    methods += [Method("suffix", k, factor(f)) for k in suffix_ks for f in suffix_factors]
    if suffix_tokens_only:
        methods += [
            Method("suffix", k, factor(f) + (("suffix_decoding_char_match", False),))
            for k in suffix_ks
            for f in suffix_factors
        ]
    methods += [Method("suffix-tree", k, factor(f)) for k in tree_ks for f in suffix_factors]
    methods += [lookahead(*wng) for wng in lookaheads]
    methods += [Method("medusa", k) for k in medusa_ks]
    methods += [
        Method("eagle", k, (("speculative_num_steps", d),)) for k in eagle_ks for d in eagle_depths
    ]
    methods += [Method("pard", k) for k in pard_ks]
    methods += [Method("peagle", k) for k in peagle_ks]
    if with_auto:
        methods.append(Method("auto"))
    if with_peers:
        methods.append(Method("hf-generate"))
        if with_draft:
            methods += [Method("hf-assisted", k) for k in peer_ks["draft"]]
        methods += [Method("hf-lookup", k) for k in peer_ks["ngram"]]
    return methods


def vllm_method_list(
    ks: dict[str, list[int]],
    with_draft: bool,
    with_eagle: bool,
    leap_ngram_ks=(),
    leap_suffix_ks=(),
    with_pard: bool = False,
    with_peagle: bool = False,
) -> list[Method]:
    """vLLM's configurations: ks = {"vllm-ngram": [...], "vllm-draft": ..., "vllm-suffix": ...,
    "vllm-eagle3": ...}; eagle3 runs our exported head, draft_model our draft; leap_*_ks:
    our own proposers inside vLLM; with_pard / with_peagle: our parallel draft and head, run by
    vLLM's parallel drafting."""
    methods = [Method("vllm")]
    methods += [Method("vllm-ngram", k) for k in ks["vllm-ngram"]]
    if with_draft:
        methods += [Method("vllm-draft", k) for k in ks["vllm-draft"]]
    methods += [Method("vllm-suffix", k) for k in ks["vllm-suffix"]]
    if with_eagle:
        methods += [Method("vllm-eagle3", k) for k in ks["vllm-eagle3"]]
    if with_pard:
        methods += [Method("vllm-pard", k) for k in ks["vllm-pard"]]
    if with_peagle:
        methods += [Method("vllm-peagle", k) for k in ks["vllm-peagle"]]
    methods += [Method("vllm-leap-ngram", k) for k in leap_ngram_ks]
    methods += [Method("vllm-leap-suffix", k) for k in leap_suffix_ks]
    return methods


def llamacpp_method_list(ks: dict[str, list[int]], precisions, with_draft: bool) -> list[Method]:
    """llama.cpp's configurations at each precision (GGUF, BF16): ks = {"llamacpp-draft":
    [...], "llamacpp-ngram": [...]}; `llamacpp-ngram-mod` is its default configuration."""
    methods = []
    for p in precisions:
        opts = (("precision", p),)
        methods.append(Method("llamacpp", 0, opts))
        if with_draft:
            methods += [Method("llamacpp-draft", k, opts) for k in ks["llamacpp-draft"]]
        methods += [Method("llamacpp-ngram", k, opts) for k in ks["llamacpp-ngram"]]
        methods.append(Method("llamacpp-ngram-mod", 64, opts))
    return methods


@dataclass(frozen=True)
class Generation:
    """How every method of a run generates: greedy (temperature 0) or sampled with one seed
    a request; the draft confidence cut-off; our chains' verification rule."""

    temperature: float = 0.0
    seed: int = 0
    draft_min_prob: float = 0.0
    verify: str = "auto"

    def ours(self, m: Method) -> dict:
        # block verification is for chains: tree settings keep the token rule (verify.py), and
        # so does auto, whose steps may draft trees
        chain = (
            m.method != "auto"
            and registry.get(m.method).tree != registry.TREE
            and not m.options.get("use_tree_spec")
        )
        sampled = dict(temperature=self.temperature, seed=self.seed) if self.temperature else {}
        verify = self.verify if chain or self.verify != "block" else "token"
        return dict(draft_min_prob=self.draft_min_prob, verify=verify, **sampled)


def _run_once(
    dec: LeapDecoder, peers, m: Method, ids, max_new: int, gen: Generation, vllm=None, llamacpp=None
):
    """(seconds, tokens, stats, target forwards): stats are ours, {"proposed", "accepted"}
    for vLLM and llama.cpp (their own counters), None for transformers."""
    gc.collect()  # no method pays for garbage another one left
    if m.vllm or m.llamacpp:  # vLLM: timed inside its worker; llama.cpp: around the request
        peer = vllm if m.vllm else llamacpp
        secs, tokens, forwards, proposed, accepted = peer.generate(
            m.label, ids, max_new, gen.temperature, gen.seed
        )
        return secs, tokens, {"proposed": proposed, "accepted": accepted}, forwards
    if m.ours:
        t0 = time.perf_counter()
        k = {} if m.name == "auto" else {"k": m.k}  # auto picks k each step
        out = dec.generate(
            ids, method=m.method, max_new_tokens=max_new, **k, **gen.ours(m), **m.options
        )
        return time.perf_counter() - t0, out.token_ids, out.stats, out.stats.target_forwards
    t0 = time.perf_counter()
    tokens, forwards = peers.generate(
        ids, m.name, m.k, max_new, gen.draft_min_prob, gen.temperature, gen.seed
    )
    return time.perf_counter() - t0, tokens, None, forwards


def round_order(items: list, r: int) -> list:
    """Round r's order, ABBA-style: each odd round is the round before it reversed (so a
    drift over a pair of rounds costs every item alike), and each pair starts half the
    list further on, so items also meet different neighbours."""
    shift = (r // 2) * max(1, len(items) // 2) % len(items)
    order = items[shift:] + items[:shift]
    return order[::-1] if r % 2 else order


def load_partial(path: str | None, signature: dict) -> dict[str, list[Record]]:
    """Finished prompts of an earlier run with the same signature: {prompt_id: records}.
    A partial file of other settings is an error that names the differences (hours of
    records are not overwritten silently); a half-written last line is dropped."""
    if not path or not os.path.isfile(path):
        return {}
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                break  # the run was killed while writing this line: it and any after go
    if not rows or "signature" not in rows[0]:
        return {}
    old, new = rows[0]["signature"], json.loads(json.dumps(signature))
    diff = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
    if diff == ["methods"] and set(new["methods"]) <= set(old["methods"]):
        rows = _narrow(path, rows, new)  # fewer methods: their records are still good
    elif diff:
        raise LeapDecodeError(
            f"{path} holds {len(rows) - 1} finished prompts of a run with other settings "
            f"(differing: {', '.join(diff)}): rerun with the same settings to resume it, "
            "or pass --fresh to start over (or --out elsewhere to keep it)"
        )
    done: dict[str, list[Record]] = {}
    for row in rows[1:]:
        done[row["prompt_id"]] = [Record(**r) for r in row["records"]]
    return done


def _narrow(path: str, rows: list[dict], signature: dict) -> list[dict]:
    """Resume with a subset of an interrupted run's methods: keep those methods' records,
    rewrite the partial file for the new settings, and keep the old file beside it."""
    keep = signature["methods"]
    narrowed = [{"signature": signature}]
    for row in rows[1:]:
        by_label = {r["method"]: r for r in row["records"]}
        narrowed.append({**row, "records": [by_label[m] for m in keep]})
    kept, n = path + ".all-methods", 1
    while os.path.exists(kept):  # narrowed before: keep every earlier file too
        kept, n = f"{path}.all-methods.{n}", n + 1
    os.replace(path, kept)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in narrowed)
    print(
        f"resuming with {len(keep)} of the {len(rows[0]['signature']['methods'])} methods "
        f"of {path}; the full records are kept in {kept}"
    )
    return narrowed


def _append(path: str, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


@torch.no_grad()
def run(
    dec: LeapDecoder,
    peers,
    sets: dict[str, list[dict]],
    methods: list[Method],
    repeats: int,
    max_new_cap: int | None = None,
    gen: Generation = Generation(),
    partial: str | None = None,
    signature: dict | None = None,
    vllm=None,
    llamacpp=None,
) -> list[Record]:
    """partial: file that keeps finished prompts' records; resumed when its signature matches;
    vllm / llamacpp: the vLLM / llama.cpp peers (VllmPeers, LlamaCppPeers) when methods hold
    any."""
    done = load_partial(partial, signature or {})
    if partial and not done:
        os.makedirs(os.path.dirname(os.path.abspath(partial)), exist_ok=True)
        with open(partial, "w") as f:
            f.write(json.dumps({"signature": signature or {}}) + "\n")
    suffix = dec.engine.proposers.get("suffix")
    if suffix is not None:
        suffix.frozen = True  # only cache_output below feeds the global tree
    first = next(iter(sets.values()))[0]
    warm_ids = dec.encode(first["prompt"])
    for m in methods:  # warm-up: allocator, oneDNN kernels, caches
        _run_once(dec, peers, m, warm_ids, 16, gen, vllm, llamacpp)

    with _frozen_heap():
        records: list[Record] = []
        total = sum(len(rows) for rows in sets.values()) * repeats * len(methods)
        n_done = sum(row["id"] in done for rows in sets.values() for row in rows)
        if n_done:
            print(
                f"resuming from {partial}: {n_done} prompts already measured "
                "(delete the file, or pass --fresh, to start over)"
            )
        bar = tqdm(total=total, desc="bench", unit="run", initial=n_done * repeats * len(methods))
        suffix_used = suffix is not None and any(m.method in ("suffix", "auto") for m in methods)
        for cat, rows in sets.items():
            for row in rows:
                if row["id"] in done:
                    records.extend(done[row["id"]])
                    if suffix_used:  # the global tree holds every earlier prompt's output
                        suffix.cache_output(done[row["id"]][0].tokens)
                    continue
                ids = dec.encode(row["prompt"])
                max_new = (
                    row["max_new_tokens"]
                    if max_new_cap is None
                    else min(max_new_cap, row["max_new_tokens"])
                )
                recs = {m: Record(cat, row["id"], m.label, m.name, m.k) for m in methods}
                stats_by_rep = {m: [] for m in methods}
                for rep in range(repeats):
                    for m in round_order(methods, rep):
                        bar.set_postfix_str(f"{cat} {row['id']} {m.label}")
                        secs, tokens, stats, forwards = _run_once(
                            dec, peers, m, ids, max_new, gen, vllm, llamacpp
                        )
                        r = recs[m]
                        r.seconds.append(secs)
                        if rep == 0:
                            r.tokens, r.target_forwards = tokens, forwards
                        elif list(tokens) != list(r.tokens):
                            r.repeats_differing += 1
                        stats_by_rep[m].append((secs, stats))
                        bar.update()
                for m, r in recs.items():
                    _fill_stats(r, stats_by_rep[m])
                    records.append(r)
                if partial:
                    _append(
                        partial,
                        {"prompt_id": row["id"], "records": [asdict(r) for r in recs.values()]},
                    )
                if suffix_used:
                    # as a server would: later requests find this one's output in the global tree
                    out = next(r.tokens for r in recs.values())
                    suffix.cache_output(out)
        bar.close()
    return records


@contextmanager
def _frozen_heap():
    """Objects alive before measuring move to gc's permanent generation, so the gc.collect()
    before each timed call scans only what the runs themselves allocate (a full collection
    over torch's and transformers' objects took about half a second a call)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _fill_stats(r: Record, runs) -> None:
    """Counters from the first run (they repeat exactly); time split from the median run."""
    stats = runs[0][1]
    if stats is None or isinstance(stats, dict):  # a peer: its forwards and tokens are known
        r.decode_steps = r.target_forwards - 1
        r.accepted = max(0, len(r.tokens) - 1 - r.decode_steps)  # tokens past one per forward
        if stats is not None:  # vLLM counts what it drafted
            r.proposed = stats["proposed"]
        return
    r.decode_steps = stats.decode_steps
    r.draft_forwards = stats.draft_forwards
    r.proposed, r.accepted = stats.proposed, stats.accepted
    r.proposed_by_position = list(stats.proposed_by_position)
    r.accepted_by_position = list(stats.accepted_by_position)
    ordered = sorted(runs, key=lambda x: x[0])
    mid = ordered[len(ordered) // 2][1]
    r.propose_s, r.verify_s, r.accept_s = mid.propose_s, mid.verify_s, mid.accept_s


@torch.no_grad()
def measure_costs(dec: LeapDecoder, ks: list[int], context: int = 512, reps: int = 30) -> dict:
    """Per-forward costs at `context` cached tokens, medians of interleaved repetitions:
    c = draft one-token forward / target one-token forward, and verify(k+1 tokens) / decode."""
    models = {"target": dec.target} | ({"draft": dec.draft} if dec.draft is not None else {})
    context = min(context, dec.target.max_context - max(ks, default=1) - 2)
    slots = torch.tensor([0])
    prefix = torch.randint(0, dec.target.vocab_size, (1, context))
    for m in models.values():
        m.allocate(1, context + max(ks, default=1) + 2)
        m.forward(prefix, slots)
    sizes = sorted({1, *(k + 1 for k in ks)})
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(reps):
        for name, m in models.items():
            for n in sizes if name == "target" else [1]:
                x = torch.randint(0, dec.target.vocab_size, (1, n))
                t0 = time.perf_counter()
                m.forward(x, slots)
                times.setdefault((name, n), []).append(time.perf_counter() - t0)
                m.truncate(slots, torch.tensor([context]))
    med = {key: statistics.median(v) for key, v in times.items()}
    decode = med[("target", 1)]
    return {
        "context": context,
        "target_decode_ms": decode * 1e3,
        "draft_decode_ms": med[("draft", 1)] * 1e3 if "draft" in models else None,
        "c": med[("draft", 1)] / decode if "draft" in models else None,
        "verify_over_decode": {str(n - 1): med[("target", n)] / decode for n in sizes if n > 1},
    }
