"""How many torch threads for small models: decode tokens/s with 1, 2, ... threads, on an
idle machine and with busy processes beside it (as a user's other jobs would be).

    python bench/threads.py [--threads 1,2] [--busy 0,2] [--out docs/threads.md]

Each setting runs in a fresh process (torch's pool is sized once per process), plain greedy
decoding of the embedded target, 96 new tokens, median of 5 runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, statistics, sys, time
from leapdecode import LeapDecoder
from leapdecode.demo import DEMO_PROMPT
dec = LeapDecoder.from_pretrained(sys.argv[1], threads=int(sys.argv[2]))
dec.generate(DEMO_PROMPT, max_new_tokens=8)
rates = []
for _ in range(5):
    t0 = time.perf_counter()
    out = dec.generate(DEMO_PROMPT, max_new_tokens=96)
    rates.append(len(out.token_ids) / (time.perf_counter() - t0))
print(json.dumps(statistics.median(rates)))
"""


def run(target: str, threads: int, busy: int) -> float:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(0.5)
        out = subprocess.run([sys.executable, "-c", CHILD, target, str(threads)],
                             capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for h in hogs:
            h.kill()


def main() -> None:
    from leapdecode.paths import TARGET_NAME, default_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=default_model(TARGET_NAME))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--busy", default="0,2")
    ap.add_argument("--out", default=os.path.join("docs", "threads.md"))
    args = ap.parse_args()
    threads = [int(x) for x in args.threads.split(",")]
    busy = [int(x) for x in args.busy.split(",")]
    rows = {}
    for b in busy:
        for t in threads:
            rows[(t, b)] = statistics.median(run(args.target, t, b) for _ in range(2))
            print(f"threads {t}, busy processes {b}: {rows[(t, b)]:.1f} tokens/s", flush=True)
    lines = ["# Threads for small models", "",
             f"Greedy decoding of `{os.path.relpath(args.target)}`, 96 new tokens, tokens/s "
             f"(median of 5 runs in each of 2 processes), {os.cpu_count()} cores. "
             "`busy` = processes spinning on the CPU beside it. `python bench/threads.py`.", "",
             "| threads | " + " | ".join(f"busy {b}" for b in busy) + " |",
             "|---|" + "---|" * len(busy)]  # fmt: skip
    for t in threads:
        lines.append(f"| {t} | " + " | ".join(f"{rows[(t, b)]:.1f}" for b in busy) + " |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
