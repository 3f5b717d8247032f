"""What a step costs on this machine: the target's verify forward and a draft forward.

Profiled once (when `auto` is first needed, or at server start) on a grid of batch sizes B,
new tokens a row T and cached prefixes L, the table kept and interpolated, because a small
model's forward is flat in T while per-operator overhead dominates and linear once arithmetic
does, so no single line fits it:

    verify_s(B, R, L) = table(B, R / B, L)  (R = the step's forward rows)
    draft_s(B)        = table_d(B)          (one draft forward of B one-token rows)
    catch_up_s(n)     = n * per-token cost  (the draft feeding n tokens it has not seen)

and kept honest afterwards from every measured step (served forwards do not keep the
profile's level or shape): a correction factor per batch size and a relative one per (B, T)
cell, and moving averages of each method's proposal cost and of the step's fixed overhead.
Why each of these, with the measurements: docs/auto_planning.md.

The profile keeps to a time budget (PROFILE_BUDGET_S): it measures the grid's forwards
cheapest first while the time left covers the next, and prices the rest from them (on a CPU
a real model's largest forwards alone can take longer than the budget); a cached prefix is
set as a length over the cache, not computed (a forward costs the same over any keys).
It is saved under the cache root (`leapdecode.cache.cache_dir("profiles")`), keyed by the
model folders, dtype, device, threads, CPU, slots and torch version (`profile_key`), and read
back by later engines: delete the folder to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time

import numpy as np
import torch

from ..cache import cache_dir
from ..models.base import CausalLM

log = logging.getLogger("leapdecode")

BATCHES = (1, 2, 4, 8, 16, 32, 64)
NEW_TOKENS = (1, 2, 4, 8, 16)
CONTEXTS = (256, 768)  # cached prefixes profiled (clamped to each model's context)
CACHED = CONTEXTS[0]  # the draft's profiled prefix (and the target's shorter one)
SHAPE_RATE = 0.1  # how fast a (B, T) cell of the shape correction follows its steps
PROFILE_BUDGET_S = 20.0  # the profile's time: fewer points and repeats where steps are slow
REPEAT_S = 0.1  # a point's repeats stop once they have taken this long
# a saved profile of another version is measured again; 2: exact rows attend in one call a
# layer (a verify step's cost changed), and quantized weights key their own profile; 3: a
# draft's rows are no longer exact (its step's cost changed), and the key says which are;
# 4: a quantized draft's catch-up runs a dequantized copy from 8 rows (cheaper a token)
PROFILE_VERSION = 4


def _prefix(model: CausalLM, batch: int, cached: int) -> None:
    """Give slots 0..batch-1 a prefix of `cached` tokens: set as their length where the model
    has a preallocated cache (the keys' values do not change a forward's cost), else run."""
    slots = torch.arange(batch)
    lens = getattr(getattr(model, "cache", None), "lens", None)
    if lens is not None and getattr(model.cache, "max_len", 0) >= cached:
        lens[slots] = cached
        return
    model.truncate(slots, torch.zeros(batch, dtype=torch.long))
    tokens = torch.randint(0, model.vocab_size, (batch, cached))
    model.forward(tokens, slots, logits_at=torch.full((batch,), cached - 1))


def _time_forward(
    model: CausalLM, batch: int, new: int, cached: int, reps: int, spend: float = float("inf")
) -> float:
    """Fastest of `reps` forwards (the least disturbed by anything else on the machine),
    fewer once they have taken `spend` seconds."""
    slots = torch.arange(batch)
    best, spent = float("inf"), 0.0
    for _ in range(reps):
        model.truncate(slots, torch.full((batch,), cached, dtype=torch.long))
        tokens = torch.randint(0, model.vocab_size, (batch, new))
        t0 = time.perf_counter()
        model.forward(tokens, slots)
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
        if spent >= spend:
            break
    return best


def grid_contexts(target: CausalLM, draft: CausalLM | None, cached: int) -> tuple[int, list[int]]:
    """The draft's profiled prefix, and the target's (a short one, and a long one where its
    context allows)."""
    for m in (target, draft) if draft is not None else (target,):
        cached = max(1, min(cached, m.max_context // 2 - max(NEW_TOKENS)))
    longest = target.max_context - max(NEW_TOKENS) - 1
    contexts = [cached] + [c for c in CONTEXTS[1:] if cached < min(c, longest)]
    return cached, sorted({min(c, longest) for c in contexts})


def _fill_in(table: np.ndarray, seen: np.ndarray, batches, news) -> np.ndarray:
    """A context's [batches, news] table with the cells not measured (seen False) priced
    from the measured ones: the measured cell of most rows below and left of it, plus the
    cost a row adds (the line from the one-row cell through the measured cell of most
    rows)."""
    rows = np.outer(batches, news)  # [B, T]
    top = np.unravel_index(np.argmax(np.where(seen, rows, -1)), rows.shape)
    per_row = (table[top] - table[0, 0]) / max(1, rows[top] - 1) if rows[top] > 1 else table[0, 0]
    out = table.copy()
    for i in range(len(batches)):
        for j in range(len(news)):
            if seen[i, j]:
                continue
            under = np.where(seen[: i + 1, : j + 1], rows[: i + 1, : j + 1], -1)
            near = np.unravel_index(np.argmax(under), under.shape)
            out[i, j] = table[near] + per_row * (rows[i, j] - rows[near])
    return out


class CostModel:
    def __init__(
        self, batches=(1,), news=(1, 2), verify=((1.0, 2.0),), draft=(0.5,), contexts=(256,)
    ) -> None:
        """verify[c][i][j]: seconds for batches[i] sequences x news[j] tokens over cached
        prefixes of contexts[c] tokens (a 2-d table: one context); draft[i]: one draft
        forward of batches[i] sequences. The default is a made-up placeholder."""
        self.batches = np.asarray(batches, dtype=float)
        self.news = np.asarray(news, dtype=float)
        self.contexts = np.asarray(contexts, dtype=float)
        verify = np.asarray(verify, dtype=float)
        if verify.ndim == 2:
            verify = verify[None]
        if verify.shape != (len(self.contexts), len(self.batches), len(self.news)):
            raise ValueError(
                f"verify table {verify.shape} does not match the grid "
                f"{len(contexts)} x {len(batches)} x {len(news)}"
            )
        self.verify = verify  # [len(contexts), len(batches), len(news)]
        self._by_batch: dict[int, list[np.ndarray]] = {}  # batch -> its rows of the table
        self.draft = np.asarray(draft, dtype=float)  # [len(batches)]
        self.verify_scale = 1.0  # measured / table over all steps (the factor of unserved sizes)
        self.batch_scale = np.ones(len(self.batches))  # [len(batches)] the same by batch size
        self.batch_seen = np.zeros(len(self.batches))  # [len(batches)] steps (weighted) behind it
        # [len(batches), len(news)] what is left over, relative to the batch size's factor
        self.verify_shape = np.ones((len(self.batches), len(self.news)))
        self.draft_scale = 1.0
        self.draft_token_s = 0.0  # the draft's prefill cost per token (catching up)
        self.propose: dict[str, float] = {}  # method -> seconds of one proposal (measured)
        self.overhead_s = 0.0  # seconds of a step outside its forwards and proposals
        self.profile_s = 0.0  # seconds the profile took (0: made up, or read back)
        self.measured = 0  # forward shapes it measured (the others priced from them)

    @classmethod
    def profile(
        cls,
        target: CausalLM,
        draft: CausalLM | None,
        max_batch: int,
        cached: int = CACHED,
        reps: int = 3,
        budget_s: float = PROFILE_BUDGET_S,
    ) -> CostModel:
        """Measure on the engine's own (allocated, empty) caches; leaves them empty.

        Within budget_s: the draft first, then the target's cells cheapest first (fewest
        rows; the short prefix before the long at equal rows), each while the time left
        covers what it should cost (priced from the cells measured so far); a cell is
        repeated up to `reps` times while its repeats take under REPEAT_S. The cells left
        are priced from the measured ones (`_fill_in`); a prefix with none measured is
        left out."""
        t_start = time.perf_counter()
        batches = sorted({b for b in BATCHES if b <= max_batch} | {max_batch})
        cached, contexts = grid_contexts(target, draft, cached)
        news = list(NEW_TOKENS)
        d = np.zeros(len(batches))
        token_s = 0.0
        if draft is not None:
            token_s = cls._draft_token_s(draft, cached, reps)
            for i, b in enumerate(batches):
                _prefix(draft, b, cached)
                d[i] = _time_forward(draft, b, 1, cached, reps, REPEAT_S)
            draft.truncate(torch.arange(max_batch), torch.zeros(max_batch, dtype=torch.long))
        # cheapest first: (rows, context) where a prefix is only a length (a preallocated
        # cache), else (context, rows) so that each context's prefix is computed once
        cheap = getattr(getattr(target, "cache", None), "lens", None) is not None
        cells = [(b * t, c, i, j) for c in range(len(contexts))
                 for i, b in enumerate(batches) for j, t in enumerate(news)]  # fmt: skip
        cells.sort(key=lambda x: (x[0], x[1]) if cheap else (x[1], x[0]))
        table = np.zeros((len(contexts), len(batches), len(news)))
        seen = np.zeros(table.shape, dtype=bool)
        deadline = t_start + budget_s
        filled = None
        _prefix(target, batches[-1], contexts[0])
        _time_forward(target, 1, 1, contexts[0], 1)  # the first forward pays one-off costs
        one = most = None  # (rows, seconds) of the one-row cell and the measured of most rows
        for rows, c, i, j in cells:
            if one is not None:
                per_row = (most[1] - one[1]) / (most[0] - 1) if most[0] > 1 else one[1]
                guess = one[1] + per_row * (rows - 1)
                guess *= reps if guess * reps < REPEAT_S else 1
                if time.perf_counter() + guess > deadline:
                    break
            if filled != c:
                _prefix(target, batches[-1], contexts[c])
                filled = c
            took = _time_forward(target, batches[i], news[j], contexts[c], reps, REPEAT_S)
            table[c, i, j], seen[c, i, j] = took, True
            if one is None:
                one = (rows, took)
            if most is None or rows >= most[0]:
                most = (rows, took)
        target.truncate(torch.arange(max_batch), torch.zeros(max_batch, dtype=torch.long))
        keep = [c for c in range(len(contexts)) if seen[c, 0, 0]]
        table = np.stack([_fill_in(table[c], seen[c], batches, news) for c in keep])
        contexts = [contexts[c] for c in keep]
        # a forward never gets cheaper with more rows or a longer prefix: smooth out noise
        for axis in (2, 1, 0):
            table = np.maximum.accumulate(table, axis=axis)
        out = cls(batches, news, table, np.maximum.accumulate(d), contexts)
        out.draft_token_s = token_s
        out.profile_s = time.perf_counter() - t_start
        out.measured = int(seen.sum())
        log.info(
            "profiled the step costs in %.1f s (%d of %d forward shapes measured)",
            out.profile_s, out.measured, seen.size,
        )  # fmt: skip
        return out

    @staticmethod
    def _draft_token_s(draft: CausalLM, cached: int, reps: int) -> float:
        """The draft's prefill cost a token (its catch-up): a short prompt where that alone
        takes REPEAT_S (a slow draft), else the best of `reps` prompts of `cached` tokens."""
        slot = torch.arange(1)
        best = float("inf")
        for n in (min(16, cached), *(cached,) * reps):
            draft.truncate(slot, torch.zeros(1, dtype=torch.long))
            tokens = torch.randint(0, draft.vocab_size, (1, n))
            t0 = time.perf_counter()
            draft.forward(tokens, slot, logits_at=torch.tensor([n - 1]))
            took = time.perf_counter() - t0
            if n < cached and took >= REPEAT_S:
                return took / n
            if n == cached:
                best = min(best, took / n)
        draft.truncate(slot, torch.zeros(1, dtype=torch.long))
        return best

    # ------------------------------------------------------------ saved profiles
    def profile_dict(self) -> dict:
        """What `profile` measured (not what the steps taught it since)."""
        return {
            "batches": self.batches.tolist(),
            "new_tokens": self.news.tolist(),
            "contexts": self.contexts.tolist(),
            "verify_s": self.verify.tolist(),
            "draft_s": self.draft.tolist(),
            "draft_token_s": self.draft_token_s,
        }

    @classmethod
    def from_profile(cls, d: dict) -> CostModel:
        out = cls(d["batches"], d["new_tokens"], d["verify_s"], d["draft_s"], d["contexts"])
        out.draft_token_s = float(d["draft_token_s"])
        return out

    @classmethod
    def load(cls, target: CausalLM, draft: CausalLM | None, max_batch: int) -> CostModel | None:
        """The profile saved for these models on this machine (`profile_key`), or None."""
        key = profile_key(target, draft, max_batch)
        if key is None:
            return None
        path = _profile_path(key)
        try:
            with open(path) as f:
                saved = json.load(f)
            if saved.get("key") != key:
                return None
            out = cls.from_profile(saved["profile"])
        except (OSError, ValueError, KeyError, TypeError):  # none, or unreadable: measure
            return None
        out.profile_s = 0.0
        log.info("step costs read from %s", path)
        return out

    def save(self, target: CausalLM, draft: CausalLM | None, max_batch: int) -> str | None:
        """Keep this profile for later engines on the same models and machine; returns the
        file (None: not saved, for models without a folder or where the cache is read-only)."""
        key = profile_key(target, draft, max_batch)
        if key is None:
            return None
        path = _profile_path(key)
        body = {"key": key, "profile": self.profile_dict(), "profile_s": self.profile_s}
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(body, f)
            os.replace(tmp, path)  # whole or not at all, whoever reads it meanwhile
        except OSError as e:
            log.warning("could not save the step-cost profile in %s: %s", path, e)
            return None
        return path

    @staticmethod
    def _weights(grid: np.ndarray, x: float) -> list[tuple[int, float]]:
        """(grid index, weight) pairs that interpolate linearly at x, clamped at the ends."""
        if x <= grid[0]:
            return [(0, 1.0)]
        if x >= grid[-1]:
            return [(len(grid) - 1, 1.0)]
        i = int(np.searchsorted(grid, x, side="right")) - 1
        w = float((x - grid[i]) / (grid[i + 1] - grid[i]))
        return [(i, 1.0 - w), (i + 1, w)]

    def _level(self, batch: int) -> float:
        """The learnt measured / table factor at `batch` sequences."""
        scales = np.where(self.batch_seen > 0, self.batch_scale, self.verify_scale)
        return float(sum(w * scales[i] for i, w in self._weights(self.batches, batch)))

    def _shape_by_new(self, batch: int) -> np.ndarray:
        """[len(news)] the learnt shape correction at `batch` sequences."""
        return sum(w * self.verify_shape[i] for i, w in self._weights(self.batches, batch))

    def _interp_batch(self, values: np.ndarray, batch: float) -> np.ndarray | float:
        """Linear in the batch size between grid points, extrapolated linearly past the last."""
        b = self.batches
        if len(b) == 1:
            return values[0] * batch / b[0]
        if batch >= b[-1]:
            slope = (values[-1] - values[-2]) / (b[-1] - b[-2])
            return values[-1] + slope * (batch - b[-1])
        i = int(np.searchsorted(b, batch, side="right")) - 1
        i = max(0, min(i, len(b) - 2))
        w = (batch - b[i]) / (b[i + 1] - b[i])
        return values[i] * (1 - w) + values[i + 1] * w

    def _by_new(self, batch: int, context: float | None) -> np.ndarray:
        """[len(news)] seconds of `batch` sequences x each grid T over `context` cached
        tokens (None: the shortest profiled), linear in the context between the profiled
        ones, extrapolated linearly past the longest, the shortest's below it."""
        tables = self._by_batch.get(batch)  # the profiled table never changes: kept per B
        if tables is None:
            tables = [self._interp_batch(t, batch) for t in self.verify]  # [len(contexts)] x [T]
            for t in tables:
                t.flags.writeable = False  # shared by every later call
            self._by_batch[batch] = tables
        c = self.contexts
        if context is None or len(c) == 1 or context <= c[0]:
            return tables[0]
        i = min(int(np.searchsorted(c, context)) - 1, len(c) - 2)
        w = (context - c[i]) / (c[i + 1] - c[i])
        return tables[i] * (1 - w) + tables[i + 1] * w

    def _table_at(self, batch: int, per_seq: np.ndarray, context: float | None) -> np.ndarray:
        """The profiled table at `batch` sequences and each per_seq new tokens over `context`,
        uncorrected: linear in per_seq between the grid's T, and past the last."""
        by_new = self._by_new(batch, context)  # [len(news)]
        n = self.news
        slope = (by_new[-1] - by_new[-2]) / (n[-1] - n[-2])
        inside = np.interp(per_seq, n, by_new)
        return np.where(per_seq >= n[-1], by_new[-1] + slope * (per_seq - n[-1]), inside)

    def _table_s(self, batch: int, per_seq: float, context: float | None) -> float:
        return float(self._table_at(batch, np.asarray(per_seq, dtype=float), context))

    def _verify_at(self, batch: int, rows: np.ndarray, context: float | None) -> np.ndarray:
        """verify_s at each of `rows` (new tokens in all): the table, corrected by the learnt
        level of this batch size and the shape left over."""
        per_seq = np.maximum(1.0, rows / max(1, batch))
        shape = np.interp(per_seq, self.news, self._shape_by_new(batch))  # clamped
        return self._level(batch) * shape * self._table_at(batch, per_seq, context)

    def verify_s(self, batch: int, rows: float, context: float | None = None) -> float:
        """One verify forward: `batch` sequences, `rows` new tokens in all, over cached
        prefixes of up to `context` tokens."""
        return float(self._verify_at(batch, np.asarray(rows, dtype=float), context))

    def verify_curve(self, batch: int, max_rows: int, context: float | None = None) -> np.ndarray:
        """[max_rows + 1] verify_s(batch, R, context) for R = 0 .. max_rows, in one pass."""
        return self._verify_at(batch, np.arange(max_rows + 1, dtype=float), context)

    def catch_up_s(self, tokens: int | np.ndarray) -> float | np.ndarray:
        """The draft model feeding `tokens` tokens it has not seen yet."""
        return self.draft_scale * self.draft_token_s * tokens

    def draft_s(self, batch: int) -> float:
        return float(self.draft_curve(batch, batch)[0])

    def draft_curve(self, lo: int, hi: int) -> np.ndarray:
        """[hi - lo + 1] draft_s(B) for B = lo .. hi, in one pass."""
        x = np.arange(lo, hi + 1, dtype=float)
        b, d = self.batches, self.draft
        if len(b) == 1:
            out = d[0] * x / b[0]
        else:  # _interp_batch's arithmetic, element by element
            i = np.clip(np.searchsorted(b, x, side="right") - 1, 0, len(b) - 2)
            w = (x - b[i]) / (b[i + 1] - b[i])
            slope = (d[-1] - d[-2]) / (b[-1] - b[-2])
            out = np.where(x >= b[-1], d[-1] + slope * (x - b[-1]), d[i] * (1 - w) + d[i + 1] * w)
        return np.where(x == 0, 0.0, self.draft_scale * out)

    def observe(
        self,
        batch: int,
        rows: int,
        verify_s: float,
        draft_steps: int,
        draft_batch: int,
        propose_s: float,
        catch_up: int = 0,
        rate: float = 0.05,
        context: float | None = None,
    ) -> None:
        """Fold one measured step into the correction factors (catch_up: tokens the draft
        model fed before drafting; context: the batch's longest sequence)."""
        per_seq = max(1.0, rows / max(1, batch))
        table = self._table_s(batch, per_seq, context)
        if table > 0 and verify_s > 0:
            self.verify_scale += rate * (min(4.0, max(0.25, verify_s / table)) - self.verify_scale)
            # the batch size's factor, net of the shape
            shape = float(np.interp(per_seq, self.news, self._shape_by_new(batch)))
            ratio = min(4.0, max(0.25, verify_s / (table * shape)))
            for i, wb in self._weights(self.batches, batch):
                old = self.batch_scale[i] if self.batch_seen[i] > 0 else self.verify_scale
                w = wb * max(rate, 1.0 / (1.0 + self.batch_seen[i]))
                self.batch_scale[i] = old + w * (ratio - old)
                self.batch_seen[i] += wb
            # the cells around (B, T): what the factor still misses, at a higher rate (each
            # cell sees fewer steps than the factor does)
            rel = min(4.0, max(0.25, verify_s / (self._level(batch) * shape * table)))
            for i, wb in self._weights(self.batches, batch):
                for j, wn in self._weights(self.news, per_seq):
                    self.verify_shape[i, j] *= 1.0 + SHAPE_RATE * wb * wn * (rel - 1.0)
        if draft_steps and draft_batch:
            predicted = draft_steps * self.draft_s(draft_batch) / self.draft_scale
            predicted += self.draft_token_s * catch_up
            if predicted > 0 and propose_s > 0:
                ratio = min(4.0, max(0.25, propose_s / predicted))
                self.draft_scale += rate * (ratio - self.draft_scale)

    def propose_s(self, method: str, default: float = 0.0) -> float:
        """Seconds of one proposal by `method` (the default until one is measured)."""
        return self.propose.get(method, default)

    def observe_step(
        self, propose_s: dict[str, float], overhead_s: float, rate: float = 0.1
    ) -> None:
        """Fold one step's measured proposal times (draft model excepted: see `observe`)
        and its overhead into their moving averages; the first measurement is taken whole."""
        for method, seconds in propose_s.items():
            old = self.propose.get(method)
            self.propose[method] = seconds if old is None else old + rate * (seconds - old)
        if overhead_s > 0:
            old = self.overhead_s
            self.overhead_s = overhead_s if old == 0 else old + rate * (overhead_s - old)

    def as_dict(self) -> dict:
        """What was measured, and what the steps taught it since."""
        return self.profile_dict() | {
            "verify_scale": self.verify_scale,
            "batch_scale": np.where(
                self.batch_seen > 0, self.batch_scale, self.verify_scale
            ).tolist(),
            "verify_shape": self.verify_shape.tolist(),
            "draft_scale": self.draft_scale,
            "propose_s": dict(self.propose),
            "overhead_s": self.overhead_s,
        }


