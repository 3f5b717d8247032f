"""A target's features for training a head on it, computed once and kept on disk in shards.

On a CPU a real target's forward is most of a head's training step (the 1.5B in bfloat16
prefills about 170 tokens/s here, a head layer trains faster), and a head sees its windows
for more than one epoch: so the windows are run once through the native backend, in the
target's own dtype, and kept:

    FOLDER/manifest.json             target fingerprint, aux layers, context, windows, dtype
    FOLDER/shard_00000.safetensors   tokens [N, T+1] int32   (the window)
                                     aux    [N, T+1, n, H]   (residual stream entering each
                                                              aux layer, the model's dtype)
                                     final  [N, T+1, H]      (after the final norm)
                                     greedy [N, T+1] int32   (the target's argmax after each)

The labels are made at training time from `final` through the target's LM head restricted to
the head's draft vocabulary (`Labeller`): the full logits of a window (151,936 a token for
Qwen2.5) would take 150 MB a window on disk. The stream is cut into windows of T+1 tokens
and window i is the i-th of them in a fixed shuffled order (`window_slots`): any number of
windows spreads over the whole stream, and asking for more later keeps the first ones. A
shard is written whole (temporary file, then renamed), so a killed extraction continues at
the first shard missing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import LeapDecodeError

SHARD_WINDOWS = 32  # windows a shard (about 100 MB for the 1.5B at 256 tokens a window)
MANIFEST = "manifest.json"


@dataclass
class Features:
    """One batch of windows' features (the tensors a shard holds, for B windows)."""

    tokens: torch.Tensor  # [B, T+1] long
    aux: torch.Tensor  # [B, T+1, n, H]
    final: torch.Tensor  # [B, T+1, H]
    greedy: torch.Tensor  # [B, T+1] long: the target's next token after each index

    @staticmethod
    def cat(parts: list[Features]) -> Features:
        """Several windows' Features as one batch."""
        return Features(*(torch.cat([getattr(p, k) for p in parts]) for k in vars(parts[0])))


def _shard_size(i: int, windows: int, per_shard: int) -> int:
    """The windows shard i holds when a folder holds `windows` in all."""
    return min(windows, (i + 1) * per_shard) - i * per_shard


