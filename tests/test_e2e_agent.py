"""agent_rollout through the real stack (vLLM turns, the calculator, Megatron, Ray): a model warm-started
to call the calculator calls it, one step off (the next step's episodes run while this one trains), and the
trainer's log-probs over rows with the tool's answers masked equal vLLM's (token in, token out: nothing
re-tokenized, nothing shifted); a user's own agent trains through the shipped openai graph, its failed
episodes lost and counted, the run going on; the endpoint and framework agents sample what the engine's
own tool loop samples."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def agent_task(made_once) -> Path:
    from make_agent_task import make_task

    # the call format learnt; the sums need not be right yet
    return made_once("agent", lambda out: make_task(out, copy_target=0.0, min_calls=0.9, mix_steps=0))


def run_graph(folder: Path, task: Path, graph: str, *extra: str) -> dict:
    """A shipped agent graph on the session's task, 2 steps; its steps' metrics."""
    return json.loads(run_cli(folder, task, graph, *extra).stdout)["steps"]


def run_cli(folder: Path, task: Path, graph: str, *extra: str) -> subprocess.CompletedProcess:
    """The run's process, finished (its --json report on stdout, its console on stderr). The tests' agents
    are importable as a user's module on PYTHONPATH is."""
    overrides = [f"models.policy.path={task / 'model'}", f"data.train_files={task / 'train.parquet'}",
                 f"data.val_files={task / 'test.parquet'}", "trainer.total_steps=2", "trainer.val_before_train=false",
                 "trainer.export_hf=false", f"trainer.default_local_dir={folder / 'ckpt'}",
                 f"trainer.tensorboard_dir={folder / 'tb'}", f"trainer.log_dir={folder / 'logs'}",
                 f"trainer.output_dir={folder / 'out'}", "trainer.logger=[tensorboard]", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", str(ROOT / "graphs" / f"{graph}.yaml"), "--json",
                          *overrides], capture_output=True, text=True, timeout=600, cwd=folder, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (folder / "out" / "timings.json").is_file() and not (folder / "outputs").exists()  # trainer.output_dir
    return res


def run_agent(folder: Path, task: Path, *extra: str) -> dict:
    """The tool demo's pipeline, cooler sampling than the demo's (a barely warm model then calls its tool),
    the trainer at the same temperature."""
    steps = run_graph(folder, task, "tiny_agent_tools_cpu", "nodes.actor_update.params.rollout_is=token",
                      "nodes.rollout.options.temperature=0.5", "nodes.old_logprob.params.temperature=0.5",
                      "nodes.ref_logprob.params.temperature=0.5", "nodes.actor_update.params.temperature=0.5", *extra)
    for step in steps.values():
        assert step["agent/tool_calls/mean"] > 0 and step["agent/turns/max"] == 2 and step["agent/turns/mean"] > 1
        assert "agent/tool_time_s/mean" in step and "agent/tool_errors/mean" in step
    assert "val-core/demo/agent_sum/acc" in steps["2"]
    return steps