# ---------------------------------------------------------------- profile keys
def _folder(path: str | None) -> dict | None:
    """A model folder's identity: its config's digest and its weight files' names, sizes and
    modification times (None: no folder)."""
    if not path or not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, "config.json"), "rb") as f:
            config = hashlib.sha256(f.read()).hexdigest()
        weights = []
        for name in sorted(os.listdir(path)):
            if name.endswith((".safetensors", ".bin", ".pt", ".gguf")):
                st = os.stat(os.path.join(path, name))
                weights.append([name, st.st_size, st.st_mtime_ns])
    except OSError:
        return None
    return {"config": config, "weights": weights}


def _model(model: CausalLM) -> dict | None:
    folder = _folder(getattr(model, "path", None))
    if folder is None:
        return None
    compiled = getattr(model, "compiled", None)
    head = getattr(model, "head_ids", None)
    return {
        **folder,
        "backend": model.name,
        "dtype": str(model.dtype),
        "quantize": getattr(model, "quantize", None),
        "device": str(model.device),
        "head": None if head is None else int(len(head)),
        "exact_rows": bool(getattr(model, "exact_rows", False)),
        "compiled": None
        if compiled is None
        else [type(compiled).__name__, bool(getattr(compiled, "kernel", False))],
    }


def _processor(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_key(target: CausalLM, draft: CausalLM | None, max_batch: int) -> dict | None:
    """What a saved profile is valid for (None: a model without a folder, never saved)."""
    t = _model(target)
    d = None if draft is None else _model(draft)
    if t is None or (draft is not None and d is None):
        return None
    key = {
        "version": PROFILE_VERSION,
        "target": t,
        "draft": d,
        "max_num_seqs": int(max_batch),
        "contexts": grid_contexts(target, draft, CACHED),  # what the profile measures
        "grid": [BATCHES, NEW_TOKENS, CONTEXTS],
        "threads": torch.get_num_threads(),
        "processor": _processor(target.device),
        "torch": torch.__version__,
        "budget_s": PROFILE_BUDGET_S,
    }
    return json.loads(json.dumps(key))  # as it reads back (lists, not tuples)


def _profile_path(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(cache_dir("profiles"), f"{digest}.json")
