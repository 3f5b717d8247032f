"""`leapdecode serve`, started for real on a free loopback port, driven with the official
`openai` client and with raw HTTP."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from leapdecode.bench.serve import tree_rss_kb

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://{HOST}:{self.port}"
        env = {**os.environ, "LEAPDECODE_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "leapdecode", "serve", "--host", HOST, "--port", str(self.port),
             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise RuntimeError("server did not start within 300 s")

    def rss_kb(self) -> int:
        return tree_rss_kb(self.proc.pid)  # the HTTP process and the engine process

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server(target_dir, draft_dir):
    s = Server("--target", target_dir, "--draft", draft_dir, "--speculation", "auto",
               "--max-num-seqs", "8", "--served-model-name", "tiny")  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


PROMPT = "def wrap(text, width):\n    return"


def test_completion_with_the_openai_client(client, decoder):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    want = decoder.generate(PROMPT, max_new_tokens=12)  # the same checkpoint, greedy
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.completion_tokens == len(want.token_ids)
    assert out.usage.prompt_tokens == len(decoder.encode(PROMPT))
    assert out.model == "tiny" and out.id.startswith("cmpl-")


def test_token_prompt_and_per_request_speculation(client, decoder):
    ids = decoder.encode(PROMPT)
    for method in ("none", "draft", "ngram", "auto"):
        out = client.completions.create(
            model="tiny", prompt=ids, max_tokens=10, temperature=0,
            extra_body={"speculation": {"method": method, "num_speculative_tokens": 3}},
        )  # fmt: skip
        assert out.choices[0].text == decoder.generate(ids, max_new_tokens=10).text
        assert out.model_extra["speculation"]["method"] == method
        assert out.model_extra["speculation"]["num_speculative_tokens"] == (method != "none") * 3
    for spec in ({"method": "ngram", "use_tree_spec": True, "prompt_lookup_min": 1},
                 {"method": "suffix", "use_tree_spec": True, "suffix_decoding_min_token_prob": 0},
                 {"method": "lookahead", "lookahead_window": 2, "lookahead_max_candidates": 2,
                  "num_speculative_tokens": 12}):  # fmt: skip
        out = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                                        extra_body={"speculation": spec})  # fmt: skip
        assert out.choices[0].text == decoder.generate(ids, max_new_tokens=10).text
        assert out.model_extra["speculation"]["method"] == spec["method"]
    for verify in ("token", "block"):  # a seeded sampled request repeats under either rule
        spec = {"method": "draft", "num_speculative_tokens": 3, "verify": verify}
        out = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0.8,
                                        seed=5, extra_body={"speculation": spec})  # fmt: skip
        again = decoder.generate(ids, max_new_tokens=10, temperature=0.8, seed=5, method="draft",
                                 k=3, verify=verify)  # fmt: skip
        assert out.choices[0].text == again.text


def test_streaming_joins_to_the_full_text_and_ends_with_done(server, client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    pieces = []
    with httpx.stream("POST", server.url + "/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stream": True,
    }, timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    pieces = [c["choices"][0]["text"] for c in chunks]
    assert "".join(pieces) == full.choices[0].text
    assert chunks[-1]["usage"]["completion_tokens"] == full.usage.completion_tokens
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    # the openai client's own stream reader
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True))  # fmt: skip
    assert text == full.choices[0].text


def test_chat_is_refused_for_a_model_without_a_chat_template(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400
    assert e.value.body["code"] == "no_chat_template"
    assert "chat template" in e.value.body["message"]


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("leapdecode:requests", "leapdecode:generation_tokens",
                 "leapdecode:spec_decode_num_draft_tokens", "leapdecode:time_to_first_token_seconds",
                 "leapdecode:inter_token_latency_seconds", "leapdecode:step_seconds",
                 "leapdecode:spec_decode_k", "leapdecode:num_requests_running",
                 "leapdecode:spec_decode_acceptance_rate"):  # fmt: skip
        assert name in families, name
    done = [s for s in families["leapdecode:requests"].samples if s.name.endswith("_total")]
    assert sum(s.value for s in done) >= 1


def test_concurrent_requests_match_the_single_run(server, decoder):
    prompts = [f"def f{i}(x):\n    return x +" for i in range(12)]
    want = [decoder.generate(p, max_new_tokens=16).text for p in prompts]
    got = [None] * len(prompts)

    def one(i):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        got[i] = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=16,
                                      temperature=0).choices[0].text  # fmt: skip

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_seeded_sampling_is_reproducible(client):
    """Under auto (the server's default) too, whatever the global suffix tree and the
    acceptance estimates hold by then: a seeded sampled request gets plain sampling's tokens."""
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    none = client.completions.create(**kw, extra_body={"speculation": {"method": "none"}})
    assert a == b == none.choices[0].text


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"max_tokens": 5}).encode(), 400, "prompt"),
    (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    (json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": "ten"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": 100000}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "x", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "x", "top_p": 1.5}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "x", "n": 2}).encode(), 400, "n"),
    (json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"prompt": "x", "stop": [""]}).encode(), 400, "stop"),
    (json.dumps({"prompt": "x", "seed": 10**23}).encode(), 400, "seed"),  # past torch's range
    (json.dumps({"prompt": "x", "seed": 2**64, "stream": True}).encode(), 400, "seed"),
    (json.dumps({"prompt": "x", "speculation": {"method": "magic"}}).encode(), 400,
     "speculation.method"),
    (json.dumps({"prompt": "x", "speculation": {"num_speculative_tokens": 99}}).encode(), 400,
     "num_speculative_tokens"),
    (json.dumps({"prompt": "x", "speculation": {"window": 3}}).encode(), 400,
     "speculation.window"),
    (json.dumps({"prompt": "x", "speculation": {"method": "lookahead",
                                                "lookahead_ngram_size": 2}}).encode(), 400, None),
    (json.dumps({"prompt": "x", "speculation": {"verify": "blocks"}}).encode(), 400,
     "speculation.verify"),
    (json.dumps({"prompt": "x", "speculation": {"method": "ngram", "use_tree_spec": True,
                                                "verify": "block"}}).encode(), 400,
     "speculation.verify"),
    (json.dumps({"prompt": "word " * 400}).encode(), 400, "prompt"),
    (json.dumps({"prompt": [10**7]}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "x", "model": "gpt-9"}).encode(), 404, "model"),
    (json.dumps({"prompt": "x" * (2 << 20)}).encode(), 413, None),
]  # fmt: skip


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_input_is_a_clear_4xx_and_the_server_keeps_serving(server, client, body, status, param):
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert param in (err["param"] or ""), err
    assert "max_new_tokens" not in err["message"]  # fields named as the request names them
    ok = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.choices[0].text is not None


