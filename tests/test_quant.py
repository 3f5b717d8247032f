"""The native backend's weight layouts (models/ops.py, models/quant.py): oneDNN-packed
bfloat16, int8 and int4. Each row of a many-row call holds the bits a one-row call gives it
(so a verify row computes what a decode step computes), and speculation on a quantized target
emits what that quantized target emits by itself, token for token."""

import json

import pytest
import torch

from leapdecode import LeapDecoder
from leapdecode.cli import main
from leapdecode.models.ops import Packed, dense, lay_out, linear
from leapdecode.models.quant import Int4Weight, Int8Weight, quantize
from test_embedded_models import DRAFT, TARGET  # the committed toy pair

PROMPTS = [
    "import os\n\n\ndef read_lines(path):\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
]


def _weight(out_f=384, in_f=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=g) * in_f**-0.5  # [out, in]


def _layout(kind: str, w: torch.Tensor):
    if kind.startswith("packed"):
        lay = lay_out(w.to(torch.float32 if kind == "packed-f32" else torch.bfloat16))
        if not isinstance(lay, Packed):
            pytest.skip("this torch has no oneDNN weight packing")
        return lay
    return quantize(w, kind, torch.bfloat16)


@pytest.mark.parametrize("kind", ["packed", "packed-f32", "int8", "int4"])
def test_every_row_holds_the_bits_of_a_one_row_call(kind):
    w = _weight()
    lay = _layout(kind, w)
    dt = torch.float32 if kind == "packed-f32" else torch.bfloat16
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, w.shape[1], generator=g).to(dt)  # [B, T, in]
    bias = torch.randn(w.shape[0], generator=g).to(dt)
    y = linear(x, lay, bias)  # [B, T, out]
    assert y.shape == (2, 9, w.shape[0]) and y.dtype == dt
    for b in range(2):
        for t in range(9):
            one = linear(x[b, t][None, None], lay, bias)[0, 0]
            assert torch.equal(y[b, t], one), (kind, b, t)
        assert torch.equal(y[b, :5], linear(x[b, :5], lay, bias))  # any row count
    # and the product is the dense weight's (plain float32 is laid out [in, out])
    plain = dense(lay).float()
    ref = x.float() @ (plain if dt == torch.float32 else plain.t()) + bias.float()
    assert (y.float() - ref).abs().max() < 0.05


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("out_f", [384, 96, 48])  # whole blocks of 64 outputs, a part block
def test_a_prompt_runs_the_weight_dequantized(kind, out_f):
    """A prompt's rows (`prompt=True`) run a copy of the dequantized weight (the int4 CPU
    kernel reads its packing once every 4 rows); the product is the kernel's, up to rounding,
    and the packing reads back exactly (int4: its nibbles found where the kernel put them)."""
    w = _weight(out_f=out_f)
    lay = _layout(kind, w)
    assert lay.for_prompts
    assert torch.equal(dense(lay.prompt_weight), dense(lay))  # the copy holds the same values
    bare = quantize(w, kind, torch.bfloat16, prompt_copy=False)  # dequantized for each call
    assert bare.prompt_weight is None
    if kind == "int4":
        assert lay.layout is not None
        eye = torch.eye(w.shape[1], dtype=torch.bfloat16)
        assert torch.allclose(lay.dense().float(), lay.matmul(eye).t().float(), atol=0.02)
    x = torch.randn(70, w.shape[1], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    many, rows = linear(x, lay, None, prompt=True).float(), linear(x, lay, None).float()
    assert (many - rows).abs().max() < 0.05 * rows.abs().max()
    assert (linear(x, bare, None, prompt=True).float() - many).abs().max() < 0.05 * rows.abs().max()


def test_a_draft_runs_its_catch_up_through_the_copy(monkeypatch):
    """A model whose rows need not be exact (a draft) takes the copy from LOOSE_MANY_ROWS new
    tokens (its catch-up after a long accepted run, its prompt); a target, whose verify rows
    must hold a decode step's bits, only for a prompt's many rows."""
    from leapdecode.models import llama, quant
    from leapdecode.models.loader import load_model

    calls = []
    for cls in (quant.Int4Weight, quant.Int8Weight):
        real = cls.prompt_matmul
        monkeypatch.setattr(
            cls, "prompt_matmul", lambda self, *a, _r=real: calls.append(1) or _r(self, *a)
        )
    model = load_model(DRAFT, dtype="bfloat16", quantize="int4")
    model.allocate(1, 256)
    slot = torch.tensor([0])
    ids = torch.arange(1, 1 + 3 * llama.LOOSE_MANY_ROWS)[None]  # [1, T]
    for exact in (False, True):
        model.exact_rows = exact
        for n, through_copy in ((llama.LOOSE_MANY_ROWS - 1, False), (llama.LOOSE_MANY_ROWS, True)):
            model.truncate(slot, torch.tensor([0]))
            model.forward(ids[:, :8], slot)  # a cached prefix, then n new tokens
            calls.clear()
            model.forward(ids[:, 8 : 8 + n], slot)
            assert bool(calls) == (through_copy and not exact), (exact, n)


def test_the_layouts_keep_the_weights():
    w = _weight()
    for dt in (torch.bfloat16, torch.float32):
        p = lay_out(w.to(dt))
        if isinstance(p, Packed):
            assert torch.equal(p.dense(), w.to(dt))  # [out, in]
            assert torch.equal(dense(p), w.to(dt).t() if dt == torch.float32 else w.to(dt))
    q8 = quantize(w, "int8", torch.bfloat16)
    assert isinstance(q8, Int8Weight) and q8.q.dtype == torch.int8
    step8 = w.abs().amax(dim=1, keepdim=True) / 127  # one quantization step a row
    assert ((dense(q8).float() - w).abs() <= step8 * 0.51 + 1e-2 * w.abs()).all()
    q4 = quantize(w, "int4", torch.bfloat16)
    assert isinstance(q4, Int4Weight) and q4.group == 128
    groups = w.reshape(w.shape[0], -1, 128)
    step4 = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(128, dim=1)
    assert ((dense(q4).float() - w).abs() <= step4 * 0.51 + 2e-2 * w.abs() + 1e-3).all()
    # an input no int4 group divides keeps int8 (the toy's down projection: 336)
    assert isinstance(quantize(_weight(128, 336), "int4", torch.bfloat16), Int8Weight)
    assert quantize(_weight(128, 320), "int4", torch.bfloat16).group == 64


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request):
    return request.param, LeapDecoder.from_pretrained(
        TARGET, draft=DRAFT, dtype="bfloat16", quantize=request.param, draft_quantize="int8"
    )


