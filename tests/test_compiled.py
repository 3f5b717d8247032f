"""The compiled forward (models/compiled.py): the same logits, cache and hidden states as the
eager one, no new graph after the warm-up, and greedy output still equal to `transformers`."""

import pytest
import torch

import helpers
from helpers import assert_lossless
from leapdecode import LeapDecoder
from leapdecode.models.base import HiddenRequest

V = helpers.VOCAB
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
CASES = {  # rows' slots, new tokens a row, forward's keywords
    "decode": ([0], 1, {}),
    "verify": ([2], 5, {}),
    "ragged decode": ([0, 1, 2], 1, {}),
    "ragged verify": ([1, 2, 3], 4, {}),
    "slots with a hole": ([3, 5], 3, {}),
    "scattered decode": ([5, 0, 3], 1, {}),  # the kernel's: any slots, any order
    "scattered verify": ([4, 1, 3], 3, {}),  # ... its matrix-product path (3 queries a head)
    "tree": ([0, 1], 4, dict(tree_mask=TREE.expand(2, 4, 4).clone(),
                             position_offsets=torch.tensor([[0, 1, 1, 2]] * 2))),
    "logits at": ([0, 1], 3, dict(logits_at=torch.tensor([2, 1]))),
}  # fmt: skip


def graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def compiled_decoder(target_dir, draft_dir):
    """One compiled target for every test here (a graph takes seconds to a minute to build):
    the decoder's engine holds six slots, and its graphs return hidden layers 0-2."""
    dec = LeapDecoder.from_pretrained(target_dir, draft=draft_dir, max_num_seqs=6)
    dec.engine.allocate()
    dec.target.compile(max_rows=6, keep=(0, 1, 2))
    assert dec.target.compiled is not None
    return dec


@pytest.fixture(scope="module")
def model(compiled_decoder):
    return compiled_decoder.target


def _cached_rows(model, seed: int):
    """The engine's cache emptied, then six slots holding 40, 31, 40, 9, 40, 22 tokens
    (eager); returns the generator and the eager path's stand-in (None) with the compiled."""
    gen = torch.Generator().manual_seed(seed)
    model.allocate(6, model.cache.k.shape[3])
    model.compiled, compiled = None, model.compiled
    model.forward(torch.randint(0, V, (6, 40), generator=gen), torch.arange(6))
    model.truncate(torch.arange(6), torch.tensor([40, 31, 40, 9, 40, 22]))
    return gen, compiled


def _each_path(model, tokens, slots, want, runs) -> dict:
    """runs: (name, compiled forward or None, forward keywords); each from the same cache.
    Returns name -> (output, cache keys, values, lengths after), and checks that no step
    compiled a graph past the warm-up."""
    saved = model.cache.k.clone(), model.cache.v.clone(), model.cache.lens.clone()
    outs = {}
    for name, path, kw in runs:
        model.compiled = path
        model.cache.k.copy_(saved[0]), model.cache.v.copy_(saved[1])
        model.cache.lens.copy_(saved[2])
        before = graphs()
        out = model.forward_outputs(tokens, slots, want, **kw) if want else model.forward(
            tokens, slots, **kw)  # fmt: skip
        outs[name] = (out, model.cache.k.clone(), model.cache.v.clone(), model.cache.lens.clone())
        assert graphs() == before, f"a {name} step after the warm-up compiled a new graph"
    return outs


