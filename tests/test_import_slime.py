"""`import --from slime`: slime's own run scripts (bash arrays of --flag value) become pipelines that validate;
--use-tis and its MIS settings (the --custom-config-path file) carry over to actor_update's rollout correction."""

from __future__ import annotations

import pytest

from siirl_dag.main import main
from test_import import SHAPES, imported, node

MIS = SHAPES / "slime_mis" / "run-qwen3-4b-mis.sh"
RUN = SHAPES / "slime_run-qwen3-4B.sh"


def line_of(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_the_mis_example_carries_its_truncation_rejection_and_normalization(tmp_path, capsys):
    doc, report, plan = imported("slime", MIS, tmp_path, capsys)
    params = node(doc, "actor_update")["params"]
    # mis.yaml: token weights truncated at 2, batch-normalized; tokens whose ratio leaves [0.5, 2] rejected
    assert {k: params[k] for k in params if k.startswith("rollout")} == {
        "rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2"}
    assert params["mini_batch_size"] == 32 and params["clip_ratio_high"] == 0.28  # 256 samples / 8 per prompt
    assert params["loss_agg_mode"] == "seq-mean-token-mean"  # slime's default: per sample, then the mean
    assert doc["meshes"] == {"actor": "megatron:d2t2c2", "gen": {"alloc": "vllm:d8", "colocate_with": "actor"}}
    assert "ref" not in doc["meshes"]  # --use-kl-loss with --kl-loss-coef 0.00: no reference needed
    options = node(doc, "actor_update")["options"]
    assert options["sequence_parallel"] is True and options["dynamic_micro_batch_tokens"] == 9216
    assert options["lr"] == 1e-6 and options["betas"] == [0.9, 0.98]
    left = {x["key"]: x for x in report["not_carried"]}
    veto = left["mis.yaml:rs_veto_threshold"]
    assert "no counterpart" in veto["why"] and veto["value"] == 1e-4  # read from mis.yaml, found beside the script
    model_args = left["${MODEL_ARGS[@]}"]
    assert "architecture" in model_args["why"] and model_args["line"] == line_of(MIS, "${MODEL_ARGS[@]}")
    assert left["--attention-dropout"]["why"] == "" and left["--attention-dropout"]["line"] == line_of(MIS, "--attention-dropout")
    assert not [k for k in left if "tis" in k or k.startswith("mis.yaml:") and k != "mis.yaml:rs_veto_threshold"]


@pytest.mark.parametrize("flags, function, expected, said", [
    ("--use-tis --tis-clip 3 --tis-clip-low 0.1", "", {"rollout_is": "token", "rollout_is_threshold": 3.0},
     "raised to it"),
    ("--use-tis --tis-clip 5", "slime.backends.megatron_utils.loss.icepop_function",
     {"rollout_is": "token", "rollout_is_threshold": "1e-09_5"}, None),
    ("--use-rollout-logprobs", "", {"old_logprobs": "rollout"}, "old_logprobs: rollout"),
])
def test_vanilla_tis_icepop_and_bypass(tmp_path, capsys, flags, function, expected, said):
    text = RUN.read_text().replace("   --eps-clip-high 0.28\n", f"   --eps-clip-high 0.28\n   {flags}\n"
                                   + (f"   --custom-tis-function-path {function}\n" if function else ""))
    source = tmp_path / "run.sh"
    source.write_text(text)
    doc, report, _ = imported("slime", source, tmp_path, capsys)
    params = node(doc, "actor_update")["params"]
    assert {k: params[k] for k in expected} == expected
    if said:
        assert said in " ".join(x["why"] for x in report["differences"])


def test_rollout_on_gpus_of_its_own_with_train_async(tmp_path, capsys):
    text = RUN.read_text().replace("-- python3 train.py", "-- python3 train_async.py").replace(
        "   --colocate \\\n", "   --rollout-num-gpus 4 \\\n")
    source = tmp_path / "run.sh"
    source.write_text(text)
    doc, report, plan = imported("slime", source, tmp_path, capsys)
    assert doc["runtime"] == {"schedule": "one_step_off"} and doc["meshes"]["gen"] == "vllm:d2t2"
    assert doc["cluster"] == {"nodes": 2, "devices_per_node": 8, "device": "cuda"}  # 8 training + 4 rollout devices
    assert not set(plan["meshes"]["gen"]["devices"]) & set(plan["meshes"]["actor"]["devices"])
    assert "one_step_off" in {x["key"]: x["why"] for x in report["differences"]}["train_async.py"]


@pytest.mark.parametrize("old, new, expected", [
    ("--rollout-num-gpus-per-engine 2", "--rollout-num-gpus-per-engine 3",
     "--rollout-num-gpus-per-engine: 8 devices do not split into vLLM engines of 3"),
    ("--rollout-batch-size 32", "--rollout-batch-size thirty", "--rollout-batch-size: 'thirty' is not a int"),
    ("--global-batch-size 256", "--global-batch-size 252", "--global-batch-size: an optimizer step of 252 samples"),
])
def test_bad_values_exit_2_at_their_line(tmp_path, capsys, old, new, expected):
    source = tmp_path / "run.sh"
    source.write_text(RUN.read_text().replace(old, new))
    assert main(["import", "--from", "slime", str(source), "-o", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"{source}:{line_of(source, new)}: {expected}" in err and "Traceback" not in err


def test_no_text_makes_the_flag_reader_raise(tmp_path):
    """Property: any text (seeded random runs of shell fragments and flags) reads as a Source or a ConfigError."""
    import random

    from siirl_dag.errors import ConfigError
    from siirl_dag.importers import slime
    from test_import import SHELL_PIECES
    pieces = SHELL_PIECES + ["--use-tis ", "--tis-clip ", "-1 ", "--a=b ", '"${A[@]}" ', "${M[@]} ", "train.py "]
    rng = random.Random(61)
    script = tmp_path / "run.sh"
    for _ in range(600):
        text = "".join(rng.choices(pieces, k=rng.randint(0, 40)))
        script.write_text("A=(--x 1)\n" + text + ("\npython3 train.py " + text if rng.random() < 0.7 else ""))
        try:
            slime.convert(slime.read(script))
        except ConfigError:
            pass