def test_a_users_own_agent_trains_through_the_openai_graph(tmp_path, agent_task):
    """Two chat turns through the `openai` client, the reward left to the graph's reward node; a third of
    the prompts' episodes raise and are lost (their groups dropped), the run finishes; the trainer's
    log-probs over the rows are vLLM's. The console's line of each step shows the episodes lost, and the
    run's closing line counts the rank's warnings about them and shows the first."""
    res = run_cli(tmp_path, agent_task, "tiny_agent_openai_cpu", "nodes.agent.params.agent=agents_for_tests:raises_on_a_third",
                  "nodes.actor_update.params.rollout_is=token", "trainer.logger=[console,tensorboard]")
    steps = json.loads(res.stdout)["steps"]
    assert re.search(r"^step 1: .*agent/failed=[1-9]", res.stderr, re.M), res.stderr[-3000:]
    assert int(re.search(r"^\[run\] (\d+) warning line\(s\) in the logs", res.stderr, re.M).group(1)) >= 2 * 4
    # and shows the first lost episode's error, where to read the rest
    assert re.search(r"warning line\(s\) in the logs \(\S+/\); the engine's first: gen-rank0-\d+\.log: agent episode \d+ "
                     r"\(prompt \d+\) lost, failed: RuntimeError: this agent fails on a third", res.stderr), res.stderr[-3000:]
    for step in steps.values():
        failed = step["agent/failed"]  # a lost episode made one turn, the others two
        assert 0 < failed < 128 and step["agent/turns/mean"] == 2 - failed / 128 and step["agent/segments/mean"] == 1
        assert failed % 8 == 0 and step["agent/groups_dropped"] == failed / 8
        assert step["rollout_corr/log_ppl_abs_diff"] < 1e-4 and step["agent/endpoint_s/mean"] > 0
        assert step["reward/from_agent"] == 0  # None: the reward node scored the answers
    assert "val-core/demo/agent_sum/acc" in steps["2"]
    # the validation's lost episodes (scored 0) are counted too, and shown on the step's line
    assert steps["2"]["val-aux/agent/failed"] > 0 and re.search(r"^step 2: .*val-aux/agent/failed=[1-9]", res.stderr, re.M)
    assert re.search(r"^\[run\] val-core/demo/agent_sum/acc: [0-9.]+ \(after training\)$", res.stderr, re.M)


def test_agent_pipeline_calls_tools_one_step_off_and_trains_on_the_models_tokens(tmp_path, agent_task):
    """The next step's agent rollouts (tool calls included) run while this step trains; the trainer's
    log-probs over rows with the tool's answers masked are vLLM's."""
    steps = run_agent(tmp_path, agent_task, "runtime.schedule=one_step_off", "runtime.staleness=1",
                      "trainer.log_trajectories=3")
    assert [steps[s]["async/staleness/max"] for s in ("1", "2")] == [0, 1]
    # step 1's samples come from the weights it trains (staleness 0), step 2's from one version older by design
    assert steps["1"]["rollout_corr/log_ppl_abs_diff"] < 1e-4  # the trainer's log-probs are vLLM's, tool spans masked
    logged = [json.loads(line) for line in (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()]
    assert len(logged) == 3 and all(row["step"] == 2 and row["prompt"] and row["response"] for row in logged)
    assert any(part["by"] == "tool" for row in logged for part in row["response"])  # an observation, not trained on
    assert all(row["model_tokens"] > 0 and (row["tool_tokens"] > 0) == any(p["by"] == "tool" for p in row["response"])
               for row in logged)


def _warm_rollouts(task: Path) -> dict:
    """In a process of its own (one vLLM engine per process): over the task's warm start, the openai demo's
    agent through the endpoint and the engine's own tool loop at the same seeds, and the framework agents."""
    import pyarrow.parquet as pq

    from nodes import agent_loop
    from nodes.demo_agents import CALCULATOR
    from nodes.tools import resolve_tool
    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.samples import prompt_token_ids
    from siirl_dag.strategies.vllm.rollout import VllmRollout

    engine = VllmRollout(RankContext(rank=0), str(task / "model"), {
        "dtype": "float32", "kv_cache_gb": 0.25, "enforce_eager": True, "temperature": 0.5, "chat_template": True})
    rows = pq.read_table(task / "train.parquet").to_pylist()[:8]
    samples = [{"model": "policy", "prompt": r["prompt"], "messages": [{"role": "user", "content": r["prompt"]}],
                "ground_truth": r["reward_model"]["ground_truth"], "data_source": r["data_source"],
                "extra_info": r["extra_info"]} for r in rows]
    out = {agent: rollout_of(engine, samples, agent) for agent in ("nodes.demo_agents:solve", "nodes.demo_agents:solve_unscored")}
    out["agents_for_tests:anthropic_calculator"] = rollout_of(engine, samples, "agents_for_tests:anthropic_calculator")
    for agent in ("agents_for_tests:openai_agents_sdk", "agents_for_tests:openai_agents_sdk_responses",
                  "agents_for_tests:openai_agents_sdk_streamed", "agents_for_tests:langgraph_react"):  # room for a tool error
        out[agent] = rollout_of(engine, samples, agent, response=256)
    out["agents_for_tests:langgraph_parallel"] = rollout_of(engine, samples, "agents_for_tests:langgraph_parallel",
                                                            response=256, prompt=64, max_turns=3, concurrency=1)
    prompts = [prompt_token_ids(engine.tokenizer, s["prompt"], True, [CALCULATOR]) for s in samples]
    out["own"] = [(t.prompt_ids, t.ids, t.mask, t.logprobs, t.tool_calls) for t in agent_loop.run(
        engine.turns({}, 128, ["</tool_call>"]), prompts, 2, {"calculator": resolve_tool("calculator")},
        agent_loop.AgentLimits(2, 96, 128, 10.0, 4), engine.tokenizer, 11)]
    engine.close()
    return out


def rollout_of(engine, samples: list[dict], agent: str, n: int = 2, response: int = 128, prompt: int = 40, **params):
    from types import SimpleNamespace

    from nodes.agents import rollout

    params = {"agent": agent, "max_turns": 2, "max_tokens_per_turn": 96, "concurrency": 64, "agent_processes": 1, "timeout_s": 120.0,
              "max_request_mb": 8, "host": None, "env_kwargs": {}, **params}
    ctx = SimpleNamespace(engine=engine, node=SimpleNamespace(id="agent", model="policy", params=params), seed=11,
                          data=SimpleNamespace(max_prompt_length=prompt, max_response_length=response), validating=False)
    return rollout.run(ctx, samples, n)


@pytest.fixture(scope="module")
def warm_rollouts(agent_task):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_warm_rollouts, agent_task).result(timeout=600)


