"""`import`: the peers' rollout correction (verl's algorithm.rollout_correction, AReaL's decoupled loss with
its rejection_sampling) and AReaL's DAPO keys carry over to actor_update and the reward, each difference said."""

from __future__ import annotations

import pytest

from test_import import AREAL, imported, node

FIXTURES = AREAL.parents[1] / "import"


def test_verl_bypass_reinforce_with_chained_rejection(tmp_path, capsys):
    doc, report, _ = imported("verl", FIXTURES / "verl_rollout_corr_bypass.sh", tmp_path, capsys)
    params = node(doc, "actor_update")["params"]
    assert params == {"mini_batch_size": 16, "rollout_is": "sequence", "rollout_is_threshold": 2.0,
                      "rollout_is_batch_normalize": True, "rollout_rs": "token_k1,seq_max_k3",
                      "rollout_rs_threshold": "0.5_2.0,0.5", "old_logprobs": "rollout", "loss_type": "reinforce"}
    assert "old_logprob" not in {n["id"] for n in doc["nodes"]}  # bypass: no old log-prob pass
    assert node(doc, "actor_update")["deps"] == ["advantage"]
    assert not [x for x in report["not_carried"] if "rollout_correction" in x["key"] or "calculate_log_probs" in x["key"]]
    assert "becomes old_logprobs: rollout" in {x["key"]: x["why"] for x in report["differences"]}[
        "algorithm.rollout_correction.bypass_mode"]


def verl_source(tmp_path, correction: str):
    """A verl YAML whose algorithm.rollout_correction is `correction` (a flow mapping)."""
    source = tmp_path / "verl.yaml"
    source.write_text(f"""
trainer: {{n_gpus_per_node: 8, nnodes: 1}}
algorithm: {{adv_estimator: grpo, rollout_correction: {correction}}}
data: {{train_files: d/train.parquet, train_batch_size: 64}}
actor_rollout_ref: {{model: {{path: m/Qwen2.5-7B}}, actor: {{ppo_mini_batch_size: 16}}, rollout: {{n: 4}}}}
""")
    return source


def test_verl_decoupled_icepop_and_forms_not_read_here(tmp_path, capsys):
    source = verl_source(tmp_path, "{rollout_is: token, rollout_is_threshold: \"0.5_5.0\", rollout_rs: geometric, "
                                   "rollout_rs_threshold: 1.001, bypass_mode: false, loss_type: ppo_clip}")
    doc, report, _ = imported("verl", source, tmp_path, capsys)
    params = node(doc, "actor_update")["params"]
    assert params["rollout_is"] == "token" and params["rollout_is_threshold"] == "0.5_5.0" and "rollout_rs" not in params
    assert node(doc, "actor_update")["deps"][:2] == ["advantage", "old_logprob"]  # decoupled: the old policy's pass
    left = {x["key"]: x["why"] for x in report["not_carried"]}
    assert "unknown option(s) 'geometric'" in left["algorithm.rollout_correction.rollout_rs"]  # verl 0.6's spelling
    assert "bypass mode only" in left["algorithm.rollout_correction.loss_type"]


def test_verl_bypass_ppo_clip_drops_the_weights_it_only_measures(tmp_path, capsys):
    source = verl_source(tmp_path, "{rollout_is: token, rollout_rs: seq_mean_k3, rollout_rs_threshold: 0.01, "
                                   "bypass_mode: true}")
    doc, report, _ = imported("verl", source, tmp_path, capsys)
    params = node(doc, "actor_update")["params"]
    assert params["old_logprobs"] == "rollout" and "rollout_is" not in params and params["rollout_rs"] == "seq_mean_k3"
    assert "metrics only" in {x["key"]: x["why"] for x in report["differences"]}["algorithm.rollout_correction.rollout_is"]


def areal_source(tmp_path, actor_lines: str, top: str = ""):
    """AReaL's per-engine example with `actor_lines` in place of its legacy weight cap, `top` above it."""
    text = AREAL.read_text().replace("  behav_imp_weight_cap: 5.0\n", actor_lines)
    source = tmp_path / "areal.yaml"
    source.write_text(top + text)
    return source


@pytest.mark.parametrize("lines, rs, threshold, is_threshold", [
    ("  rejection_sampling: {level: token, action: mask, metric: ratio, upper: 5.0, lower: 0.5}\n",
     "token_k1", "0.2_2", 5.0),  # pi_rollout / pi_old in [1/5, 1/0.5]
    ("  rejection_sampling: {level: sequence, action: mask, metric: ratio, agg: mean, upper: 1.001, lower: 0.999}\n",
     "seq_mean_k1", "0.999001_1.001", None),  # geometric mean: geo-RS
    ("  rejection_sampling: {level: sequence, action: mask, metric: kl_k3, agg: max, upper: 0.5}\n",
     "seq_max_k3", 0.5, None),
    ("  rejection_sampling: {level: token, action: mask, metric: ratio, upper: 2.0}\n", "token_k1", "0.5_1e+09", 2.0),
])
def test_areal_rejection_sampling_becomes_rollout_rs(tmp_path, capsys, lines, rs, threshold, is_threshold):
    doc, report, _ = imported("areal", areal_source(tmp_path, lines), tmp_path, capsys)
    params = node(doc, "actor_update")["params"]
    assert params["rollout_is"] == "token" and params.get("rollout_is_threshold") == is_threshold
    assert params["rollout_rs"] == rs and params["rollout_rs_threshold"] == threshold
    assert not [x for x in report["not_carried"] if "rejection_sampling" in x["key"]]


def test_areal_clamp_is_tis_and_what_has_no_counterpart_is_said(tmp_path, capsys):
    doc, _, _ = imported("areal", areal_source(
        tmp_path, "  rejection_sampling: {level: token, action: clamp, metric: ratio, upper: 3.0}\n"), tmp_path, capsys)
    assert node(doc, "actor_update")["params"]["rollout_is_threshold"] == 3.0
    assert "rollout_rs" not in node(doc, "actor_update")["params"]
    doc, report, _ = imported("areal", areal_source(
        tmp_path, "  rejection_sampling: {level: sequence, action: clamp, metric: kl_k2, upper: 1.0}\n"), tmp_path, capsys)
    left = {x["key"]: x["why"] for x in report["not_carried"]}
    assert "clamp by the sequence kl_k2 (mean) has no counterpart" in left["actor.rejection_sampling.action"]


def test_areal_overlong_penalty_and_dynamic_batches_are_dapo(tmp_path, capsys):
    source = areal_source(tmp_path, "  overlong_reward_penalty: true\n  overlong_tokens: 256\n  overlong_penalty_factor: 0.5\n",
                          top="dynamic_bs: true\n")
    doc, report, _ = imported("areal", source, tmp_path, capsys)
    assert node(doc, "reward")["params"] == {"overlong_buffer_len": 256, "overlong_penalty_factor": 0.5}
    assert node(doc, "filter")["kind"] == "filter_groups" and node(doc, "advantage")["deps"][0] == "filter"
    assert "DAPO's dynamic sampling" in {x["key"]: x["why"] for x in report["differences"]}["dynamic_bs"]
    assert not [x for x in report["not_carried"] if "overlong" in x["key"] or x["key"] == "dynamic_bs"]