@pytest.mark.parametrize("hidden", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_step_equals_eager(model, case, hidden):
    slots, n, kw = CASES[case]
    slots = torch.tensor(slots)
    gen, compiled = _cached_rows(model, 0)
    tokens = torch.randint(0, V, (len(slots), n), generator=gen)
    want = HiddenRequest((0, 2), True) if hidden else None
    outs = _each_path(model, tokens, slots, want, (("eager", None, kw), ("compiled", compiled, kw)))
    model.compiled = compiled
    (a, ka, va, la), (b, kb, vb, lb) = outs["eager"], outs["compiled"]
    if hidden:
        for x, y in ((a.logits, b.logits), (a.hidden, b.hidden), (a.final, b.final)):
            assert x.shape == y.shape and (x - y).abs().max() < 1e-4
    else:
        assert a.shape == b.shape and (a - b).abs().max() < 1e-4
    assert (ka - kb).abs().max() < 1e-4 and (va - vb).abs().max() < 1e-4
    assert torch.equal(la, lb)


@pytest.mark.parametrize("method,kw", [("none", {}), ("draft", {}), ("ngram", {}),
                                       ("suffix", {"use_tree_spec": True}),
                                       ("lookahead", {})])  # fmt: skip
def test_compiled_greedy_matches_transformers(compiled_decoder, hf_target, method, kw):
    prompts = helpers.random_prompts(compiled_decoder.tokenizer, 24, 3, 61, seed=0)
    reference = helpers.greedy_reference(hf_target, prompts, 24)
    before = graphs()
    results = compiled_decoder.generate_batch(prompts, method=method, k=4, max_new_tokens=24,
                                              **kw)  # fmt: skip
    assert_lossless(prompts, [r.token_ids for r in results], reference, hf_target)
    assert graphs() == before, "generation compiled a graph the warm-up did not"


def test_compile_refuses_the_transformers_backend(target_dir):
    from leapdecode.errors import LeapDecodeError

    with pytest.raises(LeapDecodeError, match="native backend"):
        LeapDecoder.from_pretrained(target_dir, backend="transformers", compile=True)


def test_cost_model_profiles_the_compiled_path(compiled_decoder):
    """auto's step costs are measured on the forward that runs: the compiled one, with no graph
    of its own (its rows are consecutive slots from 0, its steps within the four shapes)."""
    before = graphs()
    calls = []
    compiled = compiled_decoder.target.compiled
    name = "_fn_kernel" if compiled.kernel else "_fn"  # the graph every step runs through
    real = getattr(compiled, name)
    setattr(compiled, name, lambda *a: calls.append(1) or real(*a))
    try:
        compiled_decoder.engine.planner.ensure_cost_model()
    finally:
        setattr(compiled, name, real)
    assert calls and graphs() == before


@pytest.mark.parametrize("rows,tokens,heads,kv_heads", [(1, 1, 2, 2), (3, 1, 4, 2), (5, 1, 8, 1),
                                                        (2, 6, 4, 2), (4, 2, 2, 2),
                                                        (3, 17, 2, 2)])  # fmt: skip
def test_cached_attention_kernel_equals_plain_attention(rows, tokens, heads, kv_heads):
    """The C++ kernel (models/attention_cpu.py) against the same attention in PyTorch: rows
    in scattered slots, cached lengths from 0 up (past a block boundary), grouped heads, a
    tree mask over the new tokens; both of its paths (one or two queries a key/value head
    stream the cache; three or more go through matrix products)."""
    from leapdecode.models import attention_cpu

    if not attention_cpu.available():
        pytest.skip("no C++ compiler for the kernel here (the compiled forward does without)")
    gen = torch.Generator().manual_seed(rows * 10 + tokens)
    d, slots_n, max_len = 16, 8, 100
    k_cache = torch.randn(slots_n, kv_heads, max_len, d, generator=gen)
    v_cache = torch.randn(slots_n, kv_heads, max_len, d, generator=gen)
    slots = torch.randperm(slots_n, generator=gen)[:rows]
    lens = torch.tensor([0, 33, 95, 1, 64][:rows])
    q = torch.randn(rows, tokens, heads, d, generator=gen)
    new_k = torch.randn(rows, tokens, kv_heads, d, generator=gen)
    new_v = torch.randn(rows, tokens, kv_heads, d, generator=gen)
    seen = torch.rand(rows, tokens, tokens, generator=gen) < 0.5
    seen |= torch.eye(tokens, dtype=torch.bool)  # a token always sees itself
    bias = torch.zeros(rows, tokens, tokens).masked_fill(~seen, float("-inf"))
    args = (q, k_cache, v_cache, slots, lens, new_k, new_v, bias, d**-0.5)
    got = torch.ops.leapdecode.cached_attention(*args)
    assert (got - attention_cpu.reference(*args)).abs().max() < 1e-5


@pytest.mark.parametrize("counts,heads,kv_heads", [([1, 9, 3, 2, 1], 4, 2), ([5, 1, 0, 17], 2, 2),
                                                   ([1, 1, 2], 8, 1)])  # fmt: skip
def test_ragged_kernel_equals_plain_attention(counts, heads, kv_heads):
    """The kernel's packed form (a chain verify step without padding): rows of different
    token counts, causal among their own new tokens, in scattered slots, against the padded
    form's PyTorch reference row by row."""
    from leapdecode.models import attention_cpu

    if not attention_cpu.available():
        pytest.skip("no C++ compiler for the kernel here (the compiled forward does without)")
    gen = torch.Generator().manual_seed(sum(counts))
    d, slots_n, max_len, rows = 16, 8, 100, len(counts)
    k_cache = torch.randn(slots_n, kv_heads, max_len, d, generator=gen)
    v_cache = torch.randn(slots_n, kv_heads, max_len, d, generator=gen)
    slots = torch.randperm(slots_n, generator=gen)[:rows]
    lens = torch.tensor([0, 33, 95, 1, 64][:rows])
    cu = torch.tensor([0] + counts).cumsum(0)
    n = int(cu[-1])
    q = torch.randn(n, heads, d, generator=gen)
    new_k = torch.randn(n, kv_heads, d, generator=gen)
    new_v = torch.randn(n, kv_heads, d, generator=gen)
    args = (q, k_cache, v_cache, slots, lens, cu, new_k, new_v, d**-0.5)
    got = torch.ops.leapdecode.cached_attention_ragged(*args)
    assert (got - attention_cpu.reference_ragged(*args)).abs().max() < 1e-5


@pytest.mark.parametrize("rows,tokens,heads,kv_heads", [(1, 1, 2, 2), (1, 200, 2, 2),
                                                        (3, 65, 4, 2), (2, 130, 8, 1),
                                                        (2, 128, 4, 1)])  # fmt: skip
@pytest.mark.parametrize("strided", [False, True])
def test_causal_kernel_equals_sdpa(rows, tokens, heads, kv_heads, strided):
    """The kernel's prompt attention (the compiled prefill's): causal over a prompt's own
    tokens, query blocks cut mid-way (65, 130, 200 tokens) or whole (128), grouped heads,
    contiguous or as the graph passes them (slices of one fused projection), against SDPA;
    shapes it cannot take are refused with a message, not read out of bounds."""
    import torch.nn.functional as F

    from leapdecode.models import attention_cpu

    if not attention_cpu.available():
        pytest.skip("no C++ compiler for the kernel here (the compiled forward does without)")
    gen = torch.Generator().manual_seed(rows * 1000 + tokens)
    d = 16
    if strided:  # q, k and v as views of one [B, T, H + 2 H_kv, D] tensor
        qkv = torch.randn(rows, tokens, heads + 2 * kv_heads, d, generator=gen)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=2)
    else:
        q = torch.randn(rows, tokens, heads, d, generator=gen)
        k = torch.randn(rows, tokens, kv_heads, d, generator=gen)
        v = torch.randn(rows, tokens, kv_heads, d, generator=gen)
    want = F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True, enable_gqa=heads != kv_heads
    ).transpose(1, 2)
    got = torch.ops.leapdecode.causal_attention(q, k, v, d**-0.5)
    assert got.shape == want.shape and (got - want).abs().max() < 1e-5
    if kv_heads > 1:  # heads not a multiple of the key/value heads
        with pytest.raises(RuntimeError, match="multiple of H_kv"):
            torch.ops.leapdecode.causal_attention(q[:, :, :-1], k, v, d**-0.5)


