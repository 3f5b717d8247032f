"""llama.cpp as a peer: `llama-server`, built here by `bench/llamacpp_env.sh`, one server per
configuration (its speculation is set per server: this version ignores the per-request
`speculative.*` fields), driven through its HTTP `/completion` endpoint with the prompt as
token ids, timed from the request sent to the response read (prefill included, as ours).

Configurations (ours in brackets); every one at two precisions: `GGUF`, the catalogue's own
quantized file, what llama.cpp users run (the 1.5B's is Q4_K_M); `BF16`, a GGUF of the very
weights we run, made from the pulled folder with llama.cpp's `convert_hf_to_gguf.py`:
- `llamacpp`                  no speculation                                    [none]
- `llamacpp-draft k=K`        `--spec-type draft-simple -md DRAFT --spec-draft-n-max K`, its
                              other draft settings at their defaults (n-min 0, p-min 0)  [draft]
- `llamacpp-ngram k=K`        `--spec-type ngram-simple --spec-draft-n-max K`: the n-gram
                              map docs/speculative.md gives for rewriting code     [ngram]
- `llamacpp-ngram-mod k=64`   `--spec-default` (ngram-mod, n-match 24, n-min 48, n-max 64):
                              its default speculative configuration

Each request: greedy (temperature 0) or sampled at the run's temperature from its seed (top-k,
top-p and min-p off), `cache_prompt` off (ours has no prefix cache in `bench run`: every run
pays its prefill), the draft and target threads as ours. Target forwards are derived from its
timings: it reports the tokens predicted and the drafted tokens accepted, and every forward
after the prefill yields one token plus those accepted.

Between its requests a server is stopped (SIGSTOP), as the vLLM engines are (vllm_peer.py):
its thread pool polls for work after a request, which would take cores from the one timed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from ..cache import cache_dir
from ..errors import LeapDecodeError
from ..paths import REPO
from .servers import free_port
from .vllm_peer import pause, resume

ENV_VAR = "LEAPDECODE_LLAMACPP"
DEFAULT_DIR = os.path.join(REPO, ".llamacpp")
SETUP = "bash bench/llamacpp_env.sh"
HINT = (
    f"llama.cpp is built from the llama-cpp-python sdist's vendored source: `{SETUP}` builds "
    f"it in .llamacpp (about 15 minutes on two cores), or pass --llamacpp DIR (or set {ENV_VAR}) "
    "to a folder whose bin/ holds llama-server"
)
NAMES = ("llamacpp", "llamacpp-draft", "llamacpp-ngram", "llamacpp-ngram-mod")
COUNTERPART = {"none": "llamacpp", "draft": "llamacpp-draft", "ngram": "llamacpp-ngram"}
PRECISIONS = ("GGUF", "BF16")
WARM_UP = 3  # requests after loading: the first ones pay for lazy set-up
WARM_IDS = [(7 * i) % 500 + 1000 for i in range(100)]  # the warm-up's prompt
# configurations whose speculative state outlives a request (ngram-mod's n-gram table is kept
# across requests, reset only when a quarter full): a fresh server for each request
FRESH = {"llamacpp-ngram-mod"}
LOGS = os.path.join(os.path.expanduser("~"), ".cache", "leapdecode", "llamacpp")


def find_dir(flag: str | None) -> str | None:
    """The llama.cpp folder named by the flag or the environment, else the repository's
    .llamacpp when it was built; None when there is none. A folder named without a
    bin/llama-server is an error (a typo is not 'no llama.cpp')."""
    named = flag or os.environ.get(ENV_VAR)
    if named:
        if not os.access(os.path.join(named, "bin", "llama-server"), os.X_OK):
            src = "--llamacpp" if flag else f"${ENV_VAR}"
            raise LeapDecodeError(f"{src} {named!r} has no bin/llama-server: {HINT}")
        return named
    return DEFAULT_DIR if os.access(binary(DEFAULT_DIR), os.X_OK) else None


def binary(folder: str, name: str = "llama-server") -> str:
    return os.path.join(folder, "bin", name)


def version(folder: str) -> str:
    out = subprocess.run([binary(folder), "--version"], capture_output=True, text=True)
    text = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in text if line.startswith("version")), text[0] if text else "?")


def precisions(flag: str | None, models: list[str]) -> list[str]:
    """llama.cpp's precisions from --llamacpp-precision, checked before any model loads. GGUF
    runs each model's catalogue GGUF file, so without the flag it is left out (with a line
    saying so) for a model not pulled from the catalogue, and asked for, it is an error."""
    if flag is None:
        if all(catalogue_name(m) for m in models):
            return list(PRECISIONS)
        print("llama.cpp runs BF16 only: GGUF rows need models pulled from the catalogue")
        return ["BF16"]
    out = [p.strip().upper() for p in flag.split(",") if p.strip()]
    if not out or set(out) - set(PRECISIONS):
        raise LeapDecodeError(f"--llamacpp-precision takes {', '.join(PRECISIONS)}, not {flag!r}")
    odd = [m for m in models if "GGUF" in out and catalogue_name(m) is None]
    if odd:
        raise LeapDecodeError(
            f"llama.cpp's GGUF rows run a catalogue model's own GGUF file, and {odd[0]!r} was "
            "not pulled from the catalogue: pass --llamacpp-precision BF16"
        )
    return list(dict.fromkeys(out))


def catalogue_name(model: str) -> str | None:
    """The catalogue name a pulled folder came from (its pull marker), else None."""
    from ..resolve import MARKER

    marker = os.path.join(model, MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        return json.load(f).get("name")


def gguf_for(model: str, precision: str, folder: str, progress: bool = True) -> str:
    """The GGUF file llama.cpp runs for our model folder: its catalogue GGUF (quantized), or a
    BF16 GGUF of the folder's own weights (made once, cached beside the pulled files)."""
    name = catalogue_name(model)
    if precision == "GGUF":
        if name is None:
            raise LeapDecodeError(
                f"llama.cpp's GGUF rows run a catalogue model's own GGUF file, and {model!r} "
                "was not pulled from the catalogue: pass --llamacpp-precision BF16"
            )
        from ..pull import gguf_file

        return gguf_file(name, progress)
    if precision != "BF16":
        raise LeapDecodeError(f"--llamacpp-precision takes {', '.join(PRECISIONS)}")
    out = cache_dir("gguf", f"{name or _stamp(model)}.bf16.gguf")
    if not os.path.isfile(out):
        convert_to_gguf(model, out, folder, progress)
    return out


