"""The copy into row blocks alone (`weight_sync/row_blocks.cpp`), per weight shape, against a memcpy
of the same bytes and against torch's own transposing copy (where the kernel cannot be built).

    python scripts/bench_row_blocks.py [--json] [--hidden 1024] [--repeats 10]

Shapes of one Qwen2-style layer at `--hidden` (fused q/k/v, o, fused gate/up, down) and its
embedding (vocabulary 151,936), fp32, into row blocks of 64 rows. Each time is the best of
`--repeats` warm copies; the kernel on one thread and on two (a sync borrows the cores of the
ranks waiting for it, `weight_sync.cores`), the memcpy on one. Small weights stay in the cache
between repeats (a sync of a whole model would not), so their ratios flatter the memcpy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

from bench_weight_sync import Memcpy, best_s  # noqa: E402
from siirl_dag.cli.json_stdout import json_stdout  # noqa: E402
from siirl_dag.weight_sync import row_blocks  # noqa: E402
from siirl_dag.weight_sync.cores import borrowed  # noqa: E402

BLOCK = 64


def measure(name: str, rows: int, cols: int, repeats: int) -> dict:
    src = torch.randn(rows, cols)
    packed = torch.empty(rows // BLOCK, cols, BLOCK)
    memcpy = Memcpy(src.nbytes).best_s(repeats)
    copies = {"torch": (1, row_blocks.copy_with_torch, max(1, repeats // 3)),
              1: (1, row_blocks.copy_into, repeats), 2: (2, row_blocks.copy_into, repeats)}
    times = {}
    for key, (threads, copy, runs) in copies.items():
        with borrowed(threads):
            copy(packed, src)  # warm: the kernel built, the memory touched
            times[key] = best_s(lambda: copy(packed, src), runs)
    return {"weight": name, "shape": [rows, cols], "MiB": round(src.nbytes / 2**20, 1), "memcpy_ms": round(1e3 * memcpy, 2),
            "kernel_1_thread_ratio": round(times[1] / memcpy, 2), "kernel_2_threads_ratio": round(times[2] / memcpy, 2),
            "torch_ratio": round(times["torch"] / memcpy, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    h = args.hidden
    inter = h * 11 // 4 // BLOCK * BLOCK  # Qwen2's ratio, in whole blocks
    shapes = {"q/k/v": (h + h // 2, h), "o": (h, h), "gate/up": (2 * inter, h), "down": (h, inter),
              "embedding": (151936, h)}
    with json_stdout(args.json) as emit:
        if row_blocks._kernel() is None:
            raise SystemExit("the row-block kernel could not be built here (see the warning above)")
        results = [measure(name, rows, cols, args.repeats) for name, (rows, cols) in shapes.items()]
        if args.json:
            emit({"hidden": h, "block": BLOCK, "results": results})
            return
        for r in results:
            print(f"{r['weight']:>9} {str(tuple(r['shape'])):>14} {r['MiB']:7.1f} MiB: memcpy {r['memcpy_ms']:7.2f} ms; "
                  f"kernel {r['kernel_1_thread_ratio']:.2f}x on 1 thread, {r['kernel_2_threads_ratio']:.2f}x on 2; "
                  f"torch's copy {r['torch_ratio']:.2f}x")


if __name__ == "__main__":
    main()