def test_a_body_over_the_limit_is_a_413_that_says_the_limit(server, client):
    """A 25 MB body (read away, so the client sees the answer), and one sent without its
    length (chunked): 413 with the OpenAI error body, naming the limit and what to do."""

    def chunks():
        for _ in range(3):
            yield b"x" * (1 << 20)

    for content in (b'{"prompt": "' + b"x" * (25 << 20) + b'"}', chunks()):
        r = httpx.post(server.url + "/v1/completions", content=content,
                       headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
        assert "limit of 1048576 bytes (1 MiB)" in err["message"]
        assert "shorter prompt" in err["message"]
    ok = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.choices[0].text is not None


def test_unknown_route_and_method_are_openai_style_errors(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_disconnect_mid_stream_frees_the_slot(server, client):
    with httpx.stream("POST", server.url + "/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0.8, "stream": True,
        "speculation": {"method": "none"},
    }, timeout=60) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    deadline = time.time() + 20
    while time.time() < deadline and httpx.get(server.url + "/health").json()["running"]:
        time.sleep(0.2)
    assert httpx.get(server.url + "/health").json()["running"] == 0
    text = httpx.get(server.url + "/metrics").text
    aborted = [s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "leapdecode:requests_total" and s.labels.get("status") == "abort"]  # fmt: skip
    assert aborted and aborted[0] >= 1
    ok = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_api_key_and_full_queue(target_dir):
    s = Server("--target", target_dir, "--speculation", "none", "--api-key", "sekret",
               "--max-num-seqs", "1", "--max-queue", "1")  # fmt: skip
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model=os.path.basename(target_dir), prompt="x",
                                     max_tokens=2).choices  # fmt: skip
        assert httpx.get(s.url + "/health").status_code == 200  # no key needed outside /v1

        codes = []

        def one():
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "def f():", "max_tokens": 150},
                           headers={"Authorization": "Bearer sekret"}, timeout=120)  # fmt: skip
            codes.append((r.status_code, r.headers.get("retry-after")))

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert any(c == 200 for c, _ in codes)
        assert any(c == 429 and ra for c, ra in codes), codes
    finally:
        s.stop()


