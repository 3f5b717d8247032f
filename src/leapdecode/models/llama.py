"""Native PyTorch Llama family: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

Plain functions over plain tensors: per layer one fused qkv matmul, one fused gate/up
matmul, rotary embedding on q and k together, and `scaled_dot_product_attention` over the
preallocated cache (grouped-query attention without repeating keys).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import LeapDecodeError
from . import exact_attention as exact
from .base import CausalLM, ForwardOutput, HiddenRequest
from .kv_cache import KVCache
from .ops import Packed
from .ops import dense as _dense
from .ops import lay_out as _lay_out
from .ops import linear as _linear
from .ops import rms_norm as _rms_norm
from .ops import transposed as _transposed
from .quant import check_scheme, quantize
from .rope import apply_rope, rope_tables

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# From this many new tokens a row, a model whose rows need not be exact (a draft) runs them
# through a quantized weight's dequantized copy (quant.py): the int4 kernel's cost grows with
# every 4 rows; on the 0.5B, 8 rows took 55 ms through it against 53 ms through the copy.
LOOSE_MANY_ROWS = 8
CAUSAL = object()  # _masks: a fresh prompt's plain causal attention (SDPA's is_causal)


class NativeUnsupported(Exception):
    """The native backend cannot run this checkpoint; the loader falls back to transformers."""


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    # matrices shown as [in, out]; laid out as _transposed says, or ops.Packed (oneDNN)
    wqkv: torch.Tensor | Packed  # [hidden, (H + 2 H_kv) D]
    bqkv: torch.Tensor | None  # [(H + 2 H_kv) D]
    qk_norm: torch.Tensor | None  # [H + H_kv, D] (Qwen3)
    wo: torch.Tensor | Packed  # [H D, hidden]
    bo: torch.Tensor | None
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor | Packed  # [hidden, 2 I]
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor | Packed  # [I, hidden]
    b_down: torch.Tensor | None
    window: int | None  # sliding-window size, None for full attention


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise NativeUnsupported("no *.safetensors weights")
    return [os.path.join(path, n) for n in files]


def _give_back_freed() -> None:
    """Return the memory freed so far to the system (glibc keeps large freed blocks in its
    heap once its mmap threshold has grown: the bfloat16 originals of float32 weights stayed
    resident beside them)."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


def _damaged(full: str, why: str) -> LeapDecodeError:
    return LeapDecodeError(
        f"the weights file {full!r} is damaged or incomplete ({why}): copy or download it again"
    )


