"""Medusa-1 heads (Cai et al. 2024): K extra heads on the target's last hidden state.

Head i (1-based) guesses the token i positions after the target's own next token: from the
hidden state h_t that the target's LM head turns into token t+1, head i scores token
t+1+i. Each head is one residual block, z = h + SiLU(W h + b) (W zero-initialised, so a
fresh head starts as the target's own LM head), followed by the target's LM head, shared
and frozen: the heads hold only K x (hidden^2 + hidden) weights.

A folder holds `config.json` (`medusa_num_heads`, `hidden_size`, the measured accuracy of
each head by rank and the static tree built from it) and `model.safetensors`
(`medusa_head.{i}.0.linear.weight` / `.bias`, the Medusa repository's names for the block).

The static tree: candidates are paths of ranks, (r1, .., rd) meaning "head 1's r1-th best
token, then head 2's r2-th best, ..". Assuming the heads err independently, a path is
accepted with probability prod_i acc[i][r_i]; the tree is grown greedily by that value
(every node's parent is already in it), so its first k nodes are the best tree of k nodes
under that model.
"""

from __future__ import annotations

import heapq
import os

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LeapDecodeError
from .head_files import read_folder, write_folder

MAX_TREE = 64


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden: int) -> None:
        super().__init__()
        if not 1 <= num_heads <= 16:
            raise LeapDecodeError(f"medusa heads: 1..16, got {num_heads}")
        self.num_heads = num_heads
        self.hidden = hidden
        # nn.Sequential so the weights are named medusa_head.{i}.0.linear.* as in Medusa
        self.medusa_head = nn.ModuleList(nn.Sequential(ResBlock(hidden)) for _ in range(num_heads))
        self.accuracy: list[list[float]] = []  # [head][rank], measured on held-out text
        self.tree: list[tuple[int, ...]] = default_tree(num_heads)
        self.info: dict = {}

    def forward(self, h: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """h [..., hidden] (the target's normed last hidden state) -> [..., n, hidden], the
        first n heads (default all); the caller applies the target's LM head."""
        heads = self.medusa_head if n is None else self.medusa_head[:n]
        return torch.stack([head(h) for head in heads], dim=-2)

    # -------------------------------------------------------------- files
    def save(self, out: str, extra: dict | None = None) -> None:
        state = {k: v.float() for k, v in self.state_dict().items()}
        config = {
            "architectures": ["MedusaHeads"],
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": 1,
            "hidden_size": self.hidden,
            "accuracy_by_rank": self.accuracy,
            "tree": [list(p) for p in self.tree],
            **self.info,
            **(extra or {}),
        }
        write_folder(out, state, config)

    @classmethod
    def load(cls, path: str) -> MedusaHeads:
        cfg, state = read_folder(path, "a Medusa heads", "medusa")
        cfg_path = os.path.join(path, "config.json")
        if "medusa_num_heads" not in cfg:
            raise LeapDecodeError(f"{cfg_path} has no medusa_num_heads: not a Medusa heads folder")
        try:
            heads = cls(int(cfg["medusa_num_heads"]), int(cfg["hidden_size"]))
        except (KeyError, TypeError, ValueError) as e:
            raise LeapDecodeError(
                f"{cfg_path} lacks or mangles {e}: retrain with `leapdecode train medusa`"
            ) from None
        try:
            heads.load_state_dict(state)
        except (RuntimeError, OSError) as e:
            raise LeapDecodeError(f"the Medusa weights in {path!r} do not fit: {e}") from None
        heads.accuracy = cfg.get("accuracy_by_rank") or []
        if cfg.get("tree"):
            heads.tree = [tuple(p) for p in cfg["tree"]]
            seen: set[tuple[int, ...]] = set()
            for p in heads.tree:
                if (
                    not p
                    or len(p) > heads.num_heads
                    or any(r < 0 for r in p)
                    or (len(p) > 1 and p[:-1] not in seen)
                    or p in seen
                ):
                    raise LeapDecodeError(
                        f"the tree in {cfg_path} is not valid at {list(p)} (each path of "
                        "ranks must follow its parent, once, within the heads): retrain with "
                        "`leapdecode train medusa` or fix the list"
                    )
                seen.add(p)
        heads.info = {k: v for k, v in cfg.items() if k in ("target", "training")}
        return heads.eval()


def build_tree(accuracy: list[list[float]], size: int = MAX_TREE) -> list[tuple[int, ...]]:
    """The `size` most probable rank paths, best first, each after its parent (see above).

    accuracy[i][r]: how often head i+1's rank-r token is the right one. A head's accuracy
    falls with rank by construction; measured values are sorted so that noise in a short
    measurement never puts a low rank before a higher one."""
    if not accuracy:
        return []
    accuracy = [sorted(a, reverse=True) for a in accuracy]
    heap = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0])) if accuracy[0][r] > 0]
    heapq.heapify(heap)
    tree: list[tuple[int, ...]] = []
    while heap and len(tree) < size:
        neg, path = heapq.heappop(heap)
        tree.append(path)
        depth = len(path)
        if depth < len(accuracy):
            for r, a in enumerate(accuracy[depth]):
                if a > 0:
                    heapq.heappush(heap, (neg * a, (*path, r)))
    return tree


def default_tree(num_heads: int, ranks: int = 4) -> list[tuple[int, ...]]:
    """A tree from assumed accuracies (0.6, 0.15, 0.08, 0.05 by rank, each head 0.8x the
    one before), for heads not yet measured."""
    acc = [[a * 0.8**i for a in (0.6, 0.15, 0.08, 0.05)[:ranks]] for i in range(num_heads)]
    return build_tree(acc)


def tree_layout(tree: list[tuple[int, ...]], k: int) -> tuple[list[int], list[int], list[int]]:
    """The first k nodes of a rank-path tree as (depth - 1 = head index, rank, parent input
    index) lists, parents as tree.py lays them out (0 = the root)."""
    nodes = tree[:k]
    index = {p: i + 1 for i, p in enumerate(nodes)}
    heads = [len(p) - 1 for p in nodes]
    ranks = [p[-1] for p in nodes]
    parents = [index[p[:-1]] if len(p) > 1 else 0 for p in nodes]
    return heads, ranks, parents