@pytest.mark.parametrize("hidden", [False, True])
def test_packed_step_runs_only_each_rows_real_tokens(model, hidden):
    """A chain step with `counts` (CausalLM.packs_rows): each row's first counts[b] tokens
    give the eager padded step's logits, hidden states and cached keys and values, and a
    slot grows by its own count, not by the longest row's; no graph past the warm-up."""
    if not model.packs_rows:
        pytest.skip("no cached-attention kernel here: steps run padded")
    slots, counts = torch.tensor([4, 1, 3]), torch.tensor([5, 1, 3])
    gen, compiled = _cached_rows(model, 1)
    start = model.cache.lens[slots].clone()
    tokens = torch.randint(0, V, (3, 5), generator=gen)
    want = HiddenRequest((0, 2), True) if hidden else None
    runs = (("padded", None, {}), ("packed", compiled, {"counts": counts}))
    outs = _each_path(model, tokens, slots, want, runs)
    assert model.last_packed  # the engine prices the step by what ran
    (a, ka, va, _), (b, kb, vb, lb) = outs["padded"], outs["packed"]
    assert torch.equal(lb[slots], start + counts)
    for row, (slot, n) in enumerate(zip(slots.tolist(), counts.tolist(), strict=True)):
        p0 = int(start[row])
        pairs = [(a.logits, b.logits), (a.hidden, b.hidden), (a.final, b.final)] if hidden \
            else [(a, b)]  # fmt: skip
        for x, y in pairs:
            assert x.shape == y.shape and (x[row, :n] - y[row, :n]).abs().max() < 1e-4
        for x, y in ((ka, kb), (va, vb)):
            assert (x[:, slot, :, p0 : p0 + n] - y[:, slot, :, p0 : p0 + n]).abs().max() < 1e-4
    model.compiled = compiled


