"""How long a run's checks take before any process starts (YAML, data files, prompt token counts,
checkpoint): a fresh process that builds the Trainer, with the row cache empty (the tokenizer loads
and counts every prompt) and then filled (a restart on the same files). Demo task and tiny model,
the training file repeated to `--rows`.

    python scripts/bench_preflight.py [--json] [--rows 9800] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("import sys; from siirl_dag.config import load_pipeline; from siirl_dag.trainer.loop import Trainer; "
          "Trainer(load_pipeline(sys.argv[1], sys.argv[2:], for_run=True), progress=lambda *_: None); "
          "print(*(m in sys.modules for m in ('transformers', 'torch')))")


def task(tmp: Path, rows: int) -> list[str]:
    """The demo data and a tiny model in `tmp`; the overrides that point the demo pipeline at them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, str(ROOT / "scripts"))
    from make_demo_task import write_task
    from make_tiny_model import make_tiny_model

    write_task(tmp / "data", seed=0)
    train = pq.read_table(tmp / "data" / "train.parquet")
    pq.write_table(pa.concat_tables([train] * -(-rows // len(train))).slice(0, rows), tmp / "data" / "train.parquet")
    return [f"models.policy.path={make_tiny_model(tmp / 'model')}", f"data.train_files={tmp}/data/train.parquet",
            f"data.val_files={tmp}/data/test.parquet", f"trainer.default_local_dir={tmp}/ckpt"]


def timed(overrides: list[str], env: dict) -> tuple[float, list[bool]]:
    """Seconds, and whether the checks loaded transformers and torch."""
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", CHECKS, "graphs/tiny_grpo_cpu.yaml", *overrides], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    return time.perf_counter() - t, [word == "True" for word in res.stdout.split()[-2:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rows", type=int, default=9800, help="training prompts (the demo file repeated)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cold, warm = [], []
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(sys.stderr):  # --json: stdout holds only the report
            overrides = task(Path(tmp), args.rows)
        env = {**os.environ, "SIIRL_DAG_CACHE": f"{tmp}/cache", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        for i in range(args.repeat):
            env["SIIRL_DAG_CACHE"] = f"{tmp}/cache{i}"
            cold.append(timed(overrides, env))
            warm.append(timed(overrides, env))
    result = {"rows": args.rows + 200, "cold_s": round(statistics.median(t for t, _ in cold), 2),
              "warm_s": round(statistics.median(t for t, _ in warm), 2),
              "loaded_transformers_torch": {"cold": cold[-1][1], "warm": warm[-1][1]}}
    if args.json:
        print(json.dumps({"preflight": result}, indent=2))
    else:
        print(f"a run's checks over {result['rows']:,} prompts, whole process: {result['cold_s']:.2f} s with the row "
              f"cache empty, {result['warm_s']:.2f} s filled (loaded transformers, torch: {result['loaded_transformers_torch']})")


if __name__ == "__main__":
    main()
