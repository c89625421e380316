"""How long `validate` takes for every pipeline in graphs/: wall time of the whole CLI process
(interpreter start and imports included) and of load_pipeline alone. Target: under 1 s each.

    python scripts/bench_validate.py [--json] [--repeat N]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import subprocess
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from siirl_dag.config import load_pipeline

    results = {}
    for path in sorted(glob.glob("graphs/*.yaml")):
        cli, inproc = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "siirl_dag.main", "validate", path], check=True, capture_output=True)
            cli.append(time.perf_counter() - t)
            t = time.perf_counter()
            load_pipeline(path)
            inproc.append(time.perf_counter() - t)
        results[path] = {"cli_wall_s": round(statistics.median(cli), 3), "load_pipeline_ms": round(1000 * statistics.median(inproc), 1)}
    if args.json:
        print(json.dumps({"validate": results, "target_s": 1.0}, indent=2))
    else:
        for path, r in results.items():
            print(f"{path:<40} validate (whole CLI) {r['cli_wall_s']:.3f} s   load_pipeline {r['load_pipeline_ms']:.1f} ms")
        print("target: < 1 s wall per pipeline")


if __name__ == "__main__":
    main()
