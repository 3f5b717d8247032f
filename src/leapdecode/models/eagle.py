"""An EAGLE-3-style draft head (Li et al. 2025): one decoder layer over the target's features.

Input at index t (the pair that guesses token t+2):
    g_t  = fc(concat(aux hidden states of the target at token t))   [hidden]
           (a low, a middle and a high layer: the residual stream entering layers
           `aux_layers`, by default (2, L // 2, L - 3) as in vLLM), or, while drafting, the
           head's own pre-norm output of the step before (feature-level autoregression)
    e_t  = the target's embedding of token t+1
    x    = concat(input_layernorm(e_t), hidden_norm(g_t))            [2 hidden]
    r    = g_t + o_proj(attention(x)),  o = r + mlp(post_attention_layernorm(r))
    logits over the reduced draft vocabulary = lm_head(norm(o)); o feeds the next step.
Position of index t: t + 1 (the position of its token; RoPE only sees differences).

A parallel head (P-EAGLE; `parallel` > 0) fills k draft slots in one forward: after the
last pair (whose output guesses draft 1), slot j = 1..k-1 is fed learnt aux hidden states
`mask_hidden` [n_aux * target_hidden] (through `fc`, as a real pair's) and the target's
embedding of a fixed token `pard_token`, at position last + 1 + j; it attends to the cached
pairs and to slots 1..j, and guesses draft j + 1 (`parallel_forward` trains it; `parallel`
is the most slots it was trained for). These are vLLM's names and layout for EAGLE-3 with
`parallel_drafting`, so the head exports as it is.

This is the computation of vLLM's `Eagle3LlamaForCausalLM` (layer 0, norm_before_residual
false), so the weights export as they are (`speculators_export.py`). The draft vocabulary
is the `draft_vocab_size` most frequent tokens; `d2t[d]` is the offset that maps draft id d
to target id d + d2t[d] (the speculators/EAGLE-3 convention), `t2d` marks the target ids it
covers. Embeddings are the target's own, shared and frozen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LeapDecodeError
from .head_files import read_folder, write_folder
from .ops import linear, transposed
from .rope import apply_rope, rope_tables


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's and speculators' default, (2, L // 2, L - 3), when those are three distinct
    layers (vLLM captures each layer's input once, in layer order); for shallower targets
    three distinct layers spread over 1..L-1 (0, the embeddings, is never captured), or as
    many as there are (fewer than three cannot be exported to vLLM)."""
    want = (2, num_layers // 2, num_layers - 3)
    if 1 <= want[0] < want[1] < want[2] <= num_layers - 1:
        return want
    top = num_layers - 1
    if top < 1:
        raise LeapDecodeError("an EAGLE head needs a target with at least 2 layers")
    picks = sorted({round(1 + i * (top - 1) / 2) for i in range(3)})
    return tuple(picks)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Eagle3Head(nn.Module):
    def __init__(
        self,
        hidden: int,
        target_hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        vocab_size: int,
        draft_ids: torch.Tensor,
        aux_layers: tuple[int, ...],
        rope_theta: float = 10000.0,
        max_positions: int = 4096,
        eps: float = 1e-5,
        parallel: int = 0,
        pard_token: int = 0,
    ) -> None:
        super().__init__()
        self.parallel = parallel  # P-EAGLE: the most drafts a forward was trained for (0: none)
        self.pard_token = pard_token  # ... and the token whose embedding a mask slot reads
        if parallel:  # a mask slot's aux hidden states (vLLM's `mask_hidden`)
            self.mask_hidden = nn.Parameter(torch.zeros(len(aux_layers) * target_hidden))
        self.hidden, self.target_hidden = hidden, target_hidden
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.intermediate, self.vocab_size, self.eps = intermediate, vocab_size, eps
        self.aux_layers = tuple(aux_layers)
        self.rope_theta, self.max_positions = rope_theta, max_positions
        self.fc = nn.Linear(len(aux_layers) * target_hidden, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.norm = RMSNorm(hidden, eps)
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
        self.lm_head = nn.Linear(hidden, len(draft_ids), bias=False)
        self.register_buffer("draft_ids", draft_ids, persistent=False)  # [Vd] target ids
        cfg = type("RopeConfig", (), {"rope_theta": rope_theta})()
        cos, sin = rope_tables(cfg, head_dim, max_positions, torch.float32)
        self.register_buffer("cos", cos, persistent=False)  # [P, D]
        self.register_buffer("sin", sin, persistent=False)
        self.info: dict = {}
        for lin in (
            self.fc,
            self.q_proj,
            self.k_proj,
            self.v_proj,
            self.o_proj,
            self.gate_proj,
            self.up_proj,
            self.down_proj,
            self.lm_head,
        ):
            nn.init.normal_(lin.weight, std=0.02)

    @property
    def draft_vocab_size(self) -> int:
        return len(self.draft_ids)

    # ------------------------------------------------------------------ pieces
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., n_aux, target_hidden] (the target's hidden states) -> g [..., hidden]."""
        return self.fc(aux.flatten(-2))

    def qkv(self, g: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor):
        """g, emb [B, T, hidden]; positions [B, T] -> q [B, H, T, D], k, v [B, H_kv, T, D]."""
        b, t, _ = g.shape
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], dim=-1)  # [B, T, 2h]
        cos = self.cos[positions].unsqueeze(2)  # [B, T, 1, D]
        sin = self.sin[positions].unsqueeze(2)
        q = apply_rope(self.q_proj(x).view(b, t, self.heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def finish(self, g: torch.Tensor, q, keys, values, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q over keys/values (mask [B, 1, T, S] bool, True = attend), then the
        rest of the layer: (pre-norm output o [B, T, hidden], draft logits [B, T, Vd])."""
        a = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
        b, _, t, _ = q.shape
        r = g + self.o_proj(a.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        m = self.post_attention_layernorm(r)
        o = r + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
        return o, self.lm_head(self.norm(o))

    # --------------------------------------------------------------- training
    def ttt_forward(self, aux: torch.Tensor, emb: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3): aux [B, T, n_aux, target_hidden] at tokens 0..T-1,
        emb [B, T, hidden] the embeddings of tokens 1..T. Returns the draft logits
        [B, T, Vd] of each of `steps` unrolled steps; at step j index t stands for drafting
        depth j+1 after the last real feature at t - j, fed the head's own output of step
        j-1 at t-1, attending to real keys at <= t - j and to its own chain (one key per
        earlier step, at t - j + s). Indices t < j have no such chain (the loss skips them)."""
        b, t, _ = emb.shape
        positions = (torch.arange(t, device=emb.device) + 1).expand(b, t)
        g = self.combine(aux)
        keys, values, outs = [], [], []
        idx = torch.arange(t, device=emb.device)
        for j in range(steps):
            q, k, v = self.qkv(g, emb, positions)
            keys.append(k)
            values.append(v)
            blocks = [idx[None, :] <= (idx[:, None] - j)]  # step-0 (real) keys: [T, T]
            blocks += [idx[None, :] == (idx[:, None] - j + s) for s in range(1, j + 1)]
            mask = torch.cat(blocks, dim=1)  # [T, (j+1) T]
            mask = mask | ~mask.any(1, keepdim=True)  # rows with no key (t < j): any, unused
            o, logits = self.finish(g, q, torch.cat(keys, 2), torch.cat(values, 2), mask)
            outs.append(logits)
            g = torch.cat([o[:, :1], o[:, :-1]], dim=1)  # next step at t is fed o at t-1
        return outs

    def mask_feature(self) -> torch.Tensor:
        """A mask slot's feature g [hidden]."""
        return self.fc(self.mask_hidden)

    def parallel_forward(
        self, aux: torch.Tensor, emb: torch.Tensor, k: int, mask_emb: torch.Tensor
    ) -> list[torch.Tensor]:
        """P-EAGLE training: aux [B, T, n_aux, target_hidden], emb [B, T, hidden] as in
        `ttt_forward`; mask_emb [hidden], the target's embedding of `pard_token`. Returns k draft logits [B, T, Vd]: block 0 at index t guesses token
        t + 2 from the real pairs <= t; block j (a mask slot) at index t guesses token
        t + 2 + j from the real pairs <= t and the slots 1..j of the same anchor t, the way
        one drafting forward lays them out. Block j's last j indices have no label."""
        b, t, _ = emb.shape
        dev = emb.device
        idx = torch.arange(t, device=dev)
        g = torch.cat([self.combine(aux)] + [self.mask_feature().expand(b, t, -1)] * (k - 1), 1)
        e = torch.cat([emb] + [mask_emb.expand(b, t, -1)] * (k - 1), 1)  # [B, k T, h]
        # (positions past the table are clamped: those slots guess past the window, unscored)
        positions = torch.cat([idx + 1 + j for j in range(k)]).clamp(max=self.max_positions - 1)
        positions = positions.expand(b, k * t)
        q, keys, values = self.qkv(g, e, positions)
        block = torch.arange(k, device=dev).repeat_interleave(t)  # [k T] each row's block
        anchor = idx.repeat(k)  # [k T]
        real = (block[None, :] == 0) & (anchor[None, :] <= anchor[:, None])
        slots = (block[None, :] >= 1) & (block[None, :] <= block[:, None])
        mask = real | (slots & (anchor[None, :] == anchor[:, None]))  # [k T, k T]
        _, logits = self.finish(g, q, keys, values, mask)
        return list(logits.split(t, dim=1))

    def runner(self) -> Eagle3Runner:
        """The same computation for drafting: fused, inference-only weights."""
        return Eagle3Runner(self)

    # -------------------------------------------------------------- files
    def config_dict(self) -> dict:
        return {
            "architectures": ["Eagle3Head"],
            "hidden_size": self.hidden,
            "target_hidden_size": self.target_hidden,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.eps,
            "norm_before_residual": False,
            **(
                {
                    "parallel_drafting": True,
                    "pard_token": self.pard_token,
                    "pard_max_k": self.parallel,
                }
                if self.parallel
                else {}
            ),
        }

    def d2t(self) -> torch.Tensor:
        """[Vd] int64 offsets: draft id d is target id d + d2t[d]."""
        return self.draft_ids - torch.arange(self.draft_vocab_size)

    def save(self, out: str, extra: dict | None = None) -> None:
        state = {k: v.float() for k, v in self.state_dict().items()}
        state["d2t"] = self.d2t().cpu()
        write_folder(out, state, {**self.config_dict(), **self.info, **(extra or {})})

    @classmethod
    def load(cls, path: str) -> Eagle3Head:
        c, state = read_folder(path, "an EAGLE head", "eagle")
        if c.get("architectures") != ["Eagle3Head"]:
            archs = c.get("architectures")
            arch = archs[0] if isinstance(archs, list) and archs else repr(archs)
            what = " (Medusa heads)" if arch == "MedusaHeads" else ""
            raise LeapDecodeError(
                f"{path} holds {arch}{what}, not an EAGLE-3 head: pass the "
                "folder `leapdecode train eagle` wrote"
            )
        try:
            d2t = state.pop("d2t")
            ids = d2t + torch.arange(len(d2t))
            head = cls(
                c["hidden_size"],
                c["target_hidden_size"],
                c["num_attention_heads"],
                c["num_key_value_heads"],
                c["head_dim"],
                c["intermediate_size"],
                c["vocab_size"],
                ids,
                tuple(c["eagle_aux_hidden_state_layer_ids"]),
                c["rope_theta"],
                c["max_position_embeddings"],
                c["rms_norm_eps"],
                int(c.get("pard_max_k", -1)) if c.get("parallel_drafting") else 0,
                int(c.get("pard_token", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise LeapDecodeError(
                f"{path} lacks or mangles {e} for an EAGLE head: retrain with `leapdecode train eagle`"
            ) from None
        if head.parallel and not (
            head.parallel >= 1 and 0 <= head.pard_token < head.vocab_size
        ):  # a mask token outside the vocabulary would fail at the first step
            raise LeapDecodeError(
                f"{path}: a parallel head needs pard_max_k >= 1 and a pard_token in "
                f"0..{head.vocab_size - 1} (it has {c.get('pard_max_k')!r}, "
                f"{c.get('pard_token')!r}): retrain it with `leapdecode train peagle`"
            )
        try:
            head.load_state_dict(state)
        except RuntimeError as e:
            raise LeapDecodeError(f"the EAGLE weights in {path!r} do not fit: {e}") from None
        head.info = {k: v for k, v in c.items() if k in ("target", "training", "accuracy")}
        return head.eval()


class Eagle3Runner:
    """`Eagle3Head.qkv` and `.finish` for drafting, with fused weights (q|k|v and gate|up
    in one matmul each) in their plain layout for models/ops.py `linear` (not packed: a
    tree step is a handful of rows of a small head, where per-op overhead dominates)."""

    def __init__(self, head: Eagle3Head) -> None:
        def lay(*ws: torch.Tensor) -> torch.Tensor:
            w = torch.cat([x.detach() for x in ws], dim=0)  # [out, in]
            return w.t().contiguous() if transposed(w) else w.contiguous()

        self.linear = linear
        self.heads, self.kv_heads, self.head_dim = head.heads, head.kv_heads, head.head_dim
        self.eps = head.eps
        self.fc = lay(head.fc.weight)
        self.in_norm = head.input_layernorm.weight.detach()
        self.hid_norm = head.hidden_norm.weight.detach()
        self.wqkv = lay(head.q_proj.weight, head.k_proj.weight, head.v_proj.weight)
        self.wo = lay(head.o_proj.weight)
        self.post_norm = head.post_attention_layernorm.weight.detach()
        self.w_gate_up = lay(head.gate_proj.weight, head.up_proj.weight)
        self.w_down = lay(head.down_proj.weight)
        self.norm = head.norm.weight.detach()
        self.lm_head = lay(head.lm_head.weight)
        self.cos, self.sin = head.cos, head.sin
        self.parallel, self.pard_token = head.parallel, head.pard_token
        if head.parallel:
            self.mask_feature = head.mask_feature().detach()  # [hidden]

    def _rms(self, x, w):
        return F.rms_norm(x, w.shape, w, self.eps)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return self.linear(aux.flatten(-2), self.fc, None)

    def qkv(self, g, emb, positions):
        b, t, _ = g.shape
        h, hkv, d = self.heads, self.kv_heads, self.head_dim
        x = torch.cat([self._rms(emb, self.in_norm), self._rms(g, self.hid_norm)], dim=-1)
        qkv = self.linear(x, self.wqkv, None)  # [B, T, (H + 2 H_kv) D]
        qk = qkv[..., : (h + hkv) * d].view(b, t, h + hkv, d)
        qk = apply_rope(qk, self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2))
        v = qkv[..., (h + hkv) * d :].view(b, t, hkv, d)
        return qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2), v.transpose(1, 2)

    def finish(self, g, q, keys, values, mask):
        a = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
        b, _, t, _ = q.shape
        r = g + self.linear(a.transpose(1, 2).reshape(b, t, -1), self.wo, None)
        gate, up = self.linear(self._rms(r, self.post_norm), self.w_gate_up, None).chunk(2, -1)
        o = r + self.linear(F.silu(gate) * up, self.w_down, None)
        return o, self.linear(self._rms(o, self.norm), self.lm_head, None)
