"""The door of the rollout correction's settings on actor_update: malformed thresholds, unknown options,
a rejection without its threshold and the bypass loss elsewhere refused at their line (exit 2, no
traceback); verl's forms and the documented presets accepted."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from nodes.actor_update import correction
from pipeline_files import errors, line_of, load
from test_balance import TEXT



def with_params(*lines: str) -> str:
    """The pipeline of test_balance (old_logprobs: update, one_step_off) with these actor_update params
    in place of its rollout_is: token."""
    return TEXT.replace("rollout_is: token}", ", ".join(lines) + "}")


@pytest.mark.parametrize("lines, key, says", [
    (["rollout_is: token", "rollout_is_threshold: \"5.0_0.5\""], "rollout_is_threshold",
     "the band '5.0_0.5' has its lower bound above its upper; expected lower <= upper"),
    (["rollout_is: token", "rollout_is_threshold: true"], "rollout_is_threshold",
     "True is a boolean; expected number or string"),
    (["rollout_is: token", "rollout_is_threshold: \"big\""], "rollout_is_threshold",
     "'big' is not a positive number; expected a positive number (TIS) or a band \"lower_upper\""),
    (["rollout_rs: seq_max_k2", "rollout_rs_threshold: \"0.5_2.0\""], "rollout_rs_threshold",
     "'0.5_2.0' is a band, but seq_max_k2 takes an upper bound only"),
    (["rollout_rs: token_k3", "rollout_rs_threshold: \"0.5_2.0\""], "rollout_rs_threshold", "takes an upper bound only"),
    (["rollout_rs: \"token_k1,token_k2\"", "rollout_rs_threshold: \"1.5,0.1,0.2\""], "rollout_rs_threshold",
     "3 entries for 2 rollout_rs options (token_k1, token_k2); expected one entry for all, or 2"),
    (["rollout_rs: token_k1", "rollout_rs_threshold: \"2.0_0.5\""], "rollout_rs_threshold",
     "has its lower bound above its upper"),
    (["rollout_rs: token_k1", "rollout_rs_threshold: false"], "rollout_rs_threshold",
     "False is a boolean; expected number or string or null"),
    (["rollout_rs: \"token_k1,seq_max_k1\"", "rollout_rs_threshold: 2.0"], "rollout_rs",
     "unknown option(s) 'seq_max_k1'; expected one or more of token_k1, token_k2"),
    (["rollout_rs: seq_mean_k3"], "rollout_rs", "'seq_mean_k3' rejects against rollout_rs_threshold, which is not set"),
    (["loss_type: reinforce"], "loss_type", "expected old_logprobs: rollout and policy_loss: vanilla with it"),
])
def test_malformed_settings_are_refused_at_their_line(tmp_path, lines, key, says):
    text = with_params(*lines)
    (p,) = errors(tmp_path, text)
    assert p.path == ("nodes", 4, "params", key) and says in p.message, p
    assert p.line == line_of(text, f"{key}:")


def test_bypass_ppo_clip_refuses_weights_it_would_count_twice(tmp_path):
    (p,) = errors(tmp_path, with_params("rollout_is: sequence").replace("old_logprobs: update", "old_logprobs: rollout"))
    assert p.path == ("nodes", 4, "params", "old_logprobs") and "loss_type: reinforce" in p.message


def test_a_refusal_exits_2_with_file_and_line(tmp_path):
    from siirl_dag.main import main

    f = tmp_path / "p.yaml"
    f.write_text(with_params("rollout_rs: seq_max_k2", "rollout_rs_threshold: \"0.5_2.0\""))
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        code = main(["validate", str(f)])
    assert code == 2 and "Traceback" not in err.getvalue()
    assert re.search(rf"{re.escape(str(f))}:{line_of(f.read_text(), 'rollout_rs_threshold')}:\d+: "
                     r"nodes\[4\]\.params\.rollout_rs_threshold: '0\.5_2\.0' is a band", err.getvalue())


PRESETS = {  # docs/ALGORITHMS.md, each as actor_update params
    "TIS": ["rollout_is: token", "rollout_is_threshold: 2.0"],
    "IcePop": ["rollout_is: token", "rollout_is_threshold: \"0.5_5.0\""],
    "Seq-MIS": ["rollout_is: sequence", "rollout_is_threshold: 2.0", "rollout_rs: seq_sum_k1",
                "rollout_rs_threshold: \"0.5_2.0\""],
    "geo-RS": ["rollout_rs: seq_mean_k1", "rollout_rs_threshold: \"0.999_1.001\""],
    "K3-RS": ["rollout_rs: seq_mean_k3", "rollout_rs_threshold: 0.01"],
    "bypass-REINFORCE": ["old_logprobs: rollout", "loss_type: reinforce", "rollout_is: sequence",
                         "rollout_is_threshold: 2.0"],
}


@pytest.mark.parametrize("name", PRESETS)
def test_presets_validate_without_warnings(tmp_path, name):
    lines = PRESETS[name]
    text = with_params(*(x for x in lines if not x.startswith("old_logprobs")))
    if "old_logprobs: rollout" in lines:
        text = text.replace("old_logprobs: update", "old_logprobs: rollout")
    pipe = load(tmp_path, text)
    assert "rollout_logprobs" in pipe.consumes("actor_update")
    assert correction(pipe.nodes["actor_update"].params)
    assert not [w for w in pipe.warnings if "actor_update" in str(w.path)], pipe.warnings


def test_presets_are_the_documented_ones():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "ALGORITHMS.md").read_text()
    for name, lines in PRESETS.items():
        assert f"**{name}**" in doc, name
        for line in lines:
            assert line.replace("\"", "") in doc.replace("\"", ""), (name, line)


def test_verl_forms_validate_and_off_means_none(tmp_path):
    pipe = load(tmp_path, with_params("rollout_is: token", "rollout_is_threshold: \"1.5\"", "rollout_is_batch_normalize: true",
                                      "rollout_rs: \"token_k1, seq_max_k3\"", "rollout_rs_threshold: \"0.5_2.0,0.5\""))
    assert correction(pipe.nodes["actor_update"].params)["rollout_rs"] == "token_k1, seq_max_k3"
    for off in ("off", "null"):  # YAML's boolean off and verl's null: no rejection
        pipe = load(tmp_path, with_params("rollout_is: token", f"rollout_rs: {off}"))
        assert correction(pipe.nodes["actor_update"].params)["rollout_rs"] is None


def test_without_correction_nothing_more_is_read_and_stale_samples_warn(tmp_path):
    pipe = load(tmp_path, with_params("rollout_is: off"))
    assert correction(pipe.nodes["actor_update"].params) is None
    assert "rollout_logprobs" not in pipe.consumes("actor_update")
    assert any("does not correct for them" in w.message for w in pipe.warnings)
    pipe = load(tmp_path, with_params("rollout_rs: seq_mean_k3", "rollout_rs_threshold: 0.01"))
    assert "rollout_logprobs" in pipe.consumes("actor_update")  # so a pipeline without its producer is refused
    assert not any("does not correct for them" in w.message for w in pipe.warnings)
