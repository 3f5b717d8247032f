"""vLLM as a peer and as a host: our proposers behind vLLM's custom_class interface (unit
tests, no vLLM), and, in the vLLM environment, the interop tests: our exported EAGLE head
and our proposers served by vLLM give plain decoding's greedy tokens.

The interop tests need vLLM's CPU build in a virtual environment of its own
(`bash bench/vllm_env.sh`, or $LEAPDECODE_VLLM_PYTHON). Without it they are skipped with
that hint, unless $LEAPDECODE_REQUIRE_VLLM=1 (CI builds the environment and sets it), where
a missing environment fails them.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from leapdecode.config import SpecConfig
from leapdecode.errors import LeapDecodeError
from leapdecode.integrations import vllm as integ
from leapdecode.proposers.ngram import NgramIndex
from leapdecode.sequence import Sequence


def fake_config(k: int, max_len: int = 512, **spec) -> SimpleNamespace:
    """The attributes of vLLM's VllmConfig the custom proposers read."""
    model = SimpleNamespace(max_model_len=max_len, tokenizer=None, model="none",
                            get_vocab_size=lambda: 64)  # fmt: skip
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k, **spec),
                           model_config=model)  # fmt: skip


class Batch:
    """vLLM's input batch as the proposer sees it: token_ids_cpu [rows, max_len] and each
    row's committed length."""

    def __init__(self, rows: int, max_len: int = 512) -> None:
        self.ids = np.zeros((rows, max_len), dtype=np.int32)
        self.n = np.zeros(rows, dtype=np.int32)

    def put(self, row: int, tokens: list[int]) -> None:
        self.ids[row, : len(tokens)] = tokens
        self.n[row] = len(tokens)


def reference_ngram(tokens: list[int], k: int) -> list[int]:
    index = NgramIndex(2, 4)
    index.sync(tokens)
    return index.lookup(tokens, k)


