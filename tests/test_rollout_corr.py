"""Rollout correction (`nodes.algos.rollout_corr.correct`) against verl's own functions: the golden values
of tests/fixtures/rollout_corr_verl.json, written by scripts/rollout_corr_golden.py from a verl checkout
(every IS level and threshold form, batch-normalized or not, every rejection option, chains, presets);
and its threshold parsing, which the door shares."""

import json
from pathlib import Path

import pytest
import torch

from nodes.algos.rollout_corr import correct
from nodes.algos.rollout_corr_settings import parse, parse_is_threshold, parse_rs, parse_rs_thresholds
from rollout_corr_golden import SETTINGS, batch, checksums

GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "rollout_corr_verl.json").read_text())


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_correct_equals_verl(case):
    old, rollout, mask = batch(case["seed"])
    assert checksums(old, rollout, mask) == case["checksums"]  # this torch draws the fixture's inputs
    weights, kept, metrics = correct(old, rollout, mask, parse(**{k: case[k] for k in SETTINGS if k in case}))
    assert ["".join(str(int(v)) for v in row) for row in kept.tolist()] == case["mask"]
    if case["weights"] is None:
        assert weights is None
    else:
        torch.testing.assert_close(weights, torch.tensor(case["weights"]), atol=1e-5, rtol=0)
    assert metrics and set(metrics) <= set(case["metrics"]), set(metrics) - set(case["metrics"])  # verl's names
    for key, value in metrics.items():  # float32 means and stds: another CPU's kernels sum in another order
        assert value == pytest.approx(case["metrics"][key], rel=1e-4, abs=1e-6), key


def test_golden_covers_every_form():
    """The fixture holds every option, both levels, both threshold forms, normalization and chains."""
    cases = GOLDEN["cases"]
    rs = {o for c in cases if c.get("rollout_rs") for o in parse_rs(c["rollout_rs"])}
    assert rs == set(parse_rs("token_k1,token_k2,token_k3,seq_sum_k1,seq_sum_k2,seq_sum_k3,seq_mean_k1,seq_mean_k2,"
                              "seq_mean_k3,seq_max_k2,seq_max_k3"))
    forms = {(c["rollout_is"], parse_is_threshold(c["rollout_is_threshold"])[1] is None, c["rollout_is_batch_normalize"])
             for c in cases if c.get("rollout_is") and "rollout_is_batch_normalize" in c}
    assert forms == {(level, tis, norm) for level in ("token", "sequence") for tis in (True, False) for norm in (True, False)}
    assert any("," in c.get("rollout_rs", "") and "," in str(c["rollout_rs_threshold"]) for c in cases)
    rejected = [c for c in cases if c.get("rollout_rs") and 0 < c["metrics"]["rollout_corr/rollout_rs_masked_fraction"] < 1]
    assert len(rejected) > 20  # thresholds that keep some tokens and reject others


def test_rejected_tokens_leave_the_mask_and_weights_are_detached():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0, -3.0, -1.0], [-2.0, -2.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights, kept, m = correct(old, rollout, mask, parse(rollout_is="token", rollout_is_threshold="0.5_5.0",
                                                         rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"))
    assert kept.tolist() == [[1, 0, 1], [1, 1, 0]]  # rho = e^2 on token 2 is out of [0.5, 2]
    assert weights[0, 1] == 0 and not weights.requires_grad  # and out of IcePop's band: weight 0
    assert m["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(1 / 5)


def test_an_empty_batch_passes_through():
    mask = torch.zeros(2, 3)
    weights, kept, metrics = correct(torch.zeros(2, 3), torch.zeros(2, 3), mask,
                                     parse(rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=0.1))
    assert kept is mask and weights.abs().sum() == 0 and metrics == {}


@pytest.mark.parametrize("spec, parsed", [(2.0, (2.0, None)), (3, (3.0, None)), ("1.5", (1.5, None)),
                                          ("0.5_5.0", (5.0, 0.5)), (" 0.8_1.25 ", (1.25, 0.8))])
def test_is_threshold_forms(spec, parsed):
    assert parse_is_threshold(spec) == parsed


@pytest.mark.parametrize("spec, says", [(True, "not a threshold"), ("5.0_0.5", "lower bound above its upper"),
                                        ("0_2", "not a positive number"), ("a_b", "not a positive number"), (-1, "positive")])
def test_is_threshold_refused(spec, says):
    with pytest.raises(ValueError, match=says):
        parse_is_threshold(spec)


def test_rs_thresholds_per_option():
    options = parse_rs("token_k1, seq_max_k3,token_k1")
    assert options == ["token_k1", "seq_max_k3"]  # each once, in order
    assert parse_rs_thresholds(options, "0.5_2.0,0.01") == {"token_k1": (0.5, 2.0), "seq_max_k3": (None, 0.01)}
    assert parse_rs_thresholds(options, 4) == {"token_k1": (0.25, 4.0), "seq_max_k3": (None, 4.0)}


@pytest.mark.parametrize("options, spec, says", [
    ("seq_max_k2", "0.5_2.0", "takes an upper bound only"),
    ("token_k1,token_k2", "1.5,0.1,0.2", "3 entries for 2 rollout_rs options"),
    ("token_k1", "2.0_0.5", "lower bound above its upper"),
    ("token_k1", None, "missing"),
    ("token_k1", False, "not a threshold"),
])
def test_rs_thresholds_refused(options, spec, says):
    with pytest.raises(ValueError, match=says):
        parse_rs_thresholds(parse_rs(options), spec)


def test_unknown_rs_option_listed():
    with pytest.raises(ValueError, match="'seq_max_k1'.*expected one or more of token_k1"):
        parse_rs("token_k1,seq_max_k1")


def test_logprob_diff_metrics_count_only_the_response_tokens():
    from nodes.algos.rollout_corr_metrics import logprob_diff_metrics

    old = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    rollout = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, -0.25, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    metrics = logprob_diff_metrics(old, rollout, mask)
    assert metrics["training/rollout_logprob_diff_max"] == 0.5  # the padded -9 vs 0 is not counted
    assert metrics["training/rollout_logprob_diff_mean"] == pytest.approx((0.5 + 0 + 0 + 0.25 + 0.5) / 5)
    assert logprob_diff_metrics(old, rollout, torch.zeros_like(mask)) == {}