def test_speculation_on_a_quantized_target_emits_its_own_output(quantized):
    scheme, dec = quantized
    kinds = {type(getattr(layer, n)) for layer in dec.target.layers for n in ("wqkv", "w_down")}
    assert (Int4Weight in kinds) == (scheme == "int4") and Int8Weight in kinds
    assert isinstance(dec.target.lm_head, Int8Weight) and isinstance(dec.draft.lm_head, Int8Weight)
    plain_model = LeapDecoder.from_pretrained(TARGET, dtype="bfloat16")
    differs = False
    for prompt in PROMPTS:
        ids = dec.encode(prompt)
        plain = dec.generate(ids, method="none", max_new_tokens=40).token_ids
        for method, k in (("draft", 3), ("ngram", 8), ("suffix", 16), ("lookahead", 3)):
            got = dec.generate(ids, method=method, k=k, max_new_tokens=40).token_ids
            assert got == plain, (scheme, prompt, method)
        unquantized = plain_model.generate(ids, method="none", max_new_tokens=40).token_ids
        differs |= unquantized != plain
    assert differs or scheme == "int8"  # int4 moves the toy's output somewhere


def test_quantize_errors_are_one_line(capsys):
    cases = [
        (["--quantize", "int4", "--dtype", "float32"], "--dtype bfloat16"),
        (["--quantize", "int8", "--dtype", "bfloat16", "--compile"], "--compile"),
        (["--quantize", "int8", "--backend", "transformers"], "native backend"),
    ]
    for flags, says in cases:
        code = main(["generate", *flags, "--max-new-tokens", "2", "--json", "def f(x):"])
        out, err = capsys.readouterr()
        assert code == 2, (flags, out, err)
        assert says in err and "Traceback" not in err, (flags, err)
    code = main(["generate", "--quantize", "int8", "--dtype", "bfloat16", "--method", "ngram",
                 "--max-new-tokens", "4", "--json", "def f(x):"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert 0 < len(json.loads(out)["token_ids"]) <= 4