def test_the_endpoint_samples_what_the_engines_own_loop_samples(warm_rollouts):
    """The openai demo's agent, through the endpoint, and the engine's own tool loop, at the same seeds:
    the same tokens, turn for turn, up to each episode's last turn (the endpoint changes nothing of what
    is trained; after it, a tool error too long for the budget is cut in one and left out in the other)."""
    finished, own = warm_rollouts["nodes.demo_agents:solve"], warm_rollouts["own"]
    assert [o.status for o in finished.outcomes] == ["ok"] * 16, [o.error for o in finished.outcomes if o.error][:2]
    assert sum(t[4] for t in own) >= 4 and len(finished.episodes) == len(own) == 16  # the warm start calls

    def to_last_turn(ids, mask, logprobs):
        end = max(i for i, m in enumerate(mask) if m) + 1
        return ids[:end], mask[:end], logprobs[:end]

    for episode, (prompt_ids, ids, mask, logprobs, _) in zip(finished.episodes, own):
        (segment,) = episode.segments
        (got, got_mask, got_logprobs), (want, want_mask, want_logprobs) = (
            to_last_turn(segment.ids, segment.mask, segment.logprobs), to_last_turn(ids, mask, logprobs))
        assert (segment.prompt_ids, got, got_mask) == (prompt_ids, want, want_mask)
        # float32 log-probs of the same tokens from batches of other sizes: kernels that sum in another
        # order (AVX-512 read 1.9e-6 at -2.6, 8 ulp)
        assert got_logprobs == pytest.approx(want_logprobs, abs=1e-5)


def test_an_agent_may_leave_the_reward_to_the_reward_node(warm_rollouts):
    """graphs/qwen3_8b_agent.yaml's agent: the demo's, leaving its reward to the reward node (None). Within
    the rollout's two turns, at the same seeds, its episodes are the scoring agent's, token for token."""
    unscored, scored = warm_rollouts["nodes.demo_agents:solve_unscored"], warm_rollouts["nodes.demo_agents:solve"]
    assert [o.status for o in unscored.outcomes] == ["ok"] * 16, [o.error for o in unscored.outcomes if o.error][:2]
    assert all(o.reward is None for o in unscored.outcomes) and sum(o.info["tool_calls"] for o in unscored.outcomes) >= 4
    for got, want in zip(unscored.episodes, scored.episodes):
        assert [(s.prompt_ids, s.ids, s.mask) for s in got.segments] == [(s.prompt_ids, s.ids, s.mask) for s in want.segments]