def test_ngram_proposer_drafts_what_ours_would_as_rows_come_and_move():
    rng = np.random.default_rng(0)
    texts = [list(rng.integers(0, 12, 40)) for _ in range(3)]  # small vocab: many repeats
    prop = integ.NgramProposer(fake_config(k=5))
    batch = Batch(3)
    for step in range(30):
        # request i sits in row (i + step // 10) % 3: rows move as vLLM condenses its batch
        for i, t in enumerate(texts):
            batch.put((i + step // 10) % 3, t)
        order = [None] * 3
        for i in range(3):
            order[(i + step // 10) % 3] = i
        drafts = prop.propose([[1]] * 3, batch.n, batch.ids)
        for row, i in enumerate(order):
            assert drafts[row] == reference_ngram(texts[i], 5), (step, row)
        for t in texts:  # each request commits one token more
            t.append(int(rng.integers(0, 12)))
    assert len(prop.rows.live) == 3  # moved rows were recognised, not taken for new requests


def test_rows_tell_requests_apart_and_forget_finished_ones():
    rows = integ.Rows(SpecConfig(method="ngram"), 512)
    a, new_a = rows.sync(0, np.array([1, 2, 3, 4]), 1)
    b, new_b = rows.sync(1, np.array([1, 2, 3, 9]), 1)  # same head, another request
    rows.end_call()
    assert new_a and new_b and a is not b and a.prompt_len == 3
    a2, new = rows.sync(1, np.array([1, 2, 3, 4, 5]), 1)  # a, moved to row 1
    assert a2 is a and not new and a.tokens == [1, 2, 3, 4, 5]
    twin, new = rows.sync(0, np.array([1, 2, 3, 4, 5]), 1)  # an identical twin: its own
    assert new and twin is not a
    gone = []
    for _ in range(integ.GRACE + 1):
        gone += rows.end_call()
    assert {s.id for s in gone} == {a.id, b.id, twin.id} and not rows.live


def test_suffix_proposer_copies_the_text_and_rows_without_tokens_get_no_draft():
    prop = integ.SuffixProposer(fake_config(k=8, suffix_decoding_max_tree_depth=24,
                                            suffix_decoding_max_cached_requests=0,
                                            suffix_decoding_max_spec_factor=1.0,
                                            suffix_decoding_min_token_prob=0.1))  # fmt: skip
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 3 + [5, 6, 7, 8]
    batch = Batch(2)
    batch.put(0, text)
    batch.put(1, [1, 2, 3])
    drafts = prop.propose([[8], []], batch.n, batch.ids)  # row 1: no token sampled this step
    assert drafts[0] == [9, 10, 11, 12, 13, 14, 5, 6] and drafts[1] == []


def test_drafts_stop_at_the_model_length():
    prop = integ.NgramProposer(fake_config(k=8, max_len=34))
    batch = Batch(1, 34)
    batch.put(0, [1, 2, 3, 4] * 8)  # 32 tokens: room for 2 more
    assert prop.propose([[4]], batch.n, batch.ids) == [[1, 2]]


@pytest.mark.parametrize(
    "config, says",
    [
        (SimpleNamespace(speculative_config=None, model_config=None), "num_speculative_tokens"),
        (fake_config(k=65), "num_speculative_tokens must be in 1..64"),
        (fake_config(k=4, suffix_decoding_max_tree_depth=0), "max_tree_depth must be >= 1"),
    ],
)
def test_a_wrong_configuration_is_one_clear_error(config, says):
    with pytest.raises(LeapDecodeError, match=says):
        integ.SuffixProposer(config)


def test_ngram_sizes_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("LEAPDECODE_PROMPT_LOOKUP_MIN", "3")
    monkeypatch.setenv("LEAPDECODE_PROMPT_LOOKUP_MAX", "5")
    assert integ.NgramProposer(fake_config(k=4)).spec.prompt_lookup_max == 5
    monkeypatch.setenv("LEAPDECODE_PROMPT_LOOKUP_MAX", "x")
    with pytest.raises(LeapDecodeError, match="LEAPDECODE_PROMPT_LOOKUP_MAX must be an integer"):
        integ.NgramProposer(fake_config(k=4))
    monkeypatch.setenv("LEAPDECODE_PROMPT_LOOKUP_MAX", "2")
    with pytest.raises(LeapDecodeError, match="n-gram sizes"):
        integ.NgramProposer(fake_config(k=4))


def test_a_missing_vllm_python_is_a_clear_error(tmp_path, monkeypatch):
    from leapdecode.bench.vllm_peer import find_python

    monkeypatch.setenv("LEAPDECODE_VLLM_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(LeapDecodeError, match="bench/vllm_env.sh"):
        find_python(None)


def test_vllm_workers_preload_what_its_cpu_guide_asks_unless_told_otherwise(tmp_path, monkeypatch):
    """tcmalloc (where the system has it) and the environment's own libiomp5 go in
    LD_PRELOAD; a user's LD_PRELOAD is kept as it is."""
    from leapdecode.bench import vllm_peer

    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text("")
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.write_text("")
    monkeypatch.setattr(vllm_peer, "TCMALLOC", ("/nowhere/libtcmalloc.so", str(tcmalloc)))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    env = vllm_peer.worker_env(1, python=str(python))
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{tmp_path / 'lib' / 'libiomp5.so'}"
    assert env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("LD_PRELOAD", "/mine.so")
    assert vllm_peer.worker_env(1, python=str(python))["LD_PRELOAD"] == "/mine.so"
    # an engine of the A/B turns it off with its own empty value
    assert vllm_peer.worker_env(1, {"LD_PRELOAD": ""}, str(python))["LD_PRELOAD"] == ""


def test_the_kv_cache_fits_the_model_length_target_and_draft(tmp_path):
    """vLLM refuses to start when one request of max_model_len tokens does not fit its KV
    cache (Qwen2.5-0.5B at 28,672 tokens needs 0.33 GiB): the cache is sized from config.json,
    the draft model's added, a head's (no such config) not."""
    from leapdecode.bench.vllm_peer import KV_CACHE_BYTES, kv_cache_bytes

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({
        "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896,
        "num_hidden_layers": 24}))  # fmt: skip
    need = 24 * 2 * 2 * 64 * 2 * 28672  # bytes: layers, k and v, KV heads, head size, bf16
    assert need > KV_CACHE_BYTES
    assert kv_cache_bytes([str(qwen)], "bfloat16", 28672) == need * 5 // 4
    assert kv_cache_bytes([str(qwen), str(qwen)], "float32", 28672) == 4 * need * 5 // 4
    assert kv_cache_bytes([str(qwen), str(tmp_path), None], "bfloat16", 512) == KV_CACHE_BYTES


def test_sequence_is_what_the_proposers_take():
    """The adapter builds leapdecode Sequences: the fields the proposers read are there."""
    rows = integ.Rows(SpecConfig(method="suffix"), 64)
    seq, _ = rows.sync(0, np.array([3, 4, 5]), 1)
    assert isinstance(seq, Sequence) and seq.spec.method == "suffix" and seq.prompt_len == 2


# --- in vLLM (its own environment) -----------------------------------------------------------


# The engines of these tests run eager and in one process each (no engine-core and worker
# processes beside it: a third less CPU time a load). The bench runs vLLM's default layout
# (docs/bench/real/ and the bench's vLLM rows)
ONE_PROCESS = dict(
    engine_args={"enforce_eager": True, "distributed_executor_backend": "uni"},
    env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
)
PARALLEL = dict(ONE_PROCESS, parallel=True)  # small engines: all loaded at once


def _vllm_python() -> str:
    from leapdecode.bench.vllm_peer import HINT, find_python

    python = find_python(None)
    if python is None:
        if os.environ.get("LEAPDECODE_REQUIRE_VLLM") == "1":
            pytest.fail(f"no vLLM environment: {HINT}")
        pytest.skip(f"no vLLM environment: {HINT}")
    return python


@pytest.fixture(scope="module")
def embedded():
    from leapdecode.paths import TARGET_NAME, default_model

    target = default_model(TARGET_NAME)
    head = target + "-eagle" if target else None
    if target is None or not os.path.isdir(head):
        pytest.skip("the embedded target and its EAGLE head are not in models/")
    return target, head


@pytest.fixture(scope="module")
def prompts(embedded):
    """Two prompts of each bench category, tokenised."""
    from transformers import AutoTokenizer

    from leapdecode.bench import workloads
    from leapdecode.bench.command import PROMPTS

    tok = AutoTokenizer.from_pretrained(embedded[0])
    sets = workloads.load(PROMPTS)
    return [tok.encode(r["prompt"]) for rows in sets.values() for r in rows[:2]]


@pytest.fixture(scope="module")
def vllm_engines(embedded, tmp_path_factory):
    """vLLM plain, eagle3 with our exported head, our two proposers, our parallel draft and
    our parallel EAGLE head, one engine each, all loaded at once (eager: these tests are about
    the tokens, the bench measures the compiled engines)."""
    from leapdecode.bench.vllm_peer import VllmPeers, spec_config
    from leapdecode.paths import default_model
    from leapdecode.speculators_export import export_speculators

    python = _vllm_python()
    target, head = embedded
    out = tmp_path_factory.mktemp("vllm")
    eagle3 = str(out / "eagle3")
    export_speculators(head, target, eagle3, verifier=target, dtype="float32")
    configs = [("vllm", None), ("eagle3", spec_config("vllm-eagle3", 3, eagle3=eagle3)),
               ("leap-suffix", spec_config("vllm-leap-suffix", 16)),
               ("leap-ngram", spec_config("vllm-leap-ngram", 8))]  # fmt: skip
    # models/leap-code-draft-pard: config.json names its pard_token
    pard = default_model("leap-code-draft-pard")
    if pard is not None:
        configs.append(("pard", spec_config("vllm-pard", 4, draft=pard)))
    if os.path.isdir(target + "-peagle"):  # exported as speculators' "peagle"
        peagle = str(out / "peagle")
        export_speculators(target + "-peagle", target, peagle, verifier=target, dtype="float32")
        configs.append(("peagle", spec_config("vllm-peagle", 4, peagle=peagle)))
    peers = VllmPeers(python, target, configs, "float32", 1024, 1, str(out / "logs"),
                      warm_up=0, **PARALLEL)  # fmt: skip
    yield peers
    peers.close()


@pytest.mark.parametrize("label", ["eagle3", "leap-suffix", "leap-ngram"])
def test_vllm_with_our_speculator_gives_plain_decodings_greedy_tokens(vllm_engines, prompts, label):
    _assert_plain_tokens_and_drafts_used(vllm_engines, label, prompts)


def test_vllm_plain_decoding_is_the_targets_own(vllm_engines, prompts, embedded):
    """vLLM's plain greedy tokens are transformers' on the same checkpoint (the reference
    for what the target says), ties at the dtype's resolution excepted."""
    import torch
    from transformers import AutoModelForCausalLM

    from leapdecode.bench.lossless import first_difference, tie_tolerance

    model = AutoModelForCausalLM.from_pretrained(embedded[0], dtype=torch.float32).eval()
    for ids in prompts:
        _, got, *_ = vllm_engines.generate("vllm", ids, 48)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 temperature=None, top_p=None, top_k=None)[0, len(ids):].tolist()  # fmt: skip
        pos = first_difference(got, ref)
        if pos is None:
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([ids + ref[:pos]])).logits[0, -1]
        top = torch.topk(logits, 2).values
        assert float(top[0] - top[1]) <= tie_tolerance(float(top[0]), torch.float32), (pos, ids[:8])


def test_a_wrong_vllm_configuration_is_one_clear_error(embedded, tmp_path):
    from leapdecode.bench.vllm_peer import VllmPeers, spec_config

    python = _vllm_python()
    bad = spec_config("vllm-leap-suffix", 8, extra={"suffix_decoding_max_tree_depth": 0})
    with pytest.raises(LeapDecodeError) as e:
        VllmPeers(python, embedded[0], [("bad", bad)], "float32", 1024, 1, str(tmp_path),
                  warm_up=0, **PARALLEL)  # fmt: skip
    assert "suffix_decoding_max_tree_depth" in str(e.value)


def test_spec_configs_are_vllms_names():
    from leapdecode.bench.vllm_peer import spec_config

    assert spec_config("vllm", 4) is None
    assert spec_config("vllm-ngram", 8, lookup=(2, 4)) == {
        "num_speculative_tokens": 8, "method": "ngram", "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}  # fmt: skip
    assert json.dumps(spec_config("vllm-leap-suffix", 16)).count("custom_class") == 1
    with pytest.raises(LeapDecodeError, match="needs a draft model"):
        spec_config("vllm-draft", 2)


def test_demo_adds_vllms_rows_when_its_environment_is_there(capsys, embedded, monkeypatch):
    """The README's demo with vLLM's counterparts beside ours, each with plain decoding's
    output (vLLM's engines eager here: the rows and their tokens are the point, not its
    speed, and a compiled engine takes a minute or more to start)."""
    from leapdecode.bench import vllm_peer
    from leapdecode.cli import main

    for key, value in ONE_PROCESS["engine_args"].items():
        monkeypatch.setitem(vllm_peer.ENGINE_ARGS, key, value)
    for key, value in ONE_PROCESS["env"].items():
        monkeypatch.setenv(key, value)

    python = _vllm_python()
    code = main(["demo", "--target", embedded[0], "--methods", "ngram", "--max-new-tokens", "24",
                 "--repeats", "1", "--vllm-python", python])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") == 8}
    assert set(rows) == {"none", "ngram", "vllm", "vllm-ngram"}, out
    assert all(line.split("│")[7].strip() == "yes" for line in rows.values()), out


def test_the_dynamic_schedule_is_our_static_table_as_vllms_ranges():
    from leapdecode.bench.serve import STATIC_TABLE
    from leapdecode.bench.vllm_serve import dynamic_schedule

    assert dynamic_schedule(STATIC_TABLE, 16) == [[1, 1, 4], [2, 3, 3], [4, 7, 2], [8, 15, 1],
                                                  [16, 16, 0]]  # fmt: skip
    assert dynamic_schedule(STATIC_TABLE, 32)[-1] == [16, 32, 0]


def test_vllm_serve_gets_the_context_and_a_cache_for_every_slot(monkeypatch, tmp_path):
    """`bench serve --peer vllm` bounds vLLM's context (unbounded, it takes the model's own,
    32k for Qwen2.5, and refuses to start when its cache cannot hold one such request) and
    sizes its cache for its slots."""
    from leapdecode.bench import vllm_serve

    cfg = {"num_attention_heads": 12, "num_key_value_heads": 2, "hidden_size": 1536,
           "num_hidden_layers": 28}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    seen = {}

    class Stop(Exception):
        pass

    def popen(cmd, **kw):
        seen["cmd"] = cmd
        raise Stop

    monkeypatch.setattr(vllm_serve.subprocess, "Popen", popen)
    with pytest.raises(Stop):
        with vllm_serve.vllm_server("python", str(tmp_path), None, "bfloat16", 8, 1, 4096,
                                    str(tmp_path / "log")):  # fmt: skip
            pass
    cmd = seen["cmd"]
    assert cmd[cmd.index("--max-model-len") + 1] == "4096"
    kv = int(cmd[cmd.index("--kv-cache-memory-bytes") + 1])
    per_token = 28 * 2 * 2 * 128 * 2  # layers x k,v x KV heads x head size x bfloat16
    assert kv >= 8 * 2048 * per_token  # 8 slots, half the context each


def test_vllm_runs_our_parallel_draft_as_its_own_parallel_drafting(vllm_engines, prompts):
    """Our trained parallel draft (models/leap-code-draft-pard) loads in vLLM as `draft_model`
    with `parallel_drafting`, and gives plain decoding's greedy tokens."""
    if "pard" not in vllm_engines.workers:
        pytest.skip("the embedded parallel draft is not in models/ (leapdecode train pard)")
    _assert_plain_tokens_and_drafts_used(vllm_engines, "pard", prompts)


def test_vllm_runs_our_parallel_eagle_head_as_peagle(vllm_engines, prompts):
    """Our parallel EAGLE head (models/leap-code-target-peagle), exported as speculators'
    "peagle", runs in vLLM as eagle3 with parallel_drafting: plain decoding's greedy tokens,
    drafts accepted."""
    if "peagle" not in vllm_engines.workers:
        pytest.skip("the embedded parallel EAGLE head is not in models/ (leapdecode train peagle)")
    _assert_plain_tokens_and_drafts_used(vllm_engines, "peagle", prompts)


def _assert_plain_tokens_and_drafts_used(peers, label: str, prompts) -> None:
    """vLLM's configuration `label` gives its plain decoding's greedy tokens on every prompt,
    and keeps some drafts (they were used, not merely proposed)."""
    accepted = 0
    for ids in prompts:
        _, plain, *_ = peers.generate("vllm", ids, 48)
        _, spec, _, _, acc = peers.generate(label, ids, 48)
        assert spec == plain, (label, ids[:8])
        accepted += acc
    assert accepted > 0
