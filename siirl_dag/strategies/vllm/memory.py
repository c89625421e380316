"""The memory estimate of a vLLM mesh: GiB per rank (siirl_dag.placement.memory).

On a GPU vLLM takes `gpu_memory_utilization` of the device at start: weights (/t), its runtime
(activations of the profiling pass, CUDA graphs) and, in what is left, the KV cache; a share that
leaves no room for one sequence's KV is refused here. Asleep (colocated, sleep mode) it holds only its
runtime. On CPU it holds the weights and `kv_cache_gb` of host memory.
"""

from __future__ import annotations

from siirl_dag.models.shape import DTYPE_BYTES
from siirl_dag.errors import Problem
from siirl_dag.placement.memory import GIB, MeshMemory, MeshWork
from siirl_dag.strategies.vllm.options import resolve_options

HINTS = {
    "weights": "more tensor parallel (t) on the rollout mesh",
    "kv_cache": "a smaller gpu_memory_utilization on the rollout node (on CPU: kv_cache_gb)",
    "runtime": "enforce_eager: true (no CUDA graphs) or a smaller max_num_seqs",
    "held": "a smaller gpu_memory_utilization on the rollout node (asleep it keeps only its runtime)",
}
_RUNTIME_GB = {True: 0.5, False: 1.5}  # CUDA context and profiling activations, with / without enforce_eager


def estimate(work: MeshWork) -> MeshMemory:
    m, opts = work.shape, resolve_options(work.options)
    width = DTYPE_BYTES[work.dtype if opts["dtype"] == "auto" else opts["dtype"]]
    weights = m.total_params * width / work.dims.tp / GIB
    runtime = (max_logits := opts["max_num_seqs"] * m.vocab * 4 / GIB) + (
        _RUNTIME_GB[opts["enforce_eager"]] if work.device == "cuda" else 0.1)
    seq_gb = m.kv_bytes_per_token(width) * work.seq_len / work.dims.tp / GIB
    problems = []
    if work.device == "cuda":
        kv = opts["gpu_memory_utilization"] * work.device_gb - weights - runtime
        if kv < seq_gb:
            problems.append(Problem(("options", "gpu_memory_utilization"), (
                f"{opts['gpu_memory_utilization']} of {work.device_gb:.1f} GiB leaves {max(kv, 0):.2f} GiB for the KV "
                f"cache after {weights:.2f} GiB of weights and {runtime:.2f} of runtime; one sequence of "
                f"{work.seq_len} tokens needs {seq_gb:.3f}; expected a larger gpu_memory_utilization or more t")))
        kv = max(kv, 0.0)
    else:
        kv = opts["kv_cache_gb"]
    terms = {"weights": weights, "runtime": runtime, "kv_cache": kv}
    asleep = work.device == "cuda" and work.colocated
    notes = [f"KV cache for {int(kv / seq_gb) if seq_gb else 0} sequences of {work.seq_len} tokens"
             + (f" (logits of {opts['max_num_seqs']} sequences: {max_logits:.2f})" if max_logits > 0.5 else "")]
    share = opts["gpu_memory_utilization"]  # smaller shares, in steps of 0.05, while one sequence still fits
    fixes = [{"gpu_memory_utilization": round(share - k * 0.05, 2)} for k in range(1, int(share / 0.05))]
    return MeshMemory(terms, ("runtime",) if asleep else tuple(terms), HINTS, notes, problems,
                      fixes if work.device == "cuda" else [])
