"""`import` of the peers' multi-turn (agentic) configurations: verl's tool agent loop and AReaL's agent
workflows become the agent_rollout node where a built-in tool matches them, the audit names what does
not map and why; where the agent itself is the peer's Python, the import stops at its file and line,
saying what to write here. The referenced files (verl's named config, tool and interaction configs) are
read as YAML, never run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nodes.tools import sandbox_policy
from siirl_dag.config.yaml_loader import load_yaml
from siirl_dag.main import main

SHAPES = Path(__file__).parent / "fixtures" / "import"
VERL = SHAPES / "verl_multiturn"
TOOLS_SCRIPT = VERL / "run_qwen2.5-3b_gsm8k_multiturn.sh"
TALK_SCRIPT = VERL / "run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh"
TOOLS_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
TALK_KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"


@pytest.fixture(autouse=True)
def sandbox_here(monkeypatch):
    """The python tool validates on machines without bubblewrap too (the import, not the sandbox, is tested)."""
    monkeypatch.setattr(sandbox_policy, "missing", lambda: None)


def imported(peer: str, source: Path, tmp_path: Path, capsys) -> tuple[dict, dict]:
    """Import (the written pipeline validates): (its document, import's JSON with the audit rows by key)."""
    out = tmp_path / "pipeline.yaml"
    assert main(["import", "--from", peer, str(source), "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] and not report["errors"]
    for part in ("carried_over", "differences", "not_carried"):
        report[part] = {row["key"]: row for row in report[part]}
    return load_yaml(out)[0], report


def refused(peer: str, source: Path, tmp_path: Path, capsys) -> str:
    """Import that stops: exit 2, no pipeline written, one message and no traceback; returns stderr."""
    out = tmp_path / "refused.yaml"
    assert main(["import", "--from", peer, str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert not out.exists() and "Traceback" not in err
    return err


def rollout(doc: dict) -> dict:
    return next(n for n in doc["nodes"] if n["id"] == "rollout")


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def copy_verl(tmp_path: Path, script: Path, old: str = "", new: str = "") -> Path:
    """The verl fixtures in a folder of their own, the script edited (old -> new)."""
    shutil.copytree(VERL, tmp_path / "verl_multiturn")
    copy = tmp_path / "verl_multiturn" / script.name
    copy.write_text(script.read_text().replace(old, new))
    return copy


def test_verl_tool_agent_becomes_agent_rollout_with_the_tools_that_map(tmp_path, capsys):
    doc, report = imported("verl", TOOLS_SCRIPT, tmp_path, capsys)
    node = rollout(doc)
    assert node["kind"] == "agent_rollout"
    # max_assistant_turns 5 from the named config (config/gsm8k_multiturn_grpo.yaml), the sandbox's timeout and workers
    assert node["params"] == {"tools": ["python"], "max_turns": 5, "tool_timeout_s": 30, "tool_workers": 10}
    assert node["options"]["chat_template"] is True and node["options"]["n"] == 16
    differences, left = report["differences"], report["not_carried"]
    assert "read config/gsm8k_multiturn_grpo.yaml" in differences["--config-name"]["why"]
    assert "read config/tool_config/code_tool_config.yaml" in differences[TOOLS_KEY]["why"]
    assert "$(pwd)" in differences[TOOLS_KEY]["why"]  # found behind a value only running the script gives, and said so
    assert "becomes the python tool" in differences["code_tool_config.yaml:tools.0.class_name"]["why"]
    gsm8k = left["code_tool_config.yaml:tools.1.class_name"]
    assert gsm8k["value"] == "verl.tools.gsm8k_tool.Gsm8kTool" and "calc_gsm8k_reward" in gsm8k["why"]
    assert "checks the answer" in gsm8k["why"] and "@siirl_dag.registry.tool" in gsm8k["why"]
    assert "SandboxFusion service" in left["code_tool_config.yaml:tools.0.config.sandbox_fusion_url"]["why"]
    assert "python(code), not code_interpreter" in left["code_tool_config.yaml:tools.0.tool_schema"]["why"]
    assert left["actor_rollout_ref.rollout.multi_turn.max_parallel_calls"]["line"] == line_of(TOOLS_SCRIPT, "max_parallel_calls")
    assert "actor_rollout_ref.rollout.multi_turn.max_assistant_turns" in report["carried_over"]
    assert {"data.return_raw_chat", "actor_rollout_ref.rollout.mode"} <= set(report["carried_over"])


def test_verl_tools_that_no_built_in_matches_stop_the_import_saying_what_to_write(tmp_path, capsys):
    script = copy_verl(tmp_path, TOOLS_SCRIPT, "code_tool_config.yaml", "gsm8k_tool_config.yaml")
    err = refused("verl", script, tmp_path, capsys)
    assert f"{script}:{line_of(script, 'tool_config_path')}: {TOOLS_KEY}: verl's tool calc_gsm8k_reward " \
           "(verl.tools.gsm8k_tool.Gsm8kTool, gsm8k_tool_config.yaml:2)" in err
    assert "@siirl_dag.registry.tool" in err and "params {tools: [your_module:your_tool], max_turns: 5}" in err


def test_verl_interaction_is_an_environment_to_write(tmp_path, capsys):
    err = refused("verl", TALK_SCRIPT, tmp_path, capsys)
    assert f"{TALK_SCRIPT}:{line_of(TALK_SCRIPT, 'interaction_config_path')}: {TALK_KEY}: verl's Interaction gsm8k " \
           "(verl.interactions.gsm8k_interaction.Gsm8kInteraction, gsm8k_interaction_config.yaml:3)" in err
    # max_user_turns 5 (its named config): five rounds of the user's answers, six model turns
    assert "env: module:Class" in err and "params {env: your_module:YourEnv, max_turns: 6}" in err


def test_verl_interaction_beside_tools_is_listed_as_not_carried(tmp_path, capsys):
    script = copy_verl(tmp_path, TALK_SCRIPT, "    $@", f"    {TOOLS_KEY}=config/tool_config/code_tool_config.yaml $@")
    doc, report = imported("verl", script, tmp_path, capsys)
    assert rollout(doc)["params"]["tools"] == ["python"] and rollout(doc)["params"]["max_turns"] == 6
    assert "at most 6 model turns" in report["differences"]["actor_rollout_ref.rollout.multi_turn.max_user_turns"]["why"]
    talk = report["not_carried"][TALK_KEY]
    assert "Gsm8kInteraction" in talk["why"] and "env: module:Class" in talk["why"]
    assert "simulated user" in report["not_carried"]["gsm8k_interaction_config.yaml:interaction.0.class_name"]["why"]


@pytest.mark.parametrize("tools_yaml, expected", [
    ("tools:\n  - class_name: x.Y\n    config: {type: native\n", "code_tool_config.yaml:4:1: <root>: YAML syntax error"),
    ("tools:\n  - config: {type: native}\n", "code_tool_config.yaml:2: code_tool_config.yaml:tools.0.config.type: tools "
                                            "entry 0 has no class_name"),
    ("tools: []\n", "code_tool_config.yaml:1: code_tool_config.yaml:tools: config/tool_config/code_tool_config.yaml has "
                    "no list of tools entries"),
])
def test_a_bad_tool_config_is_refused_at_its_own_line(tmp_path, capsys, tools_yaml, expected):
    script = copy_verl(tmp_path, TOOLS_SCRIPT)
    (script.parent / "config" / "tool_config" / "code_tool_config.yaml").write_text(tools_yaml)
    assert expected in refused("verl", script, tmp_path, capsys)


def test_a_tool_config_that_cannot_be_found_names_the_places_tried(tmp_path, capsys):
    script = copy_verl(tmp_path, TOOLS_SCRIPT, "code_tool_config.yaml", "nowhere.yaml")
    err = refused("verl", script, tmp_path, capsys)
    assert f"{script}:{line_of(script, 'nowhere.yaml')}: {TOOLS_KEY}: $PROJECT_DIR/verl_multiturn/config/tool_config/" \
           "nowhere.yaml cannot be read here (tried verl_multiturn/config/tool_config/nowhere.yaml," in err
    assert ", nowhere.yaml); expected verl's tool config YAML at a path the script sets" in err


def test_verl_multiturn_named_config_that_is_not_found_stops_the_import(tmp_path, capsys):
    script = copy_verl(tmp_path, TOOLS_SCRIPT, f"    {TOOLS_KEY}=", "    +dropped=")
    (script.parent / "config" / "gsm8k_multiturn_grpo.yaml").unlink()
    err = refused("verl", script, tmp_path, capsys)
    assert f"{script}:{line_of(script, '--config-name')}: --config-name: gsm8k_multiturn_grpo names a multi-turn " \
           "rollout whose settings" in err and f"{TOOLS_KEY}=... on the command line" in err


def test_verl_multiturn_without_tools_is_one_chat_turn(tmp_path, capsys):
    source = tmp_path / "run.sh"
    source.write_text("python3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=m data.train_files=t.parquet \\\n"
                      "  data.train_batch_size=32 actor_rollout_ref.actor.ppo_mini_batch_size=32 algorithm.adv_estimator=grpo \\\n"
                      "  actor_rollout_ref.rollout.multi_turn.enable=True actor_rollout_ref.rollout.multi_turn.format=hermes\n")
    doc, report = imported("verl", source, tmp_path, capsys)
    assert rollout(doc)["kind"] == "rollout" and rollout(doc)["options"]["chat_template"] is True
    assert "one turn" in report["not_carried"]["actor_rollout_ref.rollout.multi_turn.format"]["why"]


def test_verl_custom_agent_loop_is_an_agent_to_write(tmp_path, capsys):
    source = tmp_path / "run.sh"
    source.write_text("python3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=m \\\n"
                      "  actor_rollout_ref.rollout.agent.default_agent_loop=react_agent \\\n"
                      "  actor_rollout_ref.rollout.multi_turn.max_assistant_turns=7\n")
    err = refused("verl", source, tmp_path, capsys)
    assert f"{source}:2: actor_rollout_ref.rollout.agent.default_agent_loop: the agent loop 'react_agent'" in err
    assert "async def solve(client: openai.AsyncOpenAI, sample: dict)" in err
    assert "params {agent: your_module:solve, max_turns: 7}" in err


def test_areal_tir_tools_map_onto_python_and_calculator(tmp_path, capsys):
    doc, report = imported("areal", SHAPES / "areal_tir_tools.yaml", tmp_path, capsys)
    node = rollout(doc)
    assert node["kind"] == "agent_rollout" and node["options"]["chat_template"] is True
    # 2 tool calls and the answer; gconfig.max_new_tokens per turn; tir.tool_timeout
    assert node["params"] == {"tools": ["python", "calculator"], "max_turns": 3, "max_tokens_per_turn": 512,
                              "tool_timeout_s": 30}
    assert doc["data"]["max_prompt_length"] == 500 and doc["data"]["max_response_length"] == 2500  # 3000 in all
    assert "max_tokens" not in node["options"]  # the response's budget is data.max_response_length
    differences = report["differences"]
    assert "Hermes format" in differences["tir.enable_tools"]["why"]
    assert "max_turns 3" in differences["tir.max_turns"]["why"]
    assert "data.max_response_length 2500" in differences["tir.max_length"]["why"]


def test_areal_math_tool_agent_is_the_calculator_and_its_proxy_is_audited(tmp_path, capsys):
    doc, report = imported("areal", SHAPES / "areal_agent_workflow.yaml", tmp_path, capsys)
    assert rollout(doc)["params"] == {"tools": ["calculator"], "max_turns": 8, "max_tokens_per_turn": 1024}
    assert doc["data"]["max_response_length"] == 1024  # gconfig.max_tokens 2048, the prompt's 1024 included
    assert "calculator tool" in report["differences"]["workflow"]["why"]
    assert {"max_turns", "rollout.agent.tool_call_parser", "rollout.agent.turn_discount"} <= set(report["carried_over"])
    left = report["not_carried"]
    assert "one sample" in left["rollout.agent.export_style"]["why"] and "<think>" in left["rollout.agent.reasoning_parser"]["why"]
    assert "agent proxy" in left["rollout.agent.mode"]["why"]


def test_areal_math_agent_answers_once_a_plain_chat_rollout(tmp_path, capsys):
    source = tmp_path / "agent.yaml"
    source.write_text((SHAPES / "areal_agent_workflow.yaml").read_text().replace("MathToolAgent", "MathAgent"))
    doc, report = imported("areal", source, tmp_path, capsys)
    assert rollout(doc)["kind"] == "rollout" and rollout(doc)["options"]["chat_template"] is True
    assert "one turn per episode" in report["not_carried"]["max_turns"]["why"]


@pytest.mark.parametrize("old, new, key, expected", [
    ("areal.workflow.openai.math_agent.MathToolAgent", "my.agents.Search", "workflow",
     "the workflow my.agents.Search: Python that an import cannot convert"),
    ("areal.workflow.openai.math_agent.MathToolAgent", "areal.workflow.multi_turn.MultiTurnWorkflow", "workflow",
     "params {env: your_module:YourEnv, max_turns: 8, max_tokens_per_turn: 1024}"),
    ("workflow: areal.workflow.openai.math_agent.MathToolAgent\neval_workflow: ${workflow}\nmax_turns: 8",
     "agent_run_args:\n  max_turns: 2", "agent_run_args.max_turns",
     "the agent your training script builds (agent_run_args.max_turns)"),
    ("workflow: areal.workflow.openai.math_agent.MathToolAgent\neval_workflow: ${workflow}\nmax_turns: 8",
     "econfig:\n  domain: airline\n  max_steps: 50", "econfig.domain", "params {agent: your_module:solve, max_turns: 50"),
])
def test_areal_workflows_that_are_python_stop_the_import_with_the_limits_that_carry(tmp_path, capsys, old, new, key, expected):
    source = tmp_path / "agent.yaml"
    text = (SHAPES / "areal_agent_workflow.yaml").read_text()
    assert old in text
    source.write_text(text.replace(old, new))
    err = refused("areal", source, tmp_path, capsys)
    assert f"{source}:{line_of(source, key.split('.')[-1] + ':')}: {key}: " in err and expected in err


def test_areal_sft_is_still_not_rl_training(tmp_path, capsys):
    source = tmp_path / "sft.yaml"
    source.write_text("experiment_name: sft\nactor: {backend: 'fsdp:d8', path: m}\nmax_turns: 3\n")
    assert "which is not RL training" in refused("areal", source, tmp_path, capsys)


def test_roll_environments_are_environments_to_write(tmp_path, capsys):
    err = refused("roll", SHAPES / "roll_agentic.yaml", tmp_path, capsys)
    assert f"roll_agentic.yaml:{line_of(SHAPES / 'roll_agentic.yaml', 'SimpleSokoban:')}: custom_envs.SimpleSokoban.env_type: " \
           "an agentic pipeline (custom_envs, train_env_manager: ROLL's environments SimpleSokoban (env_type sokoban))" in err
    assert "env: module:Class" in err and "params {env: your_module:YourEnv, max_turns: 10}" in err


@pytest.mark.parametrize("fixture, old, new, key, expected", [
    ("areal_agent_workflow.yaml", "max_turns: 8", "max_turns: 0", "max_turns",
     "0 is not a positive number; expected one above 0"),
    ("areal_tir_tools.yaml", "max_length: 3000", "max_length: 400", "tir.max_length",
     "a trajectory of 400 tokens leaves no response after prompts of 500"),
    ("areal_tir_tools.yaml", "enable_tools: python;calculator", "enable_tools: python;browser", "tir.enable_tools",
     "browser is not a TIR tool; expected python, daytona_python, calculator"),
])
def test_areal_agent_limits_that_cannot_hold_are_refused_at_their_line(tmp_path, capsys, fixture, old, new, key, expected):
    source = tmp_path / fixture
    source.write_text((SHAPES / fixture).read_text().replace(old, new))
    err = refused("areal", source, tmp_path, capsys)
    assert f"{source}:{line_of(source, new)}: {key}: {expected}" in err


def test_verl_turn_limits_below_zero_are_refused_at_their_line(tmp_path, capsys):
    script = copy_verl(tmp_path, TOOLS_SCRIPT, "multi_turn.max_parallel_calls=1", "multi_turn.max_user_turns=-2")
    err = refused("verl", script, tmp_path, capsys)
    assert f"{script}:{line_of(script, 'max_user_turns')}: actor_rollout_ref.rollout.multi_turn.max_user_turns: -2 is not a " \
           "positive number; expected one above 0, or 0 (no limit)" in err