def window_slots(n_tokens: int, width: int) -> np.ndarray:
    """The stream's windows of `width` tokens in the order they are taken: window i starts
    at window_slots(...)[i] * width (a fixed shuffle of every whole window)."""
    return np.random.default_rng(0).permutation(n_tokens // width)


def shard_path(folder: str, i: int) -> str:
    return os.path.join(folder, f"shard_{i:05d}.safetensors")


@torch.inference_mode()
def window_features(model, window: torch.Tensor, layers: tuple[int, ...]) -> Features:
    """window [T+1] -> its Features (one row) from a native model whose cache has a slot 0
    of at least T+1 tokens."""
    from ..models.base import HiddenRequest

    slot = torch.zeros(1, dtype=torch.long)
    model.truncate(slot, torch.zeros(1, dtype=torch.long))
    out = model.forward_outputs(window[None], slot, HiddenRequest(tuple(layers), final=True))
    return Features(
        window[None].long(),
        out.hidden,  # [1, T+1, n, H]
        out.final,  # [1, T+1, H]
        out.logits.argmax(-1),  # [1, T+1]
    )


def extract(
    model,
    tokens: np.ndarray,
    folder: str,
    *,
    layers: tuple[int, ...],
    context: int,
    windows: int,
    stamp: dict,
    shard_windows: int = SHARD_WINDOWS,
) -> dict:
    """Write the features of the stream's first `windows` windows of context + 1 tokens (in
    `window_slots` order) into `folder` (see the module), continuing after the shards already
    there; returns the
    manifest. `stamp` (train/teacher.py `fingerprint`) must match a folder's to continue it."""
    from tqdm import tqdm

    width = context + 1
    windows = min(windows, len(tokens) // width)
    if windows < 1:
        raise LeapDecodeError(
            f"the token stream has {len(tokens)} tokens, fewer than one window of {width}: "
            "lower --context or add data"
        )
    manifest = {
        "stamp": stamp,
        "layers": list(layers),
        "context": context,
        "windows": windows,
        "shard_windows": shard_windows,
        "dtype": str(model.dtype).removeprefix("torch."),
        "hidden": int(model.config.hidden_size),
    }
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, MANIFEST)
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        if {k: v for k, v in old.items() if k != "windows"} != {
            k: v for k, v in manifest.items() if k != "windows"
        }:
            raise LeapDecodeError(
                f"{folder} holds features of another target or other settings: delete it or "
                "pass another --features folder"
            )
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(path + ".tmp", path)
    model.allocate(1, width)
    slots = window_slots(len(tokens), width)
    shards = -(-windows // shard_windows)
    todo = [  # missing, or a last shard of a shorter extraction (more windows asked now)
        i
        for i in range(shards)
        if _windows_in(shard_path(folder, i)) != _shard_size(i, windows, shard_windows)
    ]
    left = sum(_shard_size(i, windows, shard_windows) for i in todo)
    bar = tqdm(total=windows, initial=windows - left, unit="window", desc="target features")
    for i in todo:
        lo, hi = i * shard_windows, min(windows, (i + 1) * shard_windows)
        parts = []
        for w in range(lo, hi):
            at = int(slots[w]) * width
            window = torch.from_numpy(np.asarray(tokens[at : at + width], np.int64))
            parts.append(window_features(model, window, layers))
            bar.update(1)
        _write_shard(folder, i, parts)
    bar.close()
    return manifest


def _windows_in(path: str) -> int:
    """The windows a shard file holds (0: none there)."""
    if not os.path.isfile(path):
        return 0
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return int(f.get_slice("tokens").get_shape()[0])


def _write_shard(folder: str, i: int, parts: list[Features]) -> None:
    from safetensors.torch import save_file

    f = Features.cat(parts)
    tensors = {"tokens": f.tokens.int(), "aux": f.aux, "final": f.final, "greedy": f.greedy.int()}
    tmp = shard_path(folder, i) + ".tmp"
    save_file(tensors, tmp)
    os.replace(tmp, shard_path(folder, i))


class FeatureShards:
    """The shards of a features folder, read a window at a time (memory-mapped)."""

    def __init__(self, folder: str) -> None:
        path = os.path.join(folder, MANIFEST)
        if not os.path.isfile(path):
            raise LeapDecodeError(
                f"{folder} holds no target features (no {MANIFEST}): extract them first"
            )
        with open(path) as f:
            self.manifest = json.load(f)
        self.folder = folder
        self.per_shard = int(self.manifest["shard_windows"])
        self.windows = int(self.manifest["windows"])
        self.layers = tuple(self.manifest["layers"])
        missing = [
            i
            for i in range(-(-self.windows // self.per_shard))
            if _windows_in(shard_path(folder, i)) != _shard_size(i, self.windows, self.per_shard)
        ]
        if missing:
            raise LeapDecodeError(
                f"{folder} lacks {len(missing)} shard(s) (first: {missing[0]}): run the "
                "extraction again to finish it"
            )
        self._open: dict[int, object] = {}

    def _shard(self, i: int):
        from safetensors import safe_open

        if i not in self._open:
            self._open[i] = safe_open(shard_path(self.folder, i), framework="pt")
        return self._open[i]

    def window(self, w: int) -> Features:
        s = self._shard(w // self.per_shard)
        j = w % self.per_shard
        get = {k: s.get_slice(k)[j : j + 1] for k in ("tokens", "aux", "final", "greedy")}
        return Features(get["tokens"].long(), get["aux"], get["final"], get["greedy"].long())

    def batch(self, step: int, batch: int, seed: int) -> Features:
        """Batch number `step`: `batch` windows drawn as a pure function of (seed, step), so
        a resumed run sees the batches it would have seen."""
        rng = np.random.default_rng([seed, step])
        return Features.cat(
            [self.window(int(w)) for w in rng.integers(0, self.windows, size=batch)]
        )


class Labeller:
    """The target's next-token distribution over a head's draft vocabulary, from its final
    hidden state: softmax(final @ W[draft_ids]^T), W the target's LM head (the distribution
    over all tokens renormalised to the draft's, as train/eagle.py's labels)."""

    def __init__(self, lm_head: torch.Tensor, draft_ids: torch.Tensor) -> None:
        self.rows = lm_head[draft_ids].float()  # [Vd, H]
        to_draft = torch.full((lm_head.shape[0],), -1, dtype=torch.long)
        to_draft[draft_ids] = torch.arange(len(draft_ids))
        self.to_draft = to_draft  # [V] target id -> draft id, -1 outside

    @torch.no_grad()
    def __call__(self, final: torch.Tensor, greedy: torch.Tensor):
        """final [B, T, H], greedy [B, T] target ids -> (q [B, T, Vd], greedy as draft ids)."""
        q = torch.softmax(final.float() @ self.rows.t(), dim=-1)
        return q, self.to_draft[greedy]
