"""Golden values of verl's rollout correction, for tests/test_rollout_corr.py to compare ours with.

Runs verl's own `compute_rollout_correction_and_rejection_mask` (its rollout_corr_helper, loaded
from a verl checkout with stubs for what it imports beyond torch, and verl's masked reductions taken
from its torch_functional) on seeded random batches, for every option and threshold form, and writes
each case's settings, seed, input checksums and verl's outputs (weights, mask, metrics) as JSON.

    python scripts/rollout_corr_golden.py VERL_CHECKOUT --source "verl-project/verl@<commit>"
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "rollout_corr_verl.json"
ROWS, WIDTH = 6, 8


def _case(name, **settings):
    return {"name": name, **settings}


def _cases() -> list[dict]:
    """Every IS level x threshold form x batch normalization, every RS option with its threshold
    forms, chained options, and verl's presets."""
    out = []
    for level in ("token", "sequence"):
        for threshold in (2.0, 3, "1.5", "0.5_5.0", "0.8_1.25"):
            for normalize in (False, True):
                out.append(_case(f"is-{level}-{threshold}-{'norm' if normalize else 'raw'}", rollout_is=level,
                                 rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize))
    bands = {"k1": (2.0, "0.8_1.25", "0.999_1.001", "1.1"), "k2": (0.01, "0.1"), "k3": (0.005, "0.05")}
    for option in ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                   "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"):
        for threshold in bands[option[-2:]]:
            out.append(_case(f"rs-{option}-{threshold}", rollout_rs=option, rollout_rs_threshold=threshold))
    out += [
        _case("chain-per-option", rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.5_2.0,0.5"),
        _case("chain-shared", rollout_rs="seq_mean_k1, token_k3", rollout_rs_threshold="1.5"),
        _case("chain-three", rollout_rs="token_k2,seq_sum_k3,seq_mean_k1", rollout_rs_threshold="0.2,1.0,0.9_1.1"),
        _case("chain-repeated", rollout_rs="token_k2,token_k2", rollout_rs_threshold=0.05),
        _case("preset-seq-mis", rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1",
              rollout_rs_threshold="0.5_2.0"),
        _case("preset-geo-rs", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
        _case("preset-k3-rs", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
        _case("preset-icepop-k3", rollout_is="token", rollout_is_threshold="0.5_5.0", rollout_rs="token_k3",
              rollout_rs_threshold=0.5),
        _case("is-rs-normalized", rollout_is="sequence", rollout_is_threshold="0.2_5.0", rollout_is_batch_normalize=True,
              rollout_rs="seq_max_k2", rollout_rs_threshold=0.5),
    ]
    for seed, case in enumerate(out):
        case["seed"] = seed
    return out


CASES = _cases()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old log-probs, rollout log-probs, response mask) [ROWS, WIDTH], float32: responses of random
    lengths (every fourth seed has an empty row), the rollout's log-probs the old ones plus noise of a
    scale per row from 0.001 to 1.5 (so that every threshold keeps some rows and rejects others);
    padding holds garbage that must not count."""
    g = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(ROWS, WIDTH, generator=g)
    scale = 10.0 ** (-3.0 + 3.2 * torch.rand(ROWS, 1, generator=g))
    rollout = old + scale * torch.randn(ROWS, WIDTH, generator=g)
    lengths = torch.randint(1, WIDTH + 1, (ROWS,), generator=g)
    if seed % 4 == 3:
        lengths[0] = 0
    mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).float()
    return old, torch.where(mask.bool(), rollout, torch.full_like(rollout, -7.0)), mask


def checksums(old, rollout, mask) -> list[float]:
    """What the test checks first: that this torch generates the same inputs."""
    return [round(float(t.double().sum()), 4) for t in (old, rollout, mask)]


def _verl_reductions(checkout: Path) -> types.ModuleType:
    """verl's masked_sum / masked_mean, taken from its torch_functional (whose other imports need a GPU stack)."""
    source = (checkout / "verl" / "utils" / "torch_functional.py").read_text()
    wanted = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name in ("masked_sum", "masked_mean")]
    module = types.ModuleType("verl.utils.torch_functional")
    module.torch = torch
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "torch_functional.py", "exec"), module.__dict__)
    return module


def load_helper(checkout: Path):
    """verl's rollout_corr_helper with stubs for DataProto and the config classes it only names."""
    class DataProto:
        def __init__(self, tensors):
            self.batch = tensors

        @classmethod
        def from_dict(cls, tensors):
            return cls(tensors)

    stubs = {"verl": {}, "verl.utils": {}, "verl.protocol": {"DataProto": DataProto}, "verl.trainer": {},
             "verl.trainer.config": {}, "verl.trainer.config.algorithm": {"RolloutCorrectionConfig": dict},
             "verl.workers": {}, "verl.workers.config": {}, "verl.workers.config.actor": {"PolicyLossConfig": dict}}
    for name, attrs in stubs.items():
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__dict__.update(attrs)
    sys.modules["verl.utils.torch_functional"] = _verl_reductions(checkout)
    sys.modules["verl.utils"].torch_functional = sys.modules["verl.utils.torch_functional"]
    path = checkout / "verl" / "trainer" / "ppo" / "rollout_corr_helper.py"
    spec = importlib.util.spec_from_file_location("verl.trainer.ppo.rollout_corr_helper", path)
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    return helper


SETTINGS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")


def golden(helper, case: dict) -> dict:
    old, rollout, mask = batch(case["seed"])
    kwargs = {k: case[k] for k in SETTINGS if k in case}
    proto, kept, metrics = helper.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kwargs)
    weights = None if proto is None else proto.batch["rollout_is_weights"]
    return case | {
        "checksums": checksums(old, rollout, mask),
        "weights": None if weights is None else [[float(f"{w:.8g}") for w in row] for row in weights.tolist()],
        "mask": ["".join(str(int(v)) for v in row) for row in kept.tolist()],
        "metrics": {k: float(f"{v:.8g}") for k, v in sorted(metrics.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl", type=Path, help="a verl checkout (its verl/ package folder inside)")
    parser.add_argument("--source", required=True, help="what the checkout is, recorded in the fixture (repo@commit)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    helper = load_helper(args.verl)
    cases = [golden(helper, case) for case in CASES]
    lines = ",\n".join(json.dumps(case) for case in cases)  # one case a line
    args.out.write_text(f'{{"source": {json.dumps(args.source)}, "torch": "{torch.__version__}", "cases": [\n{lines}\n]}}\n')
    print(f"{len(cases)} cases -> {args.out}")


if __name__ == "__main__":
    main()
