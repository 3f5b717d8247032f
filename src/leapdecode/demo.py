"""`leapdecode demo`: speculative generation side by side with plain decoding."""

from __future__ import annotations

import os
import statistics

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from .errors import LeapDecodeError

DEMO_PROMPT = '''import os


def count_lines(path):
    """Return the number of lines in the file at path."""
    with open(path) as f:
        return sum(1 for _ in f)


def count_words(path):
    """Return the number of words in the file at path."""'''
# The prompt ends inside the line: a trailing newline would be a lone "\n" token, which
# byte-level BPE merges with the next line's indent in real code.

# k per method: the best of each on the embedded pair (docs/bench/results.md): a short
# draft-model chain, long copies for prompt lookup and suffix, a 6-node EAGLE tree.
DEMO_K = {"draft": 2, "ngram": 16, "suffix": 16, "lookahead": 4, "medusa": 4, "eagle": 6}

FALLBACK_DIR = os.path.join(os.path.expanduser("~"), ".cache", "leapdecode", "demo-pair")


def make_fallback_pair(root: str = FALLBACK_DIR) -> tuple[str, str]:
    """A small random target and draft (same tokenizer), for when no trained pair exists."""
    target, draft = os.path.join(root, "target"), os.path.join(root, "draft")
    if os.path.isfile(os.path.join(draft, "config.json")):
        return target, draft
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .train import corpus
    from .train.tokenizer import train_tokenizer

    tok_dir = os.path.join(root, "tokenizer")
    stdlib = corpus.stdlib_dir()
    small = os.path.join(root, "corpus")
    os.makedirs(small, exist_ok=True)
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py"):
        with (
            open(os.path.join(stdlib, name), encoding="utf-8") as src,
            open(os.path.join(small, name), "w", encoding="utf-8") as dst,
        ):
            dst.write(src.read())
    tok = train_tokenizer(small, tok_dir, vocab_size=1024, val_percent=0.0)
    for path, (hidden, layers, seed) in ((target, (256, 4, 0)), (draft, (64, 1, 1))):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                          max_position_embeddings=1024, tie_word_embeddings=True,
                          eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)  # fmt: skip
        LlamaForCausalLM(cfg).save_pretrained(path)
        tok.save_pretrained(path)
    return target, draft


def parse_methods(names: str | None) -> list[str] | None:
    """--methods, checked before any model loads: `none` first (the baseline), then the
    speculative ones; None = the default set (see `_default_methods`)."""
    from .config import METHODS

    if names is None:
        return None
    wanted = [m.strip() for m in names.split(",") if m.strip()]
    bad = [m for m in wanted if m not in METHODS]
    if bad or not wanted:
        raise LeapDecodeError(
            f"--methods: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(METHODS)}"
        )
    if "auto" in wanted:
        raise LeapDecodeError("--methods: auto needs a load to adapt to; try it with "
                              "`leapdecode generate --method auto` or `leapdecode serve`")  # fmt: skip
    return ["none", *[m for m in wanted if m != "none"]]


def _default_methods(dec) -> list[str]:
    found = [m for m in ("eagle",) if m in dec.speculators]
    return ["none", "draft", "ngram", "suffix", *found]


def run_demo(args) -> int:
    from .api import LeapDecoder
    from .paths import DRAFT_NAME, TARGET_NAME, default_model

    console = Console(stderr=False)
    target = args.target or default_model(TARGET_NAME)
    draft = args.draft or (default_model(DRAFT_NAME) if not args.target else None)
    if target is None or draft is None:
        if args.target:
            raise LeapDecodeError("the demo compares draft decoding too: pass --draft PATH as well")
        console.print("[yellow]No embedded models in models/: using a small random pair "
                      "(its output is not meaningful code).[/yellow]")  # fmt: skip
        target, draft = make_fallback_pair()
    names = parse_methods(args.methods)
    if args.prompt is not None and not args.prompt.strip():
        raise LeapDecodeError("--prompt is empty: give some text, or leave it out for the demo's")
    prompt = args.prompt or DEMO_PROMPT
    console.print(f"target [bold]{target}[/bold]\ndraft  [bold]{draft}[/bold]")
    dec = LeapDecoder.from_pretrained(target, draft=draft, backend=args.backend,
                                      device=args.device, dtype=args.dtype,
                                      draft_dtype=args.draft_dtype,
                                      speculators=args.speculator)  # fmt: skip
    methods = [(m, 0 if m == "none" else args.k or DEMO_K.get(m, 4))
               for m in names or _default_methods(dec)]  # fmt: skip
    dec.generate(prompt, method="none", max_new_tokens=8)  # warm-up
    runs = {m: [] for m, _ in methods}
    with console.status("generating...") as status:
        for r in range(args.repeats):
            for m, k in methods:  # interleaved, so that machine noise hits every method alike
                status.update(f"repeat {r + 1}/{args.repeats}: {m}")
                runs[m].append(dec.generate(prompt, method=m, k=max(k, 1),
                                            max_new_tokens=args.max_new_tokens))  # fmt: skip
    base = runs["none"][0]
    console.print(Syntax(prompt + base.text, "python", theme="ansi_dark", line_numbers=False))
    table = Table(title=f"Greedy, {args.max_new_tokens} new tokens, median of {args.repeats}")
    for col in (
        "method",
        "k",
        "tokens/s",
        "tok/forward",
        "accept rate",
        "speedup",
        "same output",
    ):
        table.add_column(col, justify="right" if col != "method" else "left")
    base_tps = statistics.median(r.stats.as_dict()["tokens_per_s"] for r in runs["none"])
    for m, k in methods:
        tps = statistics.median(r.stats.as_dict()["tokens_per_s"] for r in runs[m])
        s = runs[m][0].stats
        same = all(r.token_ids == base.token_ids for r in runs[m])
        table.add_row(m, str(k), f"{tps:.1f}", f"{s.mean_accepted_tokens:.2f}",
                      f"{s.acceptance_rate:.2f}" if k else "-", f"{tps / base_tps:.2f}x",
                      "yes" if same else "NO")  # fmt: skip
    console.print(table)
    return 0