@pytest.mark.parametrize("rows,hidden", [(1, False), (3, True)])
def test_compiled_prefill_equals_eager(model, rows, hidden):
    """Prompts longer than the compiled steps (prefill) run through the compiled prompt
    graph: the eager forward's logits, hidden states, cached keys and values and lengths,
    rows in scattered slots, and no graph past the warm-up."""
    from leapdecode.models.compiled import MAX_TOKENS

    gen = torch.Generator().manual_seed(rows)
    n = MAX_TOKENS + 30
    slots = torch.tensor([5, 0, 3][:rows])
    tokens = torch.randint(0, V, (rows, n), generator=gen)
    at = torch.tensor([n - 1, n - 5, 70][:rows])
    want = HiddenRequest((0, 2), True) if hidden else None
    compiled, outs = model.compiled, {}
    for name, path in (("eager", None), ("compiled", compiled)):
        model.compiled = path
        model.allocate(6, model.cache.k.shape[3])
        before = graphs()
        kw = {"logits_at": at}
        out = model.forward_outputs(tokens, slots, want, **kw) if want else model.forward(
            tokens, slots, **kw)  # fmt: skip
        outs[name] = (out, model.cache.k[:, slots, :, :n].clone(),
                      model.cache.v[:, slots, :, :n].clone(), model.cache.lens.clone())  # fmt: skip
        assert graphs() == before, "a prompt after the warm-up compiled a new graph"
    model.compiled = compiled
    (a, ka, va, la), (b, kb, vb, lb) = outs["eager"], outs["compiled"]
    pairs = [(a.logits, b.logits), (a.hidden, b.hidden), (a.final, b.final)] if hidden else [(a, b)]
    for x, y in pairs:
        assert x.shape == y.shape and (x - y).abs().max() < 1e-4
    assert (ka - kb).abs().max() < 1e-4 and (va - vb).abs().max() < 1e-4
    assert torch.equal(la, lb)
