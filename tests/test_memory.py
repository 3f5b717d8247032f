"""Memory: the KV caches sized to max_model_len within a budget, the loader's one copy of the
weights, and the step-cost profile kept per model and machine."""

import json
import os

import pytest
import torch

from helpers import make_llama
from leapdecode import LeapDecoder
from leapdecode.config import MAX_K
from leapdecode.engine import cost_model
from leapdecode.engine.cost_model import CostModel
from leapdecode.errors import LeapDecodeError
from leapdecode.memory import parse_size, plan_length
from leapdecode.models.kv_cache import zeros
from leapdecode.models.llama import SafetensorsReader, read_safetensors
from leapdecode.models.ops import dense

TOY_TOKEN = 2 * 2 * 2 * 16 * 4  # k and v x 2 layers x 2 KV heads x 16 dims x float32


@pytest.mark.parametrize(
    "text,size",
    [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("6G", 6 * 10**9), ("1.5GB", 1_500_000_000),
     ("1000", 1000), (2048, 2048), (" 2 kib ", 2048), ("3e3", 3000)],
)  # fmt: skip
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "GiB", "4 parsecs", "-1G", "0", 0, "1/2G", True])
def test_bad_sizes_name_the_field(bad):
    with pytest.raises(LeapDecodeError) as e:
        parse_size(bad)
    assert e.value.field == "kv_cache_memory"


def test_plan_length_defaults_refusals_and_rounding():
    per = {"target": 1000, "draft": 500}  # bytes a token
    extra = MAX_K + 1
    # everything fits: the model's own maximum
    assert plan_length(4096, per, 4, extra, None, 10**9) == 4096
    # a budget of 3000 positions a slot: rounded down to a multiple of 256
    budget = 4 * 1500 * (3000 + extra)
    assert plan_length(32768, per, 4, extra, None, budget) == 2816
    # asked for: that, if it fits; past the model's own: the model's
    assert plan_length(32768, per, 4, extra, 3000, budget) == 3000
    assert plan_length(2048, per, 4, extra, 4000, budget) == 2048
    with pytest.raises(LeapDecodeError) as e:
        plan_length(32768, per, 4, extra, 3001, budget)
    msg = str(e.value)
    assert e.value.field == "max_model_len"
    for needle in ("max_model_len 3001", "4 slots", "target 1,000 + draft 500 bytes a token",
                   "kv_cache_memory", "max_num_seqs", "at most 3000 fits"):  # fmt: skip
        assert needle in msg, msg
    # the default cannot reach even 512 positions: refused, naming the budget
    with pytest.raises(LeapDecodeError, match="does not fit even a context of 512") as e:
        plan_length(32768, per, 4, extra, None, 4 * 1500 * 500, "the default")
    assert e.value.field == "kv_cache_memory" and "max_num_seqs" in str(e.value)
    with pytest.raises(LeapDecodeError, match="integer >= 2"):
        plan_length(32768, per, 4, extra, 1.5, budget)


def test_engine_context_is_max_model_len_everywhere(target_dir, draft_dir):
    dec = LeapDecoder.from_pretrained(target_dir, draft=draft_dir, max_model_len=100)
    engine = dec.engine
    assert engine.max_model_len == 100 and engine.max_len == 100 + MAX_K + 1
    assert dec.target.max_context == dec.draft.max_context == dec.frontend.max_context == 100
    assert dec.target.model_max_context == 256
    engine.allocate()
    assert dec.target.cache.max_len == dec.draft.cache.max_len == 100 + MAX_K + 1
    out = dec.generate([5] * 90, method="draft", k=4, max_new_tokens=10)
    assert len(out.token_ids) <= 10
    with pytest.raises(LeapDecodeError, match=r"max_model_len\) is 100") as e:
        dec.generate([5] * 100, max_new_tokens=1)
    assert e.value.field == "prompt"
    with pytest.raises(LeapDecodeError, match="does not fit") as e:
        dec.generate([5] * 90, max_new_tokens=20)
    # past the model's own context: the model's
    assert LeapDecoder.from_pretrained(target_dir, max_model_len=10**6).target.max_context == 256


def test_the_budget_counts_every_cache(target_dir, draft_dir):
    """1 MiB holds 1 MiB / (16 slots x 512 bytes) = 128 positions a slot of the target alone,
    less MAX_K + 1 for the drafts: 63 tokens; with the draft's cache beside it, half."""
    dec = LeapDecoder.from_pretrained(target_dir, kv_cache_memory="1MiB", max_model_len=63)
    assert dec.engine.max_model_len == 63
    with pytest.raises(LeapDecodeError) as e:
        LeapDecoder.from_pretrained(target_dir, draft=draft_dir, kv_cache_memory="1MiB",
                                    max_model_len=63)  # fmt: skip
    assert e.value.field == "max_model_len"
    assert f"16 slots x target {TOY_TOKEN} + draft {TOY_TOKEN} bytes a token" in str(e.value)
    assert "1.00 MiB" in str(e.value)
    # the default asks for the model's context (256) at least: refused, with what to change
    with pytest.raises(LeapDecodeError, match="does not fit even a context of 256") as e:
        LeapDecoder.from_pretrained(target_dir, kv_cache_memory="1MiB")
    assert e.value.field == "kv_cache_memory"
    # fewer slots: it fits
    dec = LeapDecoder.from_pretrained(target_dir, kv_cache_memory="1MiB", max_num_seqs=4)
    assert dec.engine.max_model_len == 256


