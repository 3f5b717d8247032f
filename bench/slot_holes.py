"""What a hole between KV slots costs a forward of the native backend.

Decode (T = 1) and verify (T = 9) steps of 7 sequences over L cached tokens each, in
consecutive slots, in slots with one hole between them (slot 3 empty), and 8 consecutive
slots; the medians of 30 forwards each. Before the slot range was read as a view with the
holes as dummy rows, a hole gathered every row's cache at every layer (L = 800, T = 1:
39.8 ms against 18.9 ms consecutive; with the view 22.2 ms).

    python bench/slot_holes.py [--cached 800]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from leapdecode.models import load_model
from leapdecode.paths import resolve_models
from leapdecode.threads import set_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached", type=int, default=800, help="cached tokens per sequence")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    set_threads(args.threads)
    model = load_model(resolve_models(None, None)[0])
    length = min(args.cached, model.max_context - 16)
    model.allocate(8, length + 16)
    for s in range(8):
        model.forward(torch.randint(0, model.vocab_size, (1, length)), torch.tensor([s]))

    def median_ms(slots: torch.Tensor, new: int) -> float:
        times = []
        for _ in range(30):
            model.truncate(slots, torch.full((len(slots),), length, dtype=torch.long))
            tokens = torch.randint(0, model.vocab_size, (len(slots), new))
            t0 = time.perf_counter()
            model.forward(tokens, slots)
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times)

    print(f"{length} cached tokens per sequence; median ms of 30 forwards")
    for new in (1, 9):
        a = median_ms(torch.arange(7), new)
        b = median_ms(torch.tensor([0, 1, 2, 4, 5, 6, 7]), new)
        c = median_ms(torch.arange(8), new)
        print(f"T={new}: 7 consecutive {a:.1f}  7 with a hole {b:.1f}  8 consecutive {c:.1f}")


if __name__ == "__main__":
    main()