def test_bench_serve_smoke(tmp_path, target_dir, draft_dir):
    """`leapdecode bench serve` end to end on the tiny pair: a table, JSON and plots."""
    from leapdecode.cli import main

    out, prompts = tmp_path / "serve", tmp_path / "prompts"
    prompts.mkdir()
    for cat in ("completion", "revision", "grounded", "free"):  # short: the tiny model's context
        rows = [{"id": f"{cat}-{i}", "prompt": f"def {cat}_{i}(x):\n    return", "max_new_tokens": 8}
                for i in range(2)]  # fmt: skip
        (prompts / f"{cat}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["bench", "serve", "--target", target_dir, "--draft", draft_dir, "--threads", "1",
                 "--prompts", str(prompts),
                 "--concurrency", "1,2", "--rounds", "1", "--requests-per-client", "1",
                 "--requests-min", "2", "--max-new-tokens", "4", "--draft-k", "2",
                 "--ngram-k", "4", "--out", str(out)])  # fmt: skip
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    labels = {c["config"] for c in data["cells"]}
    assert {"none", "auto", "draft k=2", "ngram k=4", "suffix k=16", "lookahead W3 N3 G3"} <= labels
    assert all(c["errors"] == 0 and c["throughput"] > 0 for c in data["cells"])
    assert (out / "throughput.png").exists() and "auto" in (out / "results.md").read_text()


def test_bench_serve_rounds_move_every_configuration_and_its_neighbours():
    """Drift must not favour a configuration: over the rounds each one runs in different
    slots after different neighbours (rotated, and reversed every other round)."""
    from leapdecode.bench.serve import round_order

    cfgs = list("abcdef")
    orders = [round_order(cfgs, r) for r in range(3)]
    assert all(sorted(o) == cfgs for o in orders)
    assert orders[1] == orders[0][::-1]  # a pair of rounds: A then A reversed
    for c in cfgs:
        assert o_sum(orders[:2], c) == len(cfgs) - 1  # the pair's mean slot is the middle
        assert len({o.index(c) for o in orders}) >= 2, (c, orders)
        before = {o[o.index(c) - 1] if o.index(c) else None for o in orders}
        assert len(before) >= 2, (c, orders)


def o_sum(orders, c):
    return sum(o.index(c) for o in orders)


def test_bench_soak_counts_hang_ups_and_completions(tmp_path, target_dir, draft_dir):
    """`leapdecode bench soak` on the tiny pair: exactly the asked share of clients hangs up,
    the server counts them as aborted, every other request completes well-formed."""
    from leapdecode.cli import main

    out, prompts = tmp_path / "soak", tmp_path / "prompts"
    prompts.mkdir()
    for cat in ("completion", "revision", "grounded", "free"):
        rows = [{"id": f"{cat}-{i}", "prompt": f"def {cat}_{i}(x):\n    return", "max_new_tokens": 8}
                for i in range(2)]  # fmt: skip
        (prompts / f"{cat}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["bench", "soak", "--target", target_dir, "--draft", draft_dir, "--threads", "1",
          "--prompts", str(prompts), "--requests", "20", "--clients", "4",
          "--max-new-tokens", "6", "--out", str(out)])  # fmt: skip
    report = (out / "soak.md").read_text()  # (the exit code also judges RSS: not asserted here)
    assert "| disconnected | 2 |" in report and "| ok | 18 |" in report, report
    assert "completed well-formed: 18 of the 18" in report, report
    # a hang-up the server notices only after the last token is not an abort: at most 2
    aborted = re.search(r"counted (\d+) aborted requests", report)
    assert aborted and int(aborted.group(1)) <= 2, report


def test_client_watch_notices_a_gone_client_while_events_keep_coming():
    """A non-streamed request whose client left must stop even if tokens keep arriving."""
    import asyncio

    from leapdecode.server.app import ClientWatch
    from leapdecode.server.worker import Event

    class GoneAfter:
        def __init__(self, t):
            self.t = time.monotonic() + t

        async def is_disconnected(self):
            return time.monotonic() > self.t

    async def run():
        events: asyncio.Queue = asyncio.Queue()

        async def produce():
            while True:
                events.put_nowait(Event([1], False))
                await asyncio.sleep(0.01)

        producer = asyncio.create_task(produce())
        watch = ClientWatch(GoneAfter(0.2), events, every=0.05)
        got = 0
        start = time.monotonic()
        while await watch.next() is not None:
            got += 1
            assert time.monotonic() - start < 5, "the gone client was never noticed"
        producer.cancel()
        return got

    assert asyncio.run(run()) > 5