@pytest.mark.parametrize("agent", ["openai_agents_sdk", "langgraph_react"])
def test_agents_written_with_frameworks_train_through_the_endpoint(warm_rollouts, agent):
    """The OpenAI Agents SDK's and LangGraph's own loops, unchanged: their calculator calls reach the model
    as OpenAI tools, and their episodes stay one token-faithful segment each."""
    finished = warm_rollouts[f"agents_for_tests:{agent}"]
    assert [o.status for o in finished.outcomes] == ["ok"] * 16, [o.error for o in finished.outcomes if o.error][:2]
    called = [e for e in finished.episodes if e.tool_calls]
    assert called and all(e.turns == 2 and e.prefix_breaks == 0 and len(e.segments) == 1 for e in called)


def test_an_agents_parallel_branches_run_at_once_each_conversation_one_segment(warm_rollouts):
    """LangGraph's two branches of one step (a solver, and a checker with a system prompt of its own), then
    the solver told what the checker said, one episode at a time: the branches' turns were on the engine
    together, and each conversation is one segment, the solver's continued after the checker's turn (its
    row last: the final answer's)."""
    finished = warm_rollouts["agents_for_tests:langgraph_parallel"]
    assert [o.status for o in finished.outcomes] == ["ok"] * 16, [o.error for o in finished.outcomes if o.error][:2]
    assert finished.peak_in_flight == 2  # concurrency 1: one episode's two calls at once

    def turns_in(segment):
        return sum(1 for i, m in enumerate(segment.mask) if m and (i == 0 or not segment.mask[i - 1]))

    for episode in finished.episodes:
        assert (episode.turns, episode.prefix_breaks, len(episode.segments)) == (3, 0, 2)  # two conversations
        assert [turns_in(s) for s in episode.rows()] == [1, 2]


@pytest.mark.parametrize("run", ["openai_agents_sdk_responses", "openai_agents_sdk_streamed"])
def test_the_agents_sdk_on_the_responses_api_trains_the_tokens_its_chat_model_does(warm_rollouts, run):
    """The Agents SDK's default model calls /v1/responses, run whole or streamed (`Runner.run_streamed`); at
    the same seeds its episodes are, token for token, those of the same agent on the chat completions model:
    one API's items and flat tools render the prompt the other's messages do, and what the agent sends back
    extends its episode without a break."""
    chat, responses = (warm_rollouts[f"agents_for_tests:{agent}"] for agent in ("openai_agents_sdk", run))
    assert [o.status for o in responses.outcomes] == ["ok"] * 16, [o.error for o in responses.outcomes if o.error][:2]
    assert sum(e.tool_calls for e in responses.episodes) >= 4
    for got, want in zip(responses.episodes, chat.episodes):
        assert (got.turns, got.tool_calls, got.prefix_breaks) == (want.turns, want.tool_calls, 0)
        assert [(s.prompt_ids, s.ids, s.mask) for s in got.segments] == [(s.prompt_ids, s.ids, s.mask) for s in want.segments]


def test_the_demo_agent_on_anthropics_messages_api_trains_the_tokens_it_does_on_openais(warm_rollouts):
    """The openai demo's agent, written against the `anthropic` client (tools as client tools, answers as
    tool_result blocks, over HTTP): at the same seeds, token for token, the episodes of the openai version."""
    claude, openai = warm_rollouts["agents_for_tests:anthropic_calculator"], warm_rollouts["nodes.demo_agents:solve"]
    assert [o.status for o in claude.outcomes] == ["ok"] * 16, [o.error for o in claude.outcomes if o.error][:2]
    assert sum(e.tool_calls for e in claude.episodes) >= 4
    assert [o.reward for o in claude.outcomes] == [o.reward for o in openai.outcomes]
    for got, want in zip(claude.episodes, openai.episodes):
        assert (got.turns, got.tool_calls, got.prefix_breaks) == (want.turns, want.tool_calls, 0)
        assert [(s.prompt_ids, s.ids, s.mask) for s in got.segments] == [(s.prompt_ids, s.ids, s.mask) for s in want.segments]
