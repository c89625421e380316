"""Time parse + place of realistic layouts (target: well under 1 s each).

    python scripts/bench_plan.py [--json] [--repeat N] [--table]

(a) seed 000's Qwen3-30B-A3B layout on 4 x 8 GPUs, with sglang and with vllm for rollout;
(b) a synthetic 1024-device pipeline: rollout, MoE actor with a colocated reference, critic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from siirl_dag.placement import ClusterSpec, MeshRequest, parse_allocation, place  # noqa: E402

SP = {"sequence_parallel": True}


def qwen3_30b(rollout: str):
    def run():
        roll, train = parse_allocation(f"{rollout}:d4t4+megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)")
        info = {"num_layers": 48, "num_experts": 128}
        return place(ClusterSpec(4, 8), [
            MeshRequest("rollout", [roll], path=("meshes", "rollout")),
            MeshRequest("actor", [train], options=SP, model_info=info, path=("meshes", "actor")),
            MeshRequest("ref", [train], colocate_with="actor", options=SP, model_info=info, path=("meshes", "ref")),
        ])
    return run


def synthetic_1024():
    roll, actor, ref, critic = parse_allocation(
        "vllm[rollout]:d48t8 + megatron[actor]:(attn:d8p4t8c2|ffn:p4t1e32) | megatron[ref]:(attn:d8p4t8c2|ffn:p4t1e32)"
        " + megatron[critic]:d4p4t8")
    info = {"num_layers": 64, "num_experts": 128}
    return place(ClusterSpec(128, 8), [
        MeshRequest("rollout", [roll], options={"tensor_parallel_size": 8}),
        MeshRequest("actor", [actor], options={"tensor_model_parallel_size": 8, **SP}, model_info=info),
        MeshRequest("ref", [ref], colocate_with="actor", options=SP, model_info=info),
        MeshRequest("critic", [critic], options=SP, model_info={"num_layers": 64}),
    ])


def bench(fn, repeat: int) -> dict:
    times, plan = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms_min": round(min(times), 3), "ms_median": round(statistics.median(times), 3),
            "devices_used": plan.devices_used, "ranks": sum(len(m.ranks) for m in plan.meshes.values()), "plan": plan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--table", action="store_true", help="also print the Qwen3-30B-A3B plan table")
    args = ap.parse_args()
    cases = {
        "qwen3_30b_a3b_sglang_4x8": qwen3_30b("sglang"),
        "qwen3_30b_a3b_vllm_4x8": qwen3_30b("vllm"),
        "synthetic_1024": synthetic_1024,
    }
    results = {name: bench(fn, args.repeat) for name, fn in cases.items()}
    plans = {name: r.pop("plan") for name, r in results.items()}
    if args.json:
        print(json.dumps({"repeat": args.repeat, "target_ms": 1000, "results": results}))
        return
    for name, r in results.items():
        print(f"{name:28s} parse+place {r['ms_median']:8.2f} ms median, {r['ms_min']:8.2f} ms min "
              f"({r['ranks']} ranks on {r['devices_used']} devices)")
    if args.table:
        print(plans["qwen3_30b_a3b_vllm_4x8"].table())


if __name__ == "__main__":
    main()