def test_bench_serve_ratios_pair_the_rounds():
    """auto / best fixed and x none are medians of per-round ratios: a round whose prompts
    are slow for everyone does not move them."""
    from leapdecode.bench.serve import Config, summarize

    runs = {"none": [100, 200, 50], "ngram k=8": [200, 400, 100], "auto": [190, 380, 95]}
    cells = {(label, 1): [{"throughput": t, "ttft": [0.1], "itl": [0.01], "errors": [],
                           "mean_accepted_tokens": 1.0} for t in ts]
             for label, ts in runs.items()}  # fmt: skip
    cfgs = [Config(label, {}) for label in runs]
    out = {r["config"]: r for r in summarize(cells, cfgs, [1])}
    assert out["auto"]["best_fixed"] == "ngram k=8"
    assert out["auto"]["vs_best_fixed"] == pytest.approx(0.95)
    assert out["auto"]["vs_best_fixed_rounds"] == [0.95, 0.95, 0.95]
    assert out["ngram k=8"]["vs_none"] == pytest.approx(2.0)


def test_a_port_in_use_or_a_bad_host_is_one_clear_line_before_any_model_loads():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for args, needle in ((["--port", str(port)], "choose another --port"),
                             (["--host", "999.1.1.1"], "is not an address")):  # fmt: skip
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "leapdecode", "serve", *args,
                                  "--target", "/nonexistent"], capture_output=True, text=True,
                                 timeout=60)  # fmt: skip
            assert out.returncode == 2, out.stderr
            assert needle in out.stderr and "Traceback" not in out.stderr
            assert "serving" not in out.stdout  # it never claimed to serve
            assert time.perf_counter() - t0 < 30  # no model was loaded (the target is bogus)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_a_lost_engine_process_is_a_503_with_the_reason_and_a_clean_exit(target_dir):
    """The engine runs in a process of its own: if it dies (killed, out of memory), the HTTP
    side stays up and says why on every endpoint, and stopping the server ends both."""
    s = Server("--target", target_dir, "--speculation", "ngram", "--max-num-seqs", "2")
    try:
        engine = [p for p in _children(s.proc.pid)
                  if "spawn_main" in open(f"/proc/{p}/cmdline").read()]  # fmt: skip
        assert len(engine) == 1
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert ok.status_code == 200
        os.kill(engine[0], 9)
        deadline = time.time() + 10
        while time.time() < deadline and httpx.get(s.url + "/health").status_code == 200:
            time.sleep(0.1)
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and "exit code -9" in health.json()["error"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 503
        assert (
            r.json()["error"]["code"] == "engine_gone" and "restart" in r.json()["error"]["message"]
        )
        assert httpx.get(s.url + "/metrics").status_code == 503
    finally:
        s.stop()
    assert s.proc.returncode is not None
    assert "Traceback" not in s.proc.stdout.read()


def test_stopping_the_server_ends_its_engine_process(target_dir):
    s = Server("--target", target_dir, "--speculation", "none", "--max-num-seqs", "1")
    children = _children(s.proc.pid)
    s.stop()  # SIGTERM: uvicorn shuts down, then re-raises the signal (exit -15)
    assert s.proc.returncode in (0, -15)

    def running(pid: int) -> bool:  # a zombie waits for init to reap it: not running
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.time() + 10
    while time.time() < deadline and any(running(p) for p in children):
        time.sleep(0.2)
    assert not [p for p in children if running(p)]
    assert "Traceback" not in s.proc.stdout.read()


def test_a_server_that_did_not_start_is_explained_by_its_first_error(tmp_path):
    """The tail of a failed server's log leads with the error that caused it, however far up
    (vLLM's root cause sits above a long traceback that ends in a wrapper's error)."""
    from leapdecode.bench.servers import tail

    log = tmp_path / "vllm.log"
    frames = "".join(f'  File "engine.py", line {i}, in start\n    go()\n' for i in range(80))
    log.write_text(
        "WARNING ... can cause `OSError: [Errno 24] Too many open files`\n"
        "(EngineCore pid=1) ERROR [core.py] Traceback (most recent call last):\n"
        "ValueError: To serve at least one request with the model's max seq len (32768)\n"
        + frames
        + "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    got = tail(str(log))
    assert got.startswith("ValueError: To serve at least one request")
    assert got.rstrip().endswith("See root cause above.")
    short = tmp_path / "short.log"
    short.write_text("ValueError: bad\n")
    assert tail(str(short)) == "ValueError: bad\n"  # all of it in the tail: as it is