def test_cli_flags_reach_the_engine(target_dir):
    from leapdecode.cli import build_parser
    from leapdecode.cli_args import load_options

    for command in ("generate", "demo", "serve"):
        args = build_parser().parse_args(
            [command, "--target", target_dir, "--max-model-len", "64", "--kv-cache-memory",
             "1GiB"] + (["x"] if command == "generate" else [])
        )  # fmt: skip
        options = load_options(args)
        assert options["max_model_len"] == 64 and options["kv_cache_memory"] == "1GiB"


def test_cli_refusal_names_the_numbers(capsys, target_dir):
    from leapdecode.cli import main

    code = main(["generate", "--target", target_dir, "--kv-cache-memory", "1MiB",
                 "--max-model-len", "200", "x"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "does not fit" in err and "1.00 MiB" in err and "16 slots" in err
    assert len(err.strip().splitlines()) == 1


def test_large_cpu_caches_take_memory_as_they_are_written():
    def rss() -> int:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) * 1024

    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc")
    before = rss()
    k = zeros((2, 4, 2, 1 << 16, 128), torch.float32, torch.device("cpu"))  # 512 MiB
    assert rss() - before < 32 << 20
    k[:, :, :, :10] = 1.0
    assert float(k[:, :, :, :20].sum()) == 2 * 4 * 2 * 10 * 128
    assert rss() - before < 64 << 20
    assert float(k[1, 3, 1, -1].abs().sum()) == 0.0


def test_the_reader_reads_what_safetensors_does(tmp_path, target_dir):
    from safetensors.torch import load_file

    ours, theirs = read_safetensors(target_dir), load_file(f"{target_dir}/model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    # a file cut short is named, with what to do
    cut = tmp_path / "cut"
    cut.mkdir()
    data = open(f"{target_dir}/model.safetensors", "rb").read()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LeapDecodeError, match="damaged or incomplete.*download it again"):
        SafetensorsReader(str(cut))


def test_bfloat16_checkpoint_loads_as_float32_exactly(tmp_path_factory, tok_dir):
    from leapdecode.models import load_model

    path = str(tmp_path_factory.mktemp("bf16"))
    hf = make_llama(path, seed=3, tokenizer_dir=tok_dir).to(torch.bfloat16)
    hf.save_pretrained(path)
    m = load_model(path, dtype="float32")
    q = hf.model.layers[1].self_attn.q_proj.weight.float()  # [out, in]
    w = dense(m.layers[1].wqkv)  # float32 on the CPU, plain: [in, out]
    assert w.dtype == torch.float32 and torch.equal(w[:, : q.shape[0]], q.t())
    assert torch.equal(dense(m.lm_head), hf.lm_head.weight.float().t())
    b = load_model(path, dtype="bfloat16")
    assert torch.equal(dense(b.layers[1].wqkv)[: q.shape[0]], q.to(torch.bfloat16))


def test_the_profile_keeps_to_its_time_budget(decoder):
    """With no time at all it still measures the one-row forward and prices every other
    cell from it: positive, never cheaper with more rows or a longer prefix."""
    engine = decoder.engine
    engine.allocate()
    cost = CostModel.profile(engine.target, engine.draft, 16, budget_s=0.0)
    assert cost.measured == 1 and cost.verify.shape[0] == 1  # the long prefix left out
    assert (cost.verify > 0).all() and cost.draft_s(4) > 0
    assert (cost.verify[0, :, 1:] >= cost.verify[0, :, :-1]).all()
    assert int(engine.target.lengths(torch.arange(16)).sum()) == 0
    full = CostModel.profile(engine.target, engine.draft, 16, reps=1, budget_s=60.0)
    assert full.measured == full.verify.size and len(full.contexts) == 2


def test_a_saved_profile_is_read_back_by_the_next_engine(
    monkeypatch, tmp_path, target_dir, draft_dir
):
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))
    calls = []
    real = CostModel.profile.__func__

    def counted(cls, *a, **kw):
        calls.append(1)
        return real(cls, *a, **kw)

    monkeypatch.setattr(CostModel, "profile", classmethod(counted))
    costs = []
    for _ in range(2):  # two engines on the same models: one profile
        dec = LeapDecoder.from_pretrained(target_dir, draft=draft_dir, max_num_seqs=4)
        costs.append(dec.engine.planner.ensure_cost_model())
        dec.generate("def f(x):", method="auto", max_new_tokens=4)
    assert len(calls) == 1
    assert costs[1].as_dict()["verify_s"] == costs[0].as_dict()["verify_s"]
    assert costs[1].draft_token_s == costs[0].draft_token_s
    saved = os.listdir(tmp_path / "cache" / "profiles")
    assert len(saved) == 1
    key = json.load(open(tmp_path / "cache" / "profiles" / saved[0]))["key"]
    assert key["max_num_seqs"] == 4 and key["target"]["weights"][0][0] == "model.safetensors"
    assert key["threads"] == torch.get_num_threads() and key["torch"] == torch.__version__
    # another slot count (or model, dtype, threads...) is another profile
    dec = LeapDecoder.from_pretrained(target_dir, draft=draft_dir, max_num_seqs=3)
    dec.engine.planner.ensure_cost_model()
    assert len(calls) == 2 and len(os.listdir(tmp_path / "cache" / "profiles")) == 2
    # a model folder rewritten (its weights' size or time) is another profile
    weights = os.path.join(draft_dir, "model.safetensors")
    st = os.stat(weights)
    key = cost_model.profile_key(dec.target, dec.draft, 3)
    try:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert cost_model.profile_key(dec.target, dec.draft, 3) != key
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cost_model.profile_key(dec.target, dec.draft, 3) == key
