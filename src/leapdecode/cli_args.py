"""The command-line flags that several commands share (generate, demo, serve, bench): the
model, the tree methods' options and the generation options, and the SpecConfig / engine
keywords they become. Kept apart from cli.py so that the server's and the bench's commands
take them without importing the command line itself."""

from __future__ import annotations

import argparse

from .config import VERIFY_RULES
from .paths import resolve_pard
from .proposers import registry


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model folder (Hugging Face format)")
    p.add_argument("--draft", help="draft model folder, same tokenizer as the target")
    p.add_argument(
        "--pard",
        metavar="PATH",
        help="parallel draft model folder (PARD: `leapdecode train pard` writes one) for "
        "--method pard and auto (default: the embedded one, with the embedded target)",
    )
    p.add_argument(
        "--speculator",
        action="append",
        default=None,
        metavar="PATH",
        help="medusa / eagle / peagle heads folder (repeatable; default: <target>-medusa, "
        "<target>-eagle and <target>-peagle beside the target, when present)",
    )
    p.add_argument("--backend", default="native", choices=["native", "transformers"])
    p.add_argument(
        "--device", default=None, help="cpu or cuda (default: $LEAPDECODE_DEVICE, else cpu)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights' dtype (default auto: the checkpoint's own, from config.json)",
    )
    p.add_argument(
        "--draft-dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the draft's dtype (default: the same as --dtype)",
    )
    p.add_argument(
        "--quantize",
        default=None,
        choices=["int8", "int4"],
        help="weight-only quantization of the target's linear layers at load (native backend, "
        "with --dtype bfloat16 or float16): int8, a scale per output channel; int4, groups of "
        "128 (the LM head keeps int8). Lossless against the quantized model's own output",
    )
    p.add_argument(
        "--draft-quantize",
        default=None,
        choices=["int8", "int4"],
        help="the same for the draft (default: none)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the target's decode and verify steps through torch.compile (native backend, "
        "full attention; about 1.3-1.5x faster steps on CPU): compiled at start-up, about a "
        "minute a graph the first time (up to seven), seconds once cached in "
        "~/.cache/leapdecode (default: off; docs/compiled_step.md)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="the longest sequence, prompt and output, in tokens; the KV caches are "
        "preallocated for it in every slot (default: the longest that fits --kv-cache-memory, "
        "a multiple of 256, at most the model's own context)",
    )
    p.add_argument(
        "--kv-cache-memory",
        default=None,
        metavar="SIZE",
        help="memory for the KV caches of every model together (target, draft, pard, eagle "
        "head), in bytes or as 4GiB, 512MiB, 6G (default: half of the memory free once the "
        "weights are loaded, MemAvailable in /proc/meminfo; on CUDA 80%% of the GPU's free "
        "memory)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: $LEAPDECODE_THREADS, else the cores the machine's "
        "load leaves free, at least 1; see the README)",
    )


def add_draftless_args(p: argparse.ArgumentParser) -> None:
    """Options of the tree methods (suffix, lookahead, ngram trees, eagle)."""
    g = p.add_argument_group("tree methods (suffix, lookahead, ngram trees, eagle)")
    g.add_argument(
        "--tree",
        action="store_true",
        help="ngram, suffix: verify several candidates as one tree of at most k "
        "nodes (default: one chain)",
    )
    g.add_argument(
        "--suffix-max-spec-factor",
        type=float,
        default=1.0,
        help="suffix: draft at most this x match length tokens (default 1.0)",
    )
    g.add_argument(
        "--suffix-min-token-prob",
        type=float,
        default=0.1,
        help="suffix: stop a path below this probability (default 0.1)",
    )
    g.add_argument(
        "--no-suffix-char-match",
        dest="suffix_char_match",
        action="store_false",
        help="suffix: match tokens only, not also the text's characters (which "
        "find the source again right after an edit; on by default, chains only)",
    )
    g.add_argument(
        "--suffix-max-tree-depth",
        type=int,
        default=24,
        help="suffix: longest substring counted (default 24)",
    )
    g.add_argument(
        "--suffix-max-cached-requests",
        type=int,
        default=10_000,
        help="suffix: earlier requests' outputs kept in the global tree (FIFO; "
        "0 = none; default 10000)",
    )
    g.add_argument("--lookahead-window", type=int, default=3, help="lookahead: W (default 3)")
    g.add_argument(
        "--lookahead-ngram-size", type=int, default=3, help="lookahead: N, 3 or more (default 3)"
    )
    g.add_argument(
        "--lookahead-max-candidates",
        type=int,
        default=3,
        help="lookahead: G, n-grams verified per step (default 3)",
    )
    g.add_argument(
        "--speculative-num-steps",
        type=int,
        default=4,
        help="eagle: depth of the draft tree grown per step (default 4)",
    )
    g.add_argument(
        "--speculative-eagle-topk",
        type=int,
        default=4,
        help="eagle: nodes kept per depth, each expanding as many children "
        "(default 4); --k is the tree's size after reranking",
    )
    g.add_argument(
        "--auto-methods",
        default=",".join(registry.auto_default()),
        help="auto: the methods it chooses from each step, of "
        f"{','.join(registry.auto_choices())} (default {','.join(registry.auto_default())}; "
        "the heads are opt-in: they need the target's hidden states every step)",
    )
    add_verify_arg(p)


