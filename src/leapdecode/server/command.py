"""`leapdecode serve [--target PATH] [--draft PATH] [--host 127.0.0.1] [--port N] ...`."""

from __future__ import annotations

import errno
import os
from functools import partial

from ..cli_args import add_draft_context_arg, add_draftless_args, load_options, spec_options
from ..config import MAX_K, SpecConfig, parse_k_table
from ..errors import LeapDecodeError
from ..proposers import registry


def add_parser(sub, model_args) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together")
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait for a slot; more get 429 (default 64)",
    )
    p.add_argument(
        "--speculation",
        default="auto",
        choices=list(registry.names()),
        help="the default method (a request may override it; default auto)",
    )
    p.add_argument(
        "--k",
        type=int,
        default=4,
        help=f"draft tokens per step (auto: the most it may use; 0..{MAX_K})",
    )
    p.add_argument(
        "--k-per-batch-size",
        default=None,
        metavar="B:K,...",
        help="a static batch-size -> k table for fixed methods, e.g. 1:4,4:2,8:0",
    )
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="the draft proposes only its N most frequent tokens (0 = all)",
    )
    add_draft_context_arg(p)
    p.add_argument(
        "--api-key",
        default=os.environ.get("LEAPDECODE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (or $LEAPDECODE_API_KEY)",
    )
    p.add_argument("--served-model-name", default=None, help="model id (default: folder name)")
    add_draftless_args(p)


# The HTTP process's event loop and its reader thread (worker.py) share a GIL. With CPython's
# default 5 ms switch interval, the reader, woken by a step's tokens, may wait up to 5 ms
# while the loop runs Python: about a decode step on this CPU. (Measured when the engine
# itself ran in that thread, with `bench serve` at concurrency 1, two A/B pairs of 5 rounds:
# auto / ngram k=8 0.82 and 0.93 with the default, 1.01 and 1.04 with 0.5 ms.)
SWITCH_INTERVAL_S = 0.0005


def bind(host: str, port: int) -> list:
    """The listening sockets (one per address the host resolves to, as uvicorn binds them),
    bound and listening before the models load, so a port in use or a bad host is a one-line
    error at once (uvicorn would report it after the load, as its own log line), and a second
    server started meanwhile cannot claim the same port."""
    import socket

    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as e:
        raise LeapDecodeError(
            f"--host {host!r} is not an address this machine can bind "
            f"({e}): use an IP address such as 127.0.0.1 or 0.0.0.0"
        ) from None
    socks, seen = [], set()
    try:
        for family, kind, proto, _, addr in infos:
            if addr in seen:
                continue
            seen.add(addr)
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # its own address only; IPv4 gets its own socket
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(2048)  # uvicorn's backlog
    except OSError as e:
        for sock in socks:
            sock.close()
        hint = (
            "another process is listening there: choose another --port, or stop it"
            if e.errno == errno.EADDRINUSE
            else "choose another --host / --port"
        )
        where = f"[{host}]" if ":" in host else host
        raise LeapDecodeError(
            f"cannot listen on {where}:{port}: {e.strerror or e}: {hint}"
        ) from None
    return socks


def _configure(args) -> tuple[SpecConfig, dict]:
    """The server's checked flags: its default SpecConfig and what the engine process loads."""
    from ..paths import resolve_models  # the folders themselves: cmd_serve, once bound

    if not 0 < args.port < 65536:
        raise LeapDecodeError(f"--port must be in 1..65535, got {args.port}")
    if args.max_queue < 1:
        raise LeapDecodeError("--max-queue must be >= 1")
    if args.max_num_seqs < 1:
        raise LeapDecodeError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    table = parse_k_table(args.k_per_batch_size) if args.k_per_batch_size else ()
    spec = SpecConfig(
        method=args.speculation,
        num_speculative_tokens=args.k,
        prompt_lookup_min=args.ngram_min,
        prompt_lookup_max=args.ngram_max,
        num_speculative_tokens_per_batch_size=table,
        **spec_options(args),
    )
    target, draft = resolve_models(args.target, args.draft)
    if args.speculation == "draft" and draft is None:
        raise LeapDecodeError("--speculation draft needs a draft model: pass --draft PATH")
    load = dict(target=target, draft=draft, max_num_seqs=args.max_num_seqs, **load_options(args))
    return spec, load


def cmd_serve(args) -> int:
    import gc
    import sys

    import torch
    import uvicorn

    from ..frontend import Frontend, load_tokenizer
    from ..resolve import resolve_model
    from ..threads import resolve_threads
    from .app import Server, create_app
    from .worker import EngineClient

    spec, load = _configure(args)
    socks = bind(args.host, args.port)
    # the edge: a catalogue name, a .gguf file or a Hub id becomes a folder, for both processes
    load["target"] = target = resolve_model(load["target"], "target")
    if load["draft"] is not None:
        load["draft"] = resolve_model(load["draft"], "draft")
    resolve_threads(args.threads)  # a bad --threads is said here, not by the engine process
    torch.set_num_threads(1)  # the HTTP process runs no model
    name = args.served_model_name or os.path.basename(os.path.abspath(target))
    if spec.method == "auto":
        print(
            "leapdecode: loading, then profiling the step costs for auto (a few seconds)...",
            flush=True,
        )
    if args.compile:
        print(
            "leapdecode: compiling the target's forward (about a minute a graph the first "
            "time, seconds once cached)...",
            flush=True,
        )
    engine = EngineClient({"load": load, "spec": spec}, args.max_queue)
    try:
        info = engine.wait_ready()
    except BaseException:  # a load that failed, or Ctrl-C meanwhile
        engine.stop(wait_s=0)
        raise
    frontend = Frontend(
        load_tokenizer(target),
        info["eos_token_ids"],
        info["vocab_size"],
        info["max_context"],
        partial(registry.check, **info["capabilities"]),
    )
    app = create_app(engine, frontend, spec, name, args.api_key)
    where = f"[{args.host}]" if ":" in args.host else args.host or "0.0.0.0"
    print(
        f"leapdecode: serving {name!r} on http://{where}:{args.port}/v1 "
        f"(speculation {spec.method}, k {spec.num_speculative_tokens}, "
        f"{args.max_num_seqs} slots)",
        flush=True,
    )
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gc.collect()
    gc.freeze()
    server = Server(uvicorn.Config(app, log_level="warning"), engine)
    server.run(sockets=socks)
    return 0