class SafetensorsReader:
    """The tensors of a folder's *.safetensors files, each read when taken, into memory of its
    own (plain reads, no file mapping): a loader that converts, fuses or transposes a tensor
    and drops the original as it goes then holds one copy of the weights at most (tensors
    mapped from the file, as safetensors' load_file makes them, kept the whole file resident
    beside the fused and converted copies)."""

    def __init__(self, path: str) -> None:
        self.files: dict[str, object] = {}
        self.index: dict[str, tuple[str, str, list[int], int, int]] = {}
        for full in _weight_files(path):
            try:
                size = os.path.getsize(full)
                with open(full, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    if not 0 < n <= size - 8:
                        raise ValueError(f"header length {n}")
                    header = json.loads(f.read(n))
            except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
                raise _damaged(full, f"{type(e).__name__}: {e}") from None
            base = 8 + n
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                try:
                    start, end = (int(x) for x in info["data_offsets"])
                    entry = (full, str(info["dtype"]), [int(x) for x in info["shape"]])
                except (KeyError, TypeError, ValueError) as e:
                    raise _damaged(full, f"{name}: {type(e).__name__}: {e}") from None
                if not 0 <= start <= end or base + end > size:
                    raise _damaged(full, f"{name} ends past the file's {size} bytes")
                self.index[name] = (*entry, base + start, base + end)

    def names(self) -> list[str]:
        """The tensors not taken yet."""
        return list(self.index)

    def take(self, name: str) -> torch.Tensor | None:
        """Read tensor `name` (None when the files lack it); it leaves the reader."""
        entry = self.index.pop(name, None)
        if entry is None:
            return None
        full, dtype, shape, start, end = entry
        if dtype not in _DTYPES:
            raise NativeUnsupported(f"weights stored as {dtype}")
        out = torch.empty(shape, dtype=_DTYPES[dtype])
        nbytes = out.numel() * out.element_size()
        if nbytes != end - start:
            raise _damaged(full, f"{name}: {end - start} bytes for shape {shape} of {dtype}")
        if nbytes:
            f = self.files.get(full)
            if f is None:
                f = self.files[full] = open(full, "rb")  # noqa: SIM115 - closed by close()
            f.seek(start)
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            if f.readinto(view) != nbytes:
                raise _damaged(full, f"{name} is cut short")
        return out

    def drop(self, name: str) -> None:
        """Leave tensor `name` unread (it counts as taken)."""
        self.index.pop(name, None)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's *.safetensors files, by name."""
    with SafetensorsReader(path) as reader:
        return {name: reader.take(name) for name in reader.names()}


def _layer_windows(config, n_layers: int) -> list[int | None]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if config.model_type == "mistral" and window:
        return [window] * n_layers
    if getattr(config, "use_sliding_window", False) and window:
        return [window] * n_layers
    return [None] * n_layers


class NativeLlama(CausalLM):
    name = "native"

    def __init__(
        self,
        path: str,
        config,
        device: torch.device,
        dtype: torch.dtype,
        quantize: str | None = None,
    ) -> None:
        if config.model_type not in SUPPORTED_TYPES:
            raise NativeUnsupported(f"model_type {config.model_type!r}")
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            raise NativeUnsupported(f"activation {config.hidden_act!r}")
        if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
            raise NativeUnsupported("partial rotary embeddings")
        self.config = config
        self.device = device
        self.dtype = dtype
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps = config.rms_norm_eps
        self.path = path
        check_scheme(quantize, dtype, device)
        self.quantize = quantize  # None, "int8" or "int4" (weight-only: models/quant.py)
        self.model_max_context = self.max_context = int(config.max_position_embeddings)
        with SafetensorsReader(path) as reader:
            self._load(reader, config)
        try:
            cos, sin = rope_tables(config, self.head_dim, self.max_context, dtype)
        except NotImplementedError as e:
            raise NativeUnsupported(str(e)) from e
        self.cos, self.sin = cos.to(device), sin.to(device)
        self.windows = {layer.window for layer in self.layers}
        # Attention (and the KV cache) runs in float32 on CPU whatever the weights' dtype:
        # PyTorch's CPU attention kernel is about 3x slower in bfloat16 for one query row,
        # and float32 holds bfloat16/float16 keys and values exactly.
        self.attn_dtype = torch.float32 if device.type == "cpu" else dtype
        # bfloat16 / float16 on CPU: every query row of a decode or verify step computes the
        # bits the decode step of its token computes (logits tie often here): exact_attention
        self.exact_rows = device.type == "cpu" and dtype != torch.float32
        self.cache: KVCache | None = None
        self.compiled = None  # a CompiledForward once compile() is called

    def compile(self, max_rows: int = 1, keep: tuple[int, ...] = (), warm_up: bool = True) -> float:
        """Run the steps (decode, verify, tree; up to compiled.MAX_TOKENS new tokens a row)
        and fresh prompts (prefill) through torch.compile (models/compiled.py); a prompt
        after a cached prefix and rows too scattered stay eager. `keep`: the hidden-state
        layers the step always returns (the union of what the proposers want). Warm-up
        compiles the graphs for up to `max_rows` rows at once with a progress bar; returns
        its seconds. The compiled code is cached under ~/.cache/leapdecode/inductor."""
        if len(self.windows) > 1 or None not in self.windows:
            raise LeapDecodeError(
                "--compile covers full-attention models; this one has sliding-window layers: "
                "leave --compile out"
            )
        from .compiled import CompiledForward

        if self.quantize:
            raise LeapDecodeError(
                f"--compile runs plain weights, and this model is quantized ({self.quantize}): "
                "leave out --compile or --quantize"
            )
        self._unpack()  # the graph takes plain weights (inductor lays them out itself)
        self.compiled = CompiledForward(self, keep)
        return self.compiled.warm_up(max_rows) if warm_up else 0.0

    # ----------------------------------------------------------------- weights
    def _lay(self, w: torch.Tensor, head: bool = False):
        """A weight [out, in] in its layout for _linear: quantized, packed, or plain."""
        if self.quantize:
            scheme = "int8" if head else self.quantize  # the LM head keeps 8 bits
            # the head's prompt rows are the few that logits are asked of: no copy for it
            return quantize(w, scheme, self.dtype, prompt_copy=not head)
        return _lay_out(w)

    def _unpack(self) -> None:
        """Every weight back in its plain layout (ops.Packed -> tensor), one at a time."""
        for layer in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                setattr(layer, name, _dense(getattr(layer, name)))
        full_head = self.lm_head is self._full_lm_head
        self._full_lm_head = _dense(self._full_lm_head)
        self.lm_head = self._full_lm_head if full_head else _dense(self.lm_head)
        _give_back_freed()

    @property
    def reads_own_context(self) -> bool:
        return self.compiled is not None and self.compiled.kernel

    def _load(self, reader: SafetensorsReader, config) -> None:
        """The weights, read, converted and fused a tensor at a time (each original dropped
        once used: loading holds one copy of the weights, and a layer's in flight)."""

        def raw(name: str, required: bool = True) -> torch.Tensor | None:
            t = reader.take(name)  # on the CPU, in the file's dtype
            if t is None and required:
                raise NativeUnsupported(f"missing weight {name}")
            return t

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = raw(name, required)
            return None if t is None else t.to(device=self.device, dtype=self.dtype)

        def cat(*ts):
            return None if any(t is None for t in ts) else torch.cat(ts, dim=0).contiguous()

        def cat_t(*ts):
            """Matrices [out_i, in] fused along out ([sum out_i, in]), converted as they are
            copied into the result (no intermediate copy of the converted weights)."""
            w = ts[0]
            if len(ts) == 1 and (w.dtype, w.device) == (self.dtype, self.device):
                return w.contiguous()
            out = torch.empty(
                (sum(t.shape[0] for t in ts), w.shape[1]), dtype=self.dtype, device=self.device
            )
            at = 0
            for t in ts:
                out[at : at + t.shape[0]].copy_(t)
                at += t.shape[0]
            return out

        self.embed = take("model.embed_tokens.weight")
        self.vocab_size = self.embed.shape[0]
        self.layers: list[LayerWeights] = []
        windows = _layer_windows(config, config.num_hidden_layers)
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            q_norm = take(p + "self_attn.q_norm.weight", required=False)
            k_norm = take(p + "self_attn.k_norm.weight", required=False)
            qk_norm = None
            if q_norm is not None and k_norm is not None:
                qk_norm = torch.cat(
                    [q_norm.expand(self.n_heads, -1), k_norm.expand(self.n_kv_heads, -1)]
                ).contiguous()
            self.layers.append(
                LayerWeights(
                    attn_norm=take(p + "input_layernorm.weight"),
                    wqkv=self._lay(cat_t(*(raw(p + f"self_attn.{n}_proj.weight") for n in "qkv"))),
                    bqkv=cat(*(take(p + f"self_attn.{n}_proj.bias", False) for n in "qkv")),
                    qk_norm=qk_norm,
                    wo=self._lay(cat_t(raw(p + "self_attn.o_proj.weight"))),
                    bo=take(p + "self_attn.o_proj.bias", False),
                    mlp_norm=take(p + "post_attention_layernorm.weight"),
                    w_gate_up=self._lay(
                        cat_t(raw(p + "mlp.gate_proj.weight"), raw(p + "mlp.up_proj.weight"))
                    ),
                    b_gate_up=cat(
                        take(p + "mlp.gate_proj.bias", False), take(p + "mlp.up_proj.bias", False)
                    ),
                    w_down=self._lay(cat_t(raw(p + "mlp.down_proj.weight"))),
                    b_down=take(p + "mlp.down_proj.bias", False),
                    window=windows[i],
                )
            )
            _give_back_freed()
        self.norm = take("model.norm.weight")
        tied = getattr(config, "tie_word_embeddings", False)
        lm_head = reader.drop("lm_head.weight") if tied else raw("lm_head.weight", False)
        if lm_head is None:
            lm_head = self.embed
        full = cat_t(lm_head)  # [V, hidden]
        self._full_lm_head = self.lm_head = self._lay(full, head=True)
        # kept to slice (restrict_head) only where the laid-out head cannot give it back
        # exactly (quantized), or costs nothing (a tied head: the embeddings themselves)
        self._full_head = full if self.quantize or full is self.embed else None
        self.head_ids = None
        _give_back_freed()
        leftover = [n for n in reader.names() if "rotary_emb" not in n]
        if leftover:
            raise NativeUnsupported(f"unexpected weights such as {leftover[0]}")

    def restrict_head(self, token_ids: torch.Tensor | None) -> None:
        """Logits for `token_ids` only (FR-Spec: a draft rarely needs the long tail of the
        vocabulary, and its output matmul is a large share of a small model's step)."""
        if token_ids is None:
            self.lm_head, self.head_ids = self._full_lm_head, None
            return
        full = self._full_head  # [V, hidden]
        if full is None:  # read back from the laid-out head: packed, or plain
            head = self._full_lm_head
            full = (
                head.dense()
                if isinstance(head, Packed)
                else head.t()
                if _transposed(head)
                else head
            )
        ids = token_ids.to(device=full.device, dtype=torch.long)
        self.lm_head = self._lay(full[ids].contiguous(), head=True)
        self.head_ids = ids

    # ------------------------------------------------------- for speculator heads
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings of `ids` [...] -> [..., hidden]."""
        return F.embedding(ids.to(self.device), self.embed)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The target's (full) LM head on normed hidden states [..., hidden] -> [..., V]."""
        return _linear(x.to(self.dtype), self._full_lm_head, None).float()

    # ------------------------------------------------------------------- cache
    def kv_bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.n_kv_heads * self.head_dim * self.attn_dtype.itemsize

    def allocate(self, n_slots: int, max_len: int) -> None:
        c = self.cache
        if c is not None and c.n_slots == n_slots and c.max_len >= max_len:
            c.lens.zero_()
            return
        self.cache = c = None  # the old cache is freed before the new one is made
        self.cache = KVCache(
            len(self.layers),
            n_slots,
            self.n_kv_heads,
            max_len,
            self.head_dim,
            self.attn_dtype,
            self.device,
            room=exact.padded_span(max_len) if self.exact_rows else max_len,
        )

    def lengths(self, slots: torch.Tensor) -> torch.Tensor:
        return self.cache.lens[slots.cpu()]

    def truncate(self, slots: torch.Tensor, new_lengths: torch.Tensor) -> None:
        self.cache.lens[slots.cpu()] = new_lengths.cpu()

    def keep(
        self, slots: torch.Tensor, base: torch.Tensor, picked: torch.Tensor, n: torch.Tensor
    ) -> None:
        self.cache.compact(slots.cpu(), base.cpu(), picked.cpu(), n.cpu())

    # ----------------------------------------------------------------- forward
    def _masks(self, start, n_new, span, tree_mask, query_pos, same_start: bool) -> dict:
        """Boolean attention masks [B, 1, T, span] (True = attend), one per window size;
        None: every cached key is visible; CAUSAL: plain causal attention over the new tokens
        alone (a fresh prompt: SDPA's own causal path, about twice as fast as a mask at a few
        hundred tokens)."""
        windows = self.windows
        simple = tree_mask is None and n_new == 1 and same_start
        fresh = tree_mask is None and same_start and int(start[0]) == 0 and n_new > 1
        key = torch.arange(span)  # [S]
        masks = {}
        for window in windows:
            if (simple or fresh) and (window is None or span <= window):
                masks[window] = CAUSAL if fresh else None
                continue
            limit = start[:, None] + torch.arange(n_new)  # [B, T] cache index of each query
            allowed = key[None, None, :] <= limit[:, :, None]  # [B, T, S] causal
            key_pos = key[None, None, :]  # [1, 1, S] the position of each key
            if tree_mask is not None:
                # the cached prefix, then the new tokens as the tree says (batched)
                rel = key[None, None, :] - start[:, None, None]  # [B, 1, S] index among new
                inside = (rel >= 0) & (rel < n_new)
                tree = tree_mask.cpu().gather(2, rel.clamp(0, n_new - 1).expand(-1, n_new, -1))
                allowed = (rel < 0) | (inside & tree)  # [B, T, S]
                # a tree node sits at start + depth, not at its cache index
                node_pos = query_pos.cpu().gather(1, rel[:, 0].clamp(0, n_new - 1))[:, None]
                key_pos = torch.where(inside, node_pos, key_pos)  # [B, 1, S]
            if window is not None:
                allowed &= key_pos > (query_pos.cpu()[:, :, None] - window)
            masks[window] = allowed[:, None].to(self.device)
        return masks

    @staticmethod
    def _widen(mask, rows: torch.Tensor, width: int, n_new: int, span: int):
        """A [B, 1, n_new, S] mask (None: all visible; n_new: a row's query rows, exact rows'
        padded ones included) placed at `rows` of a [width, 1, n_new, S] one whose other rows
        (holes) see every key (their outputs are dropped); CAUSAL stays CAUSAL (the same for
        every row, holes included)."""
        if mask is CAUSAL:  # the same for every row, holes included
            return mask
        full = torch.ones(width, 1, n_new, span, dtype=torch.bool, device=rows.device)
        if mask is not None:
            full.index_copy_(0, rows, mask)
        return full

    def _run_compiled(
        self,
        tokens,
        slots_cpu,
        start,
        positions,
        tree_mask,
        logits_at,
        want: HiddenRequest | None,
        same_start: bool,
    ) -> ForwardOutput | None:
        """The step through the compiled forward, or None when its slots are too scattered
        (then it runs eager). Rows are the slot range lo .. hi, the holes as dummy rows."""
        batch, n_new = tokens.shape
        compiled = self.compiled
        lo, hi = int(slots_cpu.min()), int(slots_cpu.max())
        width = hi - lo + 1
        if len(set(slots_cpu.tolist())) != batch:
            return None
        kernel = compiled.uses_kernel(batch, n_new)
        if not kernel and width > max(2 * batch, batch + 1):
            return None
        consecutive = torch.equal(slots_cpu, torch.arange(lo, lo + batch))
        # the graph's own attention reads a slot range: holes between the rows run as dummy
        # rows; the kernel (attention_cpu) reads any slots
        padded = not kernel and not consecutive
        rows = slots_cpu - lo  # [B] each row's place in the range
        causal = torch.ones(n_new, n_new, dtype=torch.bool).tril()  # [T, T]
        allowed = causal.expand(batch, n_new, n_new) if tree_mask is None else tree_mask.cpu()
        bias = torch.zeros(batch, 1, n_new, n_new, dtype=self.attn_dtype)
        bias.masked_fill_(~allowed[:, None], float("-inf"))  # [B, 1, T, T]
        if padded:  # the holes: token 0 at position 0, nothing cached, causal
            pad = torch.zeros(width, n_new, dtype=tokens.dtype)
            tokens = pad.index_copy(0, rows, tokens.cpu())
            positions = pad.index_copy(0, rows, positions)
            start = torch.zeros(width, dtype=start.dtype).index_copy(0, rows, start)
            holes = torch.zeros(width, 1, n_new, n_new, dtype=self.attn_dtype)
            holes.masked_fill_(~causal, float("-inf"))
            bias = holes.index_copy(0, rows, bias)
        dev = self.device
        if want and not set(want.layers) <= set(compiled.keep):  # a new graph (compiles)
            compiled.keep = tuple(sorted(set(compiled.keep) | set(want.layers)))
        # copies made here, in inference mode, whoever made the inputs: a graph's guards
        # tell an inference tensor from a plain one, and would compile the step again
        final, hidden, new_k, new_v = compiled(
            tokens.to(dev, copy=True),
            positions.to(dev, copy=True),
            slots_cpu if kernel else torch.arange(lo, lo + width),
            start,
            bias.to(dev),
        )
        if hidden is not None:  # [B, T, len(keep), hidden] -> the layers asked for
            picked = [compiled.keep.index(i) for i in want.layers] if want else []
            hidden = hidden[:, :, picked] if picked else None
        cache = self.cache
        at = (rows if padded else torch.arange(batch)).to(dev)  # the real rows' outputs
        if consecutive and same_start:  # one slice write for every layer
            p0 = int(start[0])
            cache.k[:, lo : lo + batch, :, p0 : p0 + n_new] = new_k
            cache.v[:, lo : lo + batch, :, p0 : p0 + n_new] = new_v
        else:
            real_start = start[rows] if padded else start
            write_pos = (real_start[:, None] + torch.arange(n_new)).to(dev)  # [B, T]
            dst = (slots_cpu.to(dev)[:, None], slice(None), write_pos)
            # [L, B, H_kv, T, D] -> [B, T, L, H_kv, D], the advanced-index dimensions first
            cache.k[(slice(None), *dst)] = new_k[:, at].permute(1, 3, 0, 2, 4)
            cache.v[(slice(None), *dst)] = new_v[:, at].permute(1, 3, 0, 2, 4)
            start = real_start
        cache.lens[slots_cpu] = start + n_new
        if padded:
            final = final[at]
            hidden = hidden[at] if hidden is not None else None
        x = final
        if logits_at is not None:
            x = x[torch.arange(batch, device=dev), logits_at.to(dev)][:, None]  # [B, 1, hidden]
        logits = _linear(x, self.lm_head, None).float()  # [B, T, V]
        return ForwardOutput(logits, hidden, final if want is not None and want.final else None)

    def _run_fresh(self, tokens, slots_cpu, positions, logits_at, want) -> ForwardOutput:
        """Prompts with nothing cached before them, through the compiled prefill graph; their
        keys and values written to the cache in one call for every layer."""
        batch, n_new = tokens.shape
        compiled, cache, dev = self.compiled, self.cache, self.device
        if want and not set(want.layers) <= set(compiled.keep):  # a new graph (compiles)
            compiled.keep = tuple(sorted(set(compiled.keep) | set(want.layers)))
        final, hidden, new_k, new_v = compiled.fresh(
            tokens.to(dev, copy=True), positions.to(dev, copy=True)
        )  # [B, T, hidden], [B, T, len(keep), hidden] or None, [L, B, H_kv, T, D] x 2
        rows = slots_cpu.to(dev)
        cache.k[:, rows, :, :n_new] = new_k
        cache.v[:, rows, :, :n_new] = new_v
        cache.lens[slots_cpu] = n_new
        if hidden is not None:
            picked = [compiled.keep.index(i) for i in want.layers] if want else []
            hidden = hidden[:, :, picked] if picked else None
        x = final
        if logits_at is not None:
            x = x[torch.arange(batch, device=dev), logits_at.to(dev)][:, None]  # [B, 1, hidden]
        logits = _linear(x, self.lm_head, None).float()
        return ForwardOutput(logits, hidden, final if want is not None and want.final else None)

    def _run_packed(self, tokens, slots_cpu, start, counts, want) -> ForwardOutput:
        """A chain step without its padding (the compiled forward's packed kernel): only
        each row's first counts[b] tokens run, packed row after row; the outputs come back
        padded ([B, T, ...]), a row's padding repeating its last real token's."""
        batch, n_new = tokens.shape
        compiled, cache, dev = self.compiled, self.cache, self.device
        real = torch.arange(n_new)[None] < counts[:, None]  # [B, T]
        cu = torch.zeros(batch + 1, dtype=torch.long)
        cu[1:] = counts.cumsum(0)
        write_pos = (start[:, None] + torch.arange(n_new))[real]  # [N] cache index of each token
        positions = write_pos.clamp(max=self.max_context - 1)
        if want and not set(want.layers) <= set(compiled.keep):  # a new graph (compiles)
            compiled.keep = tuple(sorted(set(compiled.keep) | set(want.layers)))
        final, hidden, new_k, new_v = compiled.ragged(
            tokens.cpu()[real][None].to(dev), positions[None].to(dev), slots_cpu, start, cu
        )  # [1, N, hidden], [1, N, len(keep), hidden] or None, [L, 1, H_kv, N, D] x 2
        slot_of = slots_cpu.repeat_interleave(counts).to(dev)  # [N]
        dst = (slice(None), slot_of, slice(None), write_pos.to(dev))
        cache.k[dst] = new_k[:, 0].permute(2, 0, 1, 3)  # [N, L, H_kv, D]
        cache.v[dst] = new_v[:, 0].permute(2, 0, 1, 3)
        cache.lens[slots_cpu] = start + counts
        # [B, T] each padded place's packed token: its own, or its row's last real one
        at = torch.minimum(cu[:-1, None] + torch.arange(n_new), (cu[1:] - 1)[:, None]).to(dev)
        logits = _linear(final[0], self.lm_head, None).float()[at]  # [B, T, V]
        if hidden is not None:
            picked = [compiled.keep.index(i) for i in want.layers] if want else []
            hidden = hidden[0][at][:, :, picked] if picked else None
        return ForwardOutput(
            logits, hidden, final[0][at] if want is not None and want.final else None
        )

    def forward(
        self, tokens, slots, tree_mask=None, position_offsets=None, logits_at=None, counts=None
    ):
        return self._run(tokens, slots, tree_mask, position_offsets, logits_at, None, counts).logits

    def forward_outputs(
        self,
        tokens,
        slots,
        hidden: HiddenRequest,
        tree_mask=None,
        position_offsets=None,
        logits_at=None,
        counts=None,
    ) -> ForwardOutput:
        bad = [i for i in hidden.layers if not 0 <= i <= len(self.layers)]
        if bad:
            raise LeapDecodeError(
                f"hidden state layer {bad[0]} does not exist: this model has layers "
                f"0..{len(self.layers)} (0 = embeddings, {len(self.layers)} = last layer's output)"
            )
        return self._run(tokens, slots, tree_mask, position_offsets, logits_at, hidden, counts)

    @property
    def packs_rows(self) -> int:
        if self.compiled is None or not self.compiled.kernel:
            return 0
        from .compiled import MAX_TOKENS

        return MAX_TOKENS

    @torch.inference_mode()
    def _run(
        self,
        tokens,
        slots,
        tree_mask,
        position_offsets,
        logits_at,
        want: HiddenRequest | None,
        counts=None,
    ) -> ForwardOutput:
        cache = self.cache
        if cache is None:
            raise RuntimeError("allocate() the cache before forward()")
        batch, n_new = tokens.shape
        slots_cpu = slots.cpu()
        start = cache.lens[slots_cpu]  # [B]
        span = int(start.max()) + n_new
        if span > cache.max_len:
            raise LeapDecodeError(
                f"sequence of {span} tokens exceeds the cache ({cache.max_len}); "
                "lower max_new_tokens or the prompt length"
            )
        write_pos = start[:, None] + torch.arange(n_new)  # [B, T] cache positions
        offsets = torch.arange(n_new)[None] if position_offsets is None else position_offsets.cpu()
        # Rotary positions; right-padding past the context reuses the last table row.
        positions = (start[:, None] + offsets).clamp(max=self.max_context - 1)  # [B, T]
        p0 = int(start[0])
        same_start = batch == 1 or bool((start == p0).all())
        self.last_packed = False
        if (
            counts is not None
            and self.packs_rows
            and batch > 1
            and self.compiled.fits(n_new)
            and tree_mask is None
            and position_offsets is None
            and logits_at is None
            and bool((counts.cpu() < n_new).any())
        ):
            self.last_packed = True
            return self._run_packed(tokens, slots_cpu, start, counts.cpu(), want)
        fresh = tree_mask is None and same_start and p0 == 0 and position_offsets is None
        if (
            self.compiled is not None
            and fresh
            and not self.compiled.fits(n_new)
            and all(w is None or span <= w for w in self.windows)
        ):
            return self._run_fresh(tokens, slots_cpu, positions, logits_at, want)
        if self.compiled is not None and self.compiled.fits(n_new):
            out = self._run_compiled(
                tokens, slots_cpu, start, positions, tree_mask, logits_at, want, same_start
            )
            if out is not None:
                return out
        # a fresh prompt runs SDPA's causal path (_masks: CAUSAL), shared by every method
        causal = fresh and n_new > 1 and any(w is None or span <= w for w in self.windows)
        exact_step = self.exact_rows and n_new <= exact.MAX_ROWS and not causal
        read_span, tree_index = span, None  # the keys attention reads; a tree's gather
        if not exact_step:
            masks = self._masks(start, n_new, span, tree_mask, positions, same_start)
        else:  # every row computes what the decode step of its token computes
            read_span = exact.padded_span(span)
            groups = self.n_heads // self.n_kv_heads
            if tree_mask is None:
                masks = exact.chain_masks(
                    start, n_new, read_span, positions, self.windows, groups, self.device
                )
            else:
                tree_index, masks = exact.tree_plan(
                    start, tree_mask, read_span, positions, self.windows, groups, self.device
                )
        first = int(slots_cpu[0])
        contiguous = first if torch.equal(slots_cpu, torch.arange(first, first + batch)) else None
        block = (contiguous, p0) if contiguous is not None and same_start else None
        # Slots with holes between them (a request left, or a newcomer prefills this step):
        # gathering their caches copies every row at every layer (a 7-row decode over 800
        # tokens took 2.1x a consecutive one), so attention runs over the slot range as a
        # view instead, the holes as dummy rows, when that adds at most one row per real one.
        lo, hi = int(slots_cpu.min()), int(slots_cpu.max())
        span_rows = None
        if (
            contiguous is None
            and tree_index is None
            and hi - lo + 1 <= 2 * batch
            and len(set(slots_cpu.tolist())) == batch
        ):
            span_rows = (slots_cpu - lo).to(self.device)  # [B] each row's place in the range
            width = hi - lo + 1
            rows = exact.query_rows(n_new * groups) if exact_step else n_new  # a mask's rows
            masks = {w: self._widen(m, span_rows, width, rows, read_span) for w, m in masks.items()}
        if exact_step:  # the float masks SDPA would make of these, once a step
            masks = {w: exact.additive(m) for w, m in masks.items()}
        # a prompt's rows (more than a verify step has): quantized weights run their
        # dequantized copy (a prompt batched with a longer one too: prefill is shared by every
        # method); rows that need not be exact (a draft's catch-up) from fewer
        prompt = n_new > exact.MAX_ROWS or (not self.exact_rows and n_new >= LOOSE_MANY_ROWS)
        dev_slots = slots.to(self.device)
        write_pos = write_pos.to(self.device)
        positions = positions.to(self.device)

        cos = self.cos[positions].unsqueeze(2)  # [B, T, 1, D]
        sin = self.sin[positions].unsqueeze(2)
        h, d = self.n_heads, self.head_dim
        h_kv = self.n_kv_heads
        x = F.embedding(tokens.to(self.device), self.embed)  # [B, T, hidden]
        keep = set(want.layers) if want else set()
        kept: dict[int, torch.Tensor] = {}  # layer index -> residual stream entering it
        for i, layer in enumerate(self.layers):
            if i in keep:
                kept[i] = x
            a = _rms_norm(x, layer.attn_norm, self.eps)
            qkv = _linear(a, layer.wqkv, layer.bqkv, prompt)  # [B, T, (H + 2 H_kv) D]
            qk = qkv[..., : (h + h_kv) * d].view(batch, n_new, h + h_kv, d)
            v = qkv[..., (h + h_kv) * d :].view(batch, n_new, h_kv, d)
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk.float(), (d,), None, self.eps).to(self.dtype) * layer.qk_norm
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :, :h], qk[:, :, h:]
            cache.write(i, dev_slots, write_pos, k, v, block)
            q = q.transpose(1, 2).to(self.attn_dtype)  # [B, H, T, D]
            if span_rows is None:
                keys, values = cache.read(i, dev_slots, read_span, contiguous)  # [B, H_kv, S, D]
            else:  # the slot range as a view; the holes' queries are zeros, dropped after
                keys, values = cache.read(i, None, read_span, lo, width)  # [width, H_kv, S, D]
                q = q.new_zeros(width, *q.shape[1:]).index_copy_(0, span_rows, q)
            mask = masks[layer.window]
            causal = mask is CAUSAL
            if tree_index is not None:
                o = exact.attend_tree(q, keys, values, tree_index, mask)
            elif exact_step:
                o = exact.attend(q, keys, values, mask)
            else:
                o = F.scaled_dot_product_attention(
                    q,
                    keys,
                    values,
                    attn_mask=None if causal else mask,
                    is_causal=causal,
                    enable_gqa=h != h_kv,
                )  # [B or width, H, T, D]
            if span_rows is not None:
                o = o.index_select(0, span_rows)
            o = o.transpose(1, 2).reshape(batch, n_new, h * d).to(self.dtype)
            x = x + _linear(o, layer.wo, layer.bo, prompt)
            m = _rms_norm(x, layer.mlp_norm, self.eps)
            gate, up = _linear(m, layer.w_gate_up, layer.b_gate_up, prompt).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, layer.w_down, layer.b_down, prompt)
        cache.lens[slots_cpu] = start + n_new
        if len(self.layers) in keep:
            kept[len(self.layers)] = x
        hidden = final = None
        if kept:
            hidden = torch.stack([kept[i] for i in want.layers], dim=2)  # [B, T, n, hidden]
        if want is not None and want.final:
            final = _rms_norm(x, self.norm, self.eps)  # [B, T, hidden]
        if logits_at is not None:
            x = x[torch.arange(batch, device=x.device), logits_at.to(x.device)][
                :, None
            ]  # [B, 1, hidden]
            x = _rms_norm(x, self.norm, self.eps)
        elif final is not None:
            x = final
        else:
            x = _rms_norm(x, self.norm, self.eps)
        logits = _linear(x, self.lm_head, None).float()  # [B, T, V]
        return ForwardOutput(logits, hidden, final)