def add_verify_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verify",
        default="auto",
        choices=list(VERIFY_RULES),
        help="how a draft model's sampled chains are verified: token by token, or as a block "
        "(Sun et al. 2024: never fewer drafts kept on average; chains only); auto (default): "
        "block where it applies, tokens elsewhere (greedy and deterministic drafts keep the "
        "same drafts either way)",
    )


def spec_options(args) -> dict:
    """SpecConfig fields from add_draftless_args' flags."""
    return dict(
        use_tree_spec=args.tree,
        suffix_decoding_max_spec_factor=args.suffix_max_spec_factor,
        suffix_decoding_min_token_prob=args.suffix_min_token_prob,
        suffix_decoding_char_match=args.suffix_char_match,
        lookahead_window=args.lookahead_window,
        lookahead_ngram_size=args.lookahead_ngram_size,
        lookahead_max_candidates=args.lookahead_max_candidates,
        speculative_num_steps=args.speculative_num_steps,
        speculative_eagle_topk=args.speculative_eagle_topk,
        auto_methods=args.auto_methods,
        verify=args.verify,
    )


def engine_options(args) -> dict:
    return dict(
        suffix_decoding_max_tree_depth=args.suffix_max_tree_depth,
        suffix_decoding_max_cached_requests=args.suffix_max_cached_requests,
    )


def pard_option(args) -> str | None:
    """--pard, or the embedded parallel draft where it can run and may be asked for: with the
    embedded target, no --draft of the user's (a parallel draft given as --draft runs pard
    itself), and a command that may use it (generate --method pard or auto over it; demo
    --methods with it; serve and bench, whose requests and rows may)."""
    if args.pard is not None or args.draft is not None:
        return args.pard

    def named(listed: str | None) -> bool:  # "pard" in a comma-separated flag
        return "pard" in {m.strip() for m in (listed or "").split(",")}

    command = getattr(args, "command", None)
    if command == "generate":
        if args.method != "pard" and not (args.method == "auto" and named(args.auto_methods)):
            return None
    elif command == "demo" and not named(args.methods):
        return None
    return resolve_pard(args.target, None)


def load_options(args) -> dict:
    """`LeapDecoder.from_pretrained`'s options from the model flags (add_model_args) and,
    where the command has them, --draft-vocab and the engine's (--suffix-max-*)."""
    out = dict(
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        quantize=args.quantize,
        draft_quantize=args.draft_quantize,
        threads=args.threads,
        speculators=args.speculator,
        compile=args.compile,
        pard=pard_option(args),
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
    )
    if hasattr(args, "draft_vocab"):
        out["draft_vocab"] = args.draft_vocab
    if hasattr(args, "draft_context"):
        out["draft_context"] = args.draft_context
    if hasattr(args, "suffix_max_tree_depth"):
        out.update(engine_options(args))
    return out


def add_draft_context_arg(p: argparse.ArgumentParser) -> None:
    from .config import DRAFT_CONTEXT as CONTEXT

    p.add_argument(
        "--draft-context",
        type=int,
        default=CONTEXT,
        metavar="N",
        help="draft: the most tokens of a sequence the draft model is fed at once, its first "
        f"tokens and the latest (a long prompt's draft prefill stays short; default {CONTEXT}; "
        "0 = all)",
    )


def add_generation_args(p: argparse.ArgumentParser, method_default: str) -> None:
    p.add_argument(
        "--method",
        default=method_default,
        choices=list(registry.names()),
        help=f"how to speculate (default {method_default}: plain decoding)",
    )
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram to match (ngram)")
    p.add_argument("--ngram-max", type=int, default=4, help="longest n-gram to match (ngram)")
    p.add_argument(
        "--draft-min-prob",
        type=float,
        default=0.0,
        help="draft: stop a step's drafting once the draft's own top probability falls below "
        "this (0 = always draft k)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="draft: propose only the N most frequent tokens (default: the draft folder's "
        "draft_vocab.json recommendation, if any; 0 = the whole vocabulary)",
    )
    add_draft_context_arg(p)