def _stamp(model: str) -> str:
    """A folder's identity by its weights' names, sizes and times (a retrained one differs)."""
    files = sorted(f for f in os.listdir(model) if f.endswith((".safetensors", ".json")))
    st = [(f, os.stat(os.path.join(model, f)).st_size, os.stat(os.path.join(model, f)).st_mtime_ns)
          for f in files]  # fmt: skip
    key = json.dumps([os.path.abspath(model), st])
    return (
        os.path.basename(os.path.normpath(model))
        + "-"
        + hashlib.sha256(key.encode()).hexdigest()[:12]
    )


def convert_to_gguf(model: str, out: str, folder: str, progress: bool = True) -> None:
    """llama.cpp's own converter (vendored with its source) on a Hugging Face folder."""
    src = os.path.join(folder, "src", "vendor", "llama.cpp")
    script = os.path.join(src, "convert_hf_to_gguf.py")
    if not os.path.isfile(script):
        raise LeapDecodeError(f"{script} not found: rebuild llama.cpp with `{SETUP}`")
    env = dict(os.environ, PYTHONPATH=os.path.join(src, "gguf-py"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    partial = out + ".partial"
    if progress:
        print(f"converting {model} to a BF16 GGUF for llama.cpp ({out})", flush=True)
    done = subprocess.run(
        [sys.executable, script, model, "--outtype", "bf16", "--outfile", partial],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        last = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise LeapDecodeError(
            f"llama.cpp's convert_hf_to_gguf.py failed on {model} (`pip install sentencepiece` "
            f"if it is missing; `bash bench/llamacpp_env.sh` installs it):\n{last}"
        )
    os.replace(partial, out)


def server_args(name: str, k: int, draft_gguf: str | None) -> list[str]:
    """llama-server's speculative flags for one configuration."""
    if name == "llamacpp":
        return []
    if name == "llamacpp-draft":
        if draft_gguf is None:
            raise LeapDecodeError("llamacpp-draft needs a draft model: pass --draft")
        return ["-md", draft_gguf, "--spec-type", "draft-simple", "--spec-draft-n-max", str(k)]
    if name == "llamacpp-ngram":
        return ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(k)]
    if name == "llamacpp-ngram-mod":
        return ["--spec-default"]
    raise LeapDecodeError(f"unknown llama.cpp configuration {name!r}: use {', '.join(NAMES)}")


class Server:
    """One llama-server process on a free local port; its log in `log_path`."""

    def __init__(self, folder: str, model: str, args: list[str], threads: int, context: int,
                 log_path: str, parallel: int = 1, log_mode: str = "w") -> None:  # fmt: skip
        self.start_args = (folder, model, args, threads, context, log_path, parallel)
        self.port = free_port()
        self.log_path = log_path
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        cmd = [binary(folder), "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-c", str(context * parallel),
               "--parallel", str(parallel), "--no-webui", *args]  # fmt: skip
        self.cmd = cmd
        with open(log_path, log_mode) as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            self._wait_ready()
        except BaseException:  # an interrupt too: nobody holds this server yet to close it
            self.close()
            raise

    def _wait_ready(self, timeout: float = 600) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise LeapDecodeError(
                    f"llama-server stopped while loading ({self._last_error()}); its log: "
                    f"{self.log_path}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise LeapDecodeError(f"llama-server was not ready in {timeout:.0f} s: {self.log_path}")

    def _last_error(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [ln.strip() for ln in f if ln.strip()]
        except OSError:
            return "no log"
        errs = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
        return (errs or lines or ["no log"])[-1]

    def complete(self, body: dict, timeout: float = 3600) -> dict:
        req = urllib.request.Request(
            self.url + "/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            raise LeapDecodeError(f"llama-server answered {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise LeapDecodeError(
                f"llama-server did not answer ({e}; {self._last_error()}): {self.log_path}"
            ) from None

    def idle(self) -> None:
        pause(self.proc.pid)

    def wake(self) -> None:
        resume(self.proc.pid)

    def restarted(self) -> Server:
        """The same server started again (its state gone), this one closed; its log goes on
        in the same file."""
        self.close()
        return Server(*self.start_args, log_mode="a")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.wake()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def request_body(ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> dict:  # fmt: skip
    """/completion's body: the prompt as token ids (no BOS added), greedy or plainly sampled."""
    body = {
        "prompt": list(ids),
        "n_predict": max_new_tokens,
        "cache_prompt": False,
        "return_tokens": True,
        "temperature": temperature,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
        "seed": seed,
    }
    return body


def result(reply: dict) -> tuple[list[int], int, int, int]:
    """(tokens, target forwards, drafted, accepted) from a /completion reply."""
    tokens = list(reply.get("tokens") or [])
    t = reply.get("timings") or {}
    drafted, accepted = int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0))
    return tokens, max(1, len(tokens) - accepted), drafted, accepted


class LlamaCppPeers:
    """The llama.cpp configurations of one bench run, each a server loaded once and kept:
    configs = [(label, name, k, precision)]."""

    def __init__(self, folder: str, target: str, draft: str | None, configs, threads: int,
                 context: int, log_dir: str = LOGS, warm_up: int = WARM_UP) -> None:  # fmt: skip
        from tqdm import tqdm

        self.version = version(folder)
        self.log_dir = log_dir
        self.servers: dict[str, Server] = {}
        self.names = {label: name for label, name, *_ in configs}
        self.load_s: dict[str, float] = {}
        self.files: dict[str, str] = {}
        precisions = sorted({c[3] for c in configs})
        for p in precisions:  # the GGUF files first: a conversion is minutes, a failure early
            self.files[f"target {p}"] = gguf_for(target, p, folder)
            if draft is not None and any(c[1] == "llamacpp-draft" for c in configs):
                self.files[f"draft {p}"] = gguf_for(draft, p, folder)
        try:
            for label, name, k, p in tqdm(configs, desc="loading llama.cpp servers", unit="server"):
                t0 = time.perf_counter()
                s = Server(
                    folder,
                    self.files[f"target {p}"],
                    server_args(name, k, self.files.get(f"draft {p}")),
                    threads,
                    context,
                    os.path.join(log_dir, label.replace(" ", "_").replace("=", "") + ".log"),
                )
                self.servers[label] = s
                self.load_s[label] = time.perf_counter() - t0
                for _ in range(warm_up):
                    s.complete(request_body(WARM_IDS, 32))
                s.idle()
        except BaseException:
            self.close()
            raise

    def generate(self, label: str, ids: list[int], max_new_tokens: int, temperature=0.0, seed=0):
        """(seconds, tokens, target forwards, drafted, accepted), timed around the request.
        A configuration whose state outlives a request (FRESH) gets a server started anew
        first, untimed: the bench repeats each prompt, and ngram-mod's n-gram table would
        hold the answer from the round before (as a global suffix tree would ours, which the
        bench keeps off)."""
        s = self.servers[label]
        if self.names[label] in FRESH:
            s = self.servers[label] = s.restarted()
            s.complete(request_body(WARM_IDS, 4))  # one-off costs (the mapped weights' pages)
        s.wake()
        try:
            body = request_body(ids, max_new_tokens, temperature, seed)
            t0 = time.perf_counter()
            reply = s.complete(body)
            secs = time.perf_counter() - t0
        finally:
            s.idle()
        tokens, forwards, drafted, accepted = result(reply)
        return secs, tokens, forwards, drafted, accepted

    def close(self) -> None:
        for s in self.servers.values():
            s.close()
