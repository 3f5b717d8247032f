"""The native forward compiled with torch.compile (inductor; on CPU its C++ backend and wrapper).

Eager, a decode step of a small model is spent on per-operation overhead (docs/step_profile.md):
about eleven operations a layer, each a Python call and a kernel launch. Compiled, the
elementwise work (norms, rotary, SiLU, softmax, residuals) fuses into a few C++ loops a layer
and, with the C++ wrapper, no Python runs between kernels.

The graph only reads the KV cache: attention runs in two parts, the cached prefix and the
step's own new tokens, joined in one softmax, and the new keys and values come back out for
the caller to write in one call for every layer. The past is read over `ceil(longest / 64) * 64`
positions (an additive bias hides what a row has not cached), so its length never takes the
values 0 or 1 that torch.compile specialises on. Rows, tokens and the past are dynamic sizes:
four graphs (one row or more, one token or more) serve every decode, verify and tree step,
two more (one row or more) every prompt longer than those steps (prefill, causal attention
over the prompt's own tokens), and with the kernel one more serves chain steps of several rows packed: each row runs only its
real tokens (`CausalLM.packs_rows`), so a row that drafted nothing costs one token.

On CPU in float32 the attention is the cached-attention kernel (attention_cpu.py) for every
decode step and every step of several rows (`uses_kernel`): it reads each row's own context
from any slots, so those steps run compiled wherever their rows sit. Otherwise (one row's
verify step; no compiler, CUDA or bfloat16) the graph's own attention reads a range of
consecutive cache slots (holes between them run as dummy rows). Everything else (a long
prompt, a sliding window, rows too scattered for the graph's attention) runs eager.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from ..cache import cache_dir
from .ops import linear, rms_norm
from .rope import apply_rope

MAX_TOKENS = 64  # longest step compiled; prompts run eager (one forward each, few of them)
PAST_BLOCK = 64  # the past is read in whole blocks of positions
CACHE_DIR = cache_dir("inductor")


class CompiledForward:
    """The layers of a `NativeLlama` as one compiled function (see the module docstring)."""

    def __init__(
        self,
        model,
        keep: tuple[int, ...] = (),
        cpp_wrapper: bool | None = None,
        kernel: bool | None = None,
    ) -> None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", CACHE_DIR)
        import torch._dynamo

        # four shape classes times the hidden-state requests of one engine
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 256
        )
        self.model = model
        self.keep = tuple(sorted(set(keep)))  # hidden-state layers every step returns
        if cpp_wrapper is None:  # the C++ wrapper: no Python between kernels (CPU)
            cpp_wrapper = model.device.type == "cpu"
        # attention that reads each row's own context (CPU float32, when its kernel builds)
        # (kernel=False: the graph's own attention, for a comparison)
        self.kernel = False
        if kernel is not False and model.device.type == "cpu" and model.attn_dtype == torch.float32:
            from . import attention_cpu

            self.kernel = attention_cpu.available()
        options = {"cpp_wrapper": cpp_wrapper}
        self._fn = torch.compile(self._layers, options=options)
        self._fn_kernel = (
            torch.compile(self._layers_kernel, options=options) if self.kernel else None
        )
        self._fn_ragged = (
            torch.compile(self._layers_ragged, options=options) if self.kernel else None
        )
        self._fn_fresh = torch.compile(self._layers_fresh, options=options)
        self.compile_s = 0.0  # time spent in calls that compiled a graph

    def fits(self, n_new: int) -> bool:
        return 1 <= n_new <= MAX_TOKENS

    def uses_kernel(self, rows: int, n_new: int) -> bool:
        """Whether a step of `rows` rows x `n_new` tokens attends through the kernel (when it
        is built): every decode step, and every step of several rows, which the kernel reads
        each from its own context and slots (the graph pads them to the longest). A single
        row's verify or tree step keeps the graph's attention: nothing is padded there, and
        the two measured level (kernel / graph 0.93-1.26x in one run, 0.99-1.07x in another,
        `bench/batched_step.py --rows 1`)."""
        return self.kernel and (n_new == 1 or rows > 1)

    def _stack(self, tokens, positions, attend):
        """The layers around an attention: attend(i, q, k, v) with q [B, T, H, D] and the new
        k, v [B, T, H_kv, D] (rotary applied, in the attention dtype) returns [B, T, H, D].
        Returns (x after the final norm [B, T, hidden], hidden [B, T, len(self.keep), hidden]
        or None, new keys and values [L, B, H_kv, T, D])."""
        m, keep = self.model, self.keep
        b, t = tokens.shape
        h, h_kv, d = m.n_heads, m.n_kv_heads, m.head_dim
        cos = m.cos[positions].unsqueeze(2)  # [B, T, 1, D]
        sin = m.sin[positions].unsqueeze(2)
        x = F.embedding(tokens, m.embed)  # [B, T, hidden]
        kept, keys, values = {}, [], []
        for i, layer in enumerate(m.layers):
            if i in keep:
                kept[i] = x
            a = rms_norm(x, layer.attn_norm, m.eps)
            qkv = linear(a, layer.wqkv, layer.bqkv)  # [B, T, (H + 2 H_kv) D]
            qk = qkv[..., : (h + h_kv) * d].view(b, t, h + h_kv, d)
            v = qkv[..., (h + h_kv) * d :].view(b, t, h_kv, d).to(m.attn_dtype)
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk.float(), (d,), None, m.eps).to(m.dtype) * layer.qk_norm
            qk = apply_rope(qk, cos, sin).to(m.attn_dtype)
            q, k = qk[:, :, :h], qk[:, :, h:]  # [B, T, H, D], [B, T, H_kv, D]
            keys.append(k.transpose(1, 2))  # [B, H_kv, T, D]
            values.append(v.transpose(1, 2))
            o = attend(i, q, k, v).reshape(b, t, h * d)
            x = x + linear(o.to(m.dtype), layer.wo, layer.bo)
            mm = rms_norm(x, layer.mlp_norm, m.eps)
            gate, up = linear(mm, layer.w_gate_up, layer.b_gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.w_down, layer.b_down)
        if len(m.layers) in keep:
            kept[len(m.layers)] = x
        hidden = torch.stack([kept[i] for i in keep], dim=2) if keep else None
        return rms_norm(x, m.norm, m.eps), hidden, torch.stack(keys), torch.stack(values)

    def _layers(self, tokens, positions, past_k, past_v, past_bias, new_bias):
        """The graph's own attention: past_k/v [L, B, H_kv, S, D] (the cache, read only),
        past_bias [B, 1, 1, S] and new_bias [B, 1, T, T] additive (0 or -inf); the cached
        prefix and the new tokens joined in one softmax. Returns what `_stack` does."""
        b, t = tokens.shape
        h_kv, d = self.model.n_kv_heads, self.model.head_dim
        g = self.model.n_heads // h_kv
        scale = d**-0.5

        def attend(i, q, k, v):
            q = q.reshape(b, t, h_kv, g, d).permute(0, 2, 3, 1, 4)  # [B, H_kv, g, T, D]
            q = q.reshape(b, h_kv, g * t, d)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, H_kv, T, D]
            s_past = (q @ past_k[i].transpose(-1, -2)).view(b, h_kv, g, t, -1) * scale
            s_new = (q @ k.transpose(-1, -2)).view(b, h_kv, g, t, t) * scale
            s_past = s_past + past_bias[:, :, None]  # [B, H_kv, g, T, S]
            s_new = s_new + new_bias[:, :, None]  # [B, H_kv, g, T, T]
            p = torch.cat([s_past, s_new], -1).softmax(-1)
            n_past = past_k.shape[3]
            o = (
                p[..., :n_past].reshape(b, h_kv, g * t, n_past) @ past_v[i]
                + p[..., n_past:].reshape(b, h_kv, g * t, t) @ v
            )
            return o.view(b, h_kv, g, t, d).permute(0, 3, 1, 2, 4)  # [B, T, H_kv, g, D]

        return self._stack(tokens, positions, attend)

    def _layers_kernel(self, tokens, positions, cache_k, cache_v, slots, lens, new_bias):
        """attention_cpu's kernel: cache_k/v the whole cache [L, slots, H_kv, L_max, D], each
        row read over its own cached length (slots, lens [B]); new_bias [B, 1, T, T].
        Returns what `_stack` does."""
        bias = new_bias[:, 0]  # [B, T, T]
        scale = self.model.head_dim**-0.5

        def attend(i, q, k, v):
            return torch.ops.leapdecode.cached_attention(
                q, cache_k[i], cache_v[i], slots, lens, k, v, bias, scale
            )

        return self._stack(tokens, positions, attend)

    def _layers_ragged(self, tokens, positions, cache_k, cache_v, slots, lens, cu):
        """attention_cpu's packed kernel: tokens, positions [1, N], row b's the packed
        N[cu[b] : cu[b + 1]], causal, after its cached length lens[b] in slot slots[b].
        Returns what `_stack` does (with B = 1, T = N)."""
        scale = self.model.head_dim**-0.5

        def attend(i, q, k, v):
            return torch.ops.leapdecode.cached_attention_ragged(
                q[0], cache_k[i], cache_v[i], slots, lens, cu, k[0], v[0], scale
            )[None]

        return self._stack(tokens, positions, attend)

    def _layers_fresh(self, tokens, positions):
        """A fresh prompt (nothing cached before it; rows right-padded): causal attention
        over its own tokens, through attention_cpu's `causal_attention` where the kernel is
        built (its attention 1.3-1.7x SDPA's causal path on this CPU, a prompt forward
        1.04-1.17x: docs/prefill_step.md), else SDPA's. Returns what `_stack` does."""
        gqa = self.model.n_heads != self.model.n_kv_heads
        scale = self.model.head_dim**-0.5

        def attend(i, q, k, v):
            if self.kernel:
                return torch.ops.leapdecode.causal_attention(q, k, v, scale)
            return F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=gqa,
            ).transpose(1, 2)

        return self._stack(tokens, positions, attend)

    def fresh(self, tokens, positions):
        """Prompts longer than the decode graphs' steps (prefill), nothing cached before
        them: tokens, positions [B, T] on the device. Returns what `_layers` does."""
        for tensor in (tokens, positions):
            for dim in (0, 1):
                if tensor.shape[dim] > 1:
                    torch._dynamo.mark_dynamic(tensor, dim)
        t0 = time.perf_counter()
        frames = _frames_compiled()
        out = self._fn_fresh(tokens, positions)
        if _frames_compiled() != frames:
            self.compile_s += time.perf_counter() - t0
        return out

    def ragged(self, tokens, positions, slots, start, cu):
        """A chain step without padding (the kernel only): tokens, positions [1, N] on the
        device, packed row after row; slots, start [B] (CPU) each row's slot and cached
        length; cu [B + 1] (CPU) the rows' offsets in N. Returns what `_layers` does."""
        cache = self.model.cache
        dev = cache.k.device
        args = (
            tokens,
            positions,
            cache.k,
            cache.v,
            slots.to(dev, copy=True),
            start.to(dev, copy=True),
            cu.to(dev, copy=True),
        )
        for tensor in args[:2]:
            if tensor.shape[1] > 1:
                torch._dynamo.mark_dynamic(tensor, 1)
        for tensor in args[4:]:
            if tensor.shape[0] > 1:
                torch._dynamo.mark_dynamic(tensor, 0)
        t0 = time.perf_counter()
        frames = _frames_compiled()
        out = self._fn_ragged(*args)
        if _frames_compiled() != frames:
            self.compile_s += time.perf_counter() - t0
        return out

    def __call__(self, tokens, positions, slots, start, new_bias):
        """Run the rows in cache `slots` (CPU [B]; consecutive unless `uses_kernel`) after their
        cached prefixes. tokens, positions [B, T] on the device; start [B] cached lengths
        (CPU); new_bias [B, 1, T, T] float. Returns what `_layers` does."""
        cache = self.model.cache
        lo, width = int(slots[0]), len(slots)
        kernel = self.uses_kernel(*tokens.shape)
        if kernel:
            slots = slots.to(cache.k.device, copy=True)
            lens = start.to(cache.k.device, copy=True)
            args = (tokens, positions, cache.k, cache.v, slots, lens, new_bias)
            dynamic = (
                (tokens, (0, 1)),
                (positions, (0, 1)),
                (slots, (0,)),
                (lens, (0,)),
                (new_bias, (0, 2, 3)),
            )
        else:
            longest = int(start.max())
            span = min(-(-max(longest, 1) // PAST_BLOCK) * PAST_BLOCK, cache.max_len)
            past_k = cache.k[:, lo : lo + width, :, :span]  # [L, B, H_kv, S, D] views
            past_v = cache.v[:, lo : lo + width, :, :span]
            hide = torch.arange(span)[None, :] >= start[:, None]  # [B, S]
            past_bias = torch.zeros(width, 1, 1, span, dtype=cache.k.dtype)
            past_bias.masked_fill_(hide[:, None, None], float("-inf"))
            past_bias = past_bias.to(cache.k.device)
            args = (tokens, positions, past_k, past_v, past_bias, new_bias)
            dynamic = (
                (tokens, (0, 1)),
                (positions, (0, 1)),
                (past_k, (1, 3)),
                (past_v, (1, 3)),
                (past_bias, (0, 3)),
                (new_bias, (0, 2, 3)),
            )
        for tensor, dims in dynamic:
            for dim in dims:
                if tensor.shape[dim] > 1:
                    torch._dynamo.mark_dynamic(tensor, dim)
        t0 = time.perf_counter()
        frames = _frames_compiled()
        out = (self._fn_kernel if kernel else self._fn)(*args)
        if _frames_compiled() != frames:
            self.compile_s += time.perf_counter() - t0
        return out

    def warm_up(self, max_rows: int) -> float:
        """Compile the graphs a run can meet, now: one row and (when max_rows > 1) two, each
        with one new token and with three, a prompt of each (prefill), and (with the kernel)
        a packed step of rows with different token counts. Returns the seconds it took."""
        from tqdm import tqdm

        m = self.model
        cache = m.cache
        if cache is None or cache.n_slots < min(max_rows, 2):
            raise RuntimeError("allocate() the cache before compiling")
        # (rows, new tokens a row, cached before them, counts): the steps, a prompt past
        # MAX_TOKENS (prefill) and, with the kernel, a packed chain step
        steps = [(1, 1, 5, None), (1, 3, 5, None), (1, MAX_TOKENS + 16, 0, None)]
        if max_rows > 1:
            steps += [(2, 1, 5, None), (2, 3, 5, None), (2, MAX_TOKENS + 16, 0, None)]
            if self.kernel:
                steps.append((2, 3, 5, torch.tensor([1, 3])))
        t0 = time.perf_counter()
        saved = cache.lens.clone()
        for rows, n, cached, counts in tqdm(
            steps, desc="compiling the forward (once; cached after)", unit="graph", leave=False
        ):
            cache.lens[:rows] = cached  # any cached prefix: the keys are only read
            m.forward(torch.zeros(rows, n, dtype=torch.long), torch.arange(rows), counts=counts)
        cache.lens.copy_(saved)
        return time.perf_counter() - t0


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
