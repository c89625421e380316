"""The agents' endpoint on a real vLLM engine, through the real `openai` client, in the agents' own
process: token faithfulness for random agents, every fault an agent or a client can commit, the
environment loop, agent programs, and the endpoint's life."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dist_utils import run_ranks
from nodes.agents import rollout as agents_rollout
from nodes.agents import rows as agent_rows

pytestmark = pytest.mark.engines
HERE = Path(__file__).resolve().parent
PARAMS = {"max_turns": 6, "max_tokens_per_turn": None, "concurrency": 64, "agent_processes": 1, "timeout_s": 60.0, "max_request_mb": 1,
          "host": None, "env_kwargs": {}}


class Recording:
    """The session's engine, recording each turn it was asked for (its context) and what it sampled."""

    def __init__(self, engine):
        self.engine, self.asked, self.sampled = engine, {}, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def turns(self, *args):
        turns, rollout = self.engine.turns(*args), len(self.asked)
        add, step = turns.add, turns.step

        def recorded_add(key, context, *rest):
            self.asked[rollout, key] = list(context)
            add(key, context, *rest)

        def recorded_step():
            done = step()
            for key, sample in done:
                self.sampled[rollout, key] = sample
            return done

        turns.add, turns.step = recorded_add, recorded_step
        return turns


def run(engine, samples: list[dict], n: int = 1, validating: bool = False, **params):
    ctx = SimpleNamespace(engine=engine, validating=validating, seed=7,
                          node=SimpleNamespace(id="agent", model="policy", params={**PARAMS, **params}),
                          data=SimpleNamespace(max_prompt_length=64, max_response_length=160))
    return agents_rollout.run(ctx, samples, n)


def samples(count: int, **extra) -> list[dict]:
    prompts = [f"Q: {i}+{i}=? A:" for i in range(count)]
    return [{"model": "policy", "prompt": p, "messages": [{"role": "user", "content": p}], "ground_truth": str(2 * i),
             "data_source": "test", "extra_info": {"seed": i, **extra}} for i, p in enumerate(prompts)]


@pytest.mark.parametrize("processes", [1, 3])
def test_random_agents_train_exactly_the_tokens_the_engine_sampled(vllm_engine, processes):
    """For 64 random agents at once (turns, tools, completions, rewritten histories, sub-agents' conversations
    beside the main ones), in one agents' process or spread over three: every row's masked tokens are turns
    the engine sampled, in order, each after exactly the tokens before it in its row; the rest of a row is
    what the agent sent, never trained on."""
    run(vllm_engine, samples(processes), agent="agents_for_tests:random_agent", agent_processes=processes)  # all started
    engine = Recording(vllm_engine)
    finished = run(engine, samples(64), agent="agents_for_tests:random_agent", agent_processes=processes)
    assert [o.status for o in finished.outcomes] == ["ok"] * 64, [o.error for o in finished.outcomes if o.error][:3]
    assert [e.index for e in finished.episodes] == list(range(64))  # in the rollout's order, whichever process ran it
    running = agents_rollout._PROCESSES[("agent", vllm_engine.model_path)]
    assert len({process.proc.pid for process in running if process.proc.poll() is None}) == processes
    by_context = {tuple(context): engine.sampled[key] for key, context in engine.asked.items()}
    used = 0
    for episode in finished.episodes:
        for segment in episode.segments:
            at = 0
            while at < len(segment.ids):
                if not segment.mask[at]:
                    at += 1
                    continue
                turn = by_context[tuple(segment.prompt_ids + segment.ids[:at])]  # the engine saw exactly this
                end = at + len(turn.token_ids)
                assert segment.ids[at:end] == list(turn.token_ids) and segment.mask[at:end] == [1] * len(turn.token_ids)
                assert segment.logprobs[at:end] == pytest.approx(list(turn.logprobs))
                at, used = end, used + 1
    assert used == len(engine.sampled) == sum(e.turns for e in finished.episodes)
    assert sum(e.prefix_breaks for e in finished.episodes) > 0  # some histories were rewritten
    assert sum(len(e.rows()) for e in finished.episodes) > 64  # and started segments of their own
    # the 64 episodes ran at once, not one after another (that holds one turn in flight). Their turns are
    # 1-8 tokens and their starts staggered, so early ones end before the last begin: 19 measured quiet
    assert finished.peak_in_flight >= 8, finished.peak_in_flight
    metrics = agent_rows.metrics(finished, agent_rows.rows_of(finished, [f"u{i}" for i in range(64)], 1, False, None, 0),
                                 64, False)
    assert metrics["agent/failed"] == 0 and metrics["agent/segments/mean"] > 1 and metrics["agent/endpoint_s/mean"] > 0


def test_agents_that_fail_lose_their_episodes_only(vllm_engine):
    """Raising, hanging past timeout_s and returning something else than a reward each lose an episode,
    counted; the others finish."""
    finished = run(vllm_engine, samples(8), agent="agents_for_tests:misbehaves", timeout_s=5.0)
    statuses = [o.status for o in finished.outcomes]
    assert statuses == ["failed", "timeout", "failed", "ok"] * 2
    assert "ValueError: broken agent" in finished.outcomes[0].error
    assert "'not a reward'" in finished.outcomes[2].error and finished.outcomes[3].reward == 0.5
    found = agent_rows.rows_of(finished, [f"u{i}" for i in range(8)], 1, False, None, 0)
    metrics = agent_rows.metrics(finished, found, 8, False)
    assert (metrics["agent/failed"], metrics["agent/timeouts"], metrics["agent/groups_dropped"]) == (6, 2, 6)
    assert found.index == [3, 7]  # training rows: the finished episodes' only
    validation = agent_rows.rows_of(finished, [f"u{i}" for i in range(8)], 1, True, lambda i: [1, 2], 0)
    assert validation.index == list(range(8))  # validation: one row per episode, lost ones empty
    assert [any(s.mask) for s in validation.samples] == [False, False, False, True] * 2


def test_a_synchronous_agent_runs_in_threads_and_samples_what_its_async_twin_does(vllm_engine):
    """A harness written without asyncio (`def solve(client: openai.OpenAI, sample)`): its episodes run in
    threads at once, token for token those of the same agent written with asyncio; one that sleeps past
    timeout_s loses its episode only, and the rollout does not wait for it."""
    want = run(vllm_engine, samples(8), agent="agents_for_tests:two_turns")
    got = run(vllm_engine, samples(8), agent="agents_for_tests:sync_two_turns")
    assert [o.status for o in got.outcomes] == ["ok"] * 8, [o.error for o in got.outcomes if o.error][:2]
    assert [e.turns for e in got.episodes] == [2] * 8 and got.peak_in_flight >= 2
    assert [(s.prompt_ids, s.ids, s.mask) for e in got.episodes for s in e.segments] == \
        [(s.prompt_ids, s.ids, s.mask) for e in want.episodes for s in e.segments]
    hidden = run(vllm_engine, samples(1), agent="agents_for_tests:hidden_async")  # a decorator hid its async def
    assert hidden.outcomes[0].status == "failed" and "though it is not an async function" in hidden.outcomes[0].error
    began = time.monotonic()  # two at once: a thread left sleeping holds no later episode's place
    slow = run(vllm_engine, samples(4), agent="agents_for_tests:sync_sleeps_on_even", timeout_s=3.0, concurrency=2)
    assert [o.status for o in slow.outcomes] == ["timeout", "ok", "timeout", "ok"] and time.monotonic() - began < 20


@pytest.mark.parametrize("agent", ["retries_after_its_timeout", "retries_in_process", "sync_retries_in_process"])
def test_a_call_whose_client_hangs_up_is_not_the_episodes(vllm_engine, agent):
    """A client that gives up on a call (its timeout: over HTTP, or the in-process client's, async or
    not) and retries: the turn it gave up on is aborted, so the retry continues the conversation, one
    segment of one turn, not a fork of two."""
    finished = run(vllm_engine, samples(4), agent=f"agents_for_tests:{agent}")
    assert [o.status for o in finished.outcomes] == ["ok"] * 4, [o.error for o in finished.outcomes if o.error][:2]
    assert [(e.turns, e.prefix_breaks, len(e.rows())) for e in finished.episodes] == [(1, 0, 1)] * 4


def test_the_endpoint_answers_bad_calls_as_openai_does(vllm_engine, tmp_path):
    finished = run(vllm_engine, samples(3, dir=str(tmp_path)), agent="agents_for_tests:probes_the_endpoint",
                   concurrency=1)
    assert [o.status for o in finished.outcomes] == ["ok"] * 3, [o.error for o in finished.outcomes]
    info = finished.outcomes[-1].info
    assert (info["ok"], info["wrong_key"], info["reused_key"], info["other_episode"], info["too_large"],
            info["wrong_model"], info["n2"], info["forced_tool"], info["not_json"]) == (200, 401, 401, 403, 413, 404,
                                                                                          400, 400, 400)
    assert (info["no_such_path"], info["wrong_method"], info["nested_too_deeply"], info["template_of_its_own"]) == (
        404, 405, 400, 400)
    # a tool call's arguments nested past what is walked are kept as their text, as arguments that are not JSON
    assert (info["deep_arguments"], info["not_a_number"], info["lowercase_bearer"], info["lone_surrogate"]) == (
        200, 400, 200, True)
    assert info["deep_body"] == 400  # past MAX_DEPTH, though Python would read it
    assert (info["client_wrong_model"], info["client_n2"], info["client_too_large"], info["client_out_of_vocabulary"]) == (
        404, 400, 413, 400)
    assert info["names_the_model"] == 1.0
    # the calls refused with the episode's own key are counted as its (not a stranger's key, not a bad path, not a
    # body the HTTP server refused before the endpoint read it)
    assert [(e.refused, e.first_refusal[:16]) for e in finished.episodes] == [(13, "400 n must be 1:")] * 3
    found = agent_rows.rows_of(finished, ["u0", "u1", "u2"], 1, False, None, 0)
    assert agent_rows.metrics(finished, found, 3, False)["agent/calls_refused"] == 39


def test_the_responses_api_is_served_whole_and_streamed_on_one_episode(vllm_engine):
    """A harness on the Responses API: its turns (the second streamed, the first's items sent back) extend
    one segment; a request that asks the endpoint to remember a response is refused (400)."""
    finished = run(vllm_engine, samples(2), agent="agents_for_tests:speaks_responses")
    assert [o.status for o in finished.outcomes] == ["ok"] * 2, [o.error for o in finished.outcomes]
    for episode, outcome in zip(finished.episodes, finished.outcomes):
        assert outcome.info == {"first_has_text": 1.0, "stream_ends_with_the_response": 1.0, "chained": 400}
        assert episode.turns == 2 and episode.prefix_breaks == 0 and len(episode.segments) == 1


def test_anthropics_messages_api_is_served_whole_and_streamed_on_one_episode(vllm_engine):
    """An agent on the `anthropic` client: its turns (the second streamed, the first's blocks sent back)
    extend one segment; a forced tool is refused (400) as Anthropic's API words its errors; count_tokens
    counts the tokens the first call was prompted with; the models come in Anthropic's shapes."""
    finished = run(vllm_engine, samples(2), agent="agents_for_tests:speaks_messages")
    assert [o.status for o in finished.outcomes] == ["ok"] * 2, [o.error for o in finished.outcomes]
    for episode, outcome in zip(finished.episodes, finished.outcomes):
        assert outcome.info == {"first": 1.0, "streamed_is_the_message": 1.0, "forced": 400, "forced_is_anthropic_shaped": 1.0,
                                "counted_as_prompted": 1.0, "models": 1.0, "unknown_model": 404}
        assert episode.turns == 2 and episode.prefix_breaks == 0 and len(episode.segments) == 1


def test_the_endpoint_is_gone_when_the_rollout_ends(vllm_engine, tmp_path):
    left = tmp_path / "key.json"
    finished = run(vllm_engine, samples(1, path=str(left)), agent="agents_for_tests:remembers_its_key")
    assert finished.outcomes[0].status == "ok"
    url = json.loads(left.read_text())["base_url"]
    host, port = url.split("//")[1].split("/")[0].split(":")
    assert host == "127.0.0.1"
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


def test_an_environment_is_driven_by_the_engines_loop(vllm_engine):
    finished = run(vllm_engine, samples(4), n=2, env="agents_for_tests:CountingEnv", env_kwargs={"turns": 3},
                   max_tokens_per_turn=8)
    assert [o.status for o in finished.outcomes] == ["ok"] * 8
    assert [o.reward for o in finished.outcomes] == [0.75] * 8 and [e.turns for e in finished.episodes] == [3] * 8
    segment = finished.episodes[0].segments[0]
    shown = vllm_engine.tokenizer.decode([t for t, m in zip(segment.ids, segment.mask) if not m])
    assert shown.count("again") == 2 and len(finished.episodes[0].segments) == 1  # observations as user turns


def test_an_agent_program_gets_the_endpoint_and_the_sample(vllm_engine, tmp_path):
    program = tmp_path / "agent.py"
    program.write_text(
        "import json, os, sys\nfrom openai import OpenAI\n"
        "sample = json.load(sys.stdin)\n"
        "client = OpenAI(base_url=os.environ['OPENAI_BASE_URL'], api_key=os.environ['OPENAI_API_KEY'])\n"
        "reply = client.chat.completions.create(model=sample['model'], messages=sample['messages'], max_tokens=3)\n"
        "if sample['extra_info']['seed'] == 1: sys.exit('no luck')\n"
        "from anthropic import Anthropic\n"  # the same episode, on to its second turn through Anthropic's API
        "claude = Anthropic(base_url=os.environ['ANTHROPIC_BASE_URL'], api_key=os.environ['ANTHROPIC_API_KEY'])\n"
        "claude.messages.create(model=sample['model'], max_tokens=3, messages=[*sample['messages'], {'role': 'assistant', "
        "'content': reply.choices[0].message.content}, {'role': 'user', 'content': 'more'}])\n"
        "print('a log line'); print(json.dumps({'reward': len(reply.choices[0].message.content) / 10}))\n")
    finished = run(vllm_engine, samples(2), agent_command=[sys.executable, str(program)])
    (ok, failed) = finished.outcomes
    assert ok.status == "ok" and ok.reward is not None, ok.error
    assert finished.episodes[0].turns == 2 and len(finished.episodes[0].segments) == 1
    assert failed.status == "failed" and "exited with status 1" in failed.error and "no luck" in failed.error


def test_an_agent_that_blocks_its_loop_loses_the_rollout_not_the_run(vllm_engine, monkeypatch):
    monkeypatch.setattr(agents_rollout, "GRACE_S", 3)
    finished = run(vllm_engine, samples(2), agent="agents_for_tests:blocks_its_loop", timeout_s=2.0)
    assert [o.status for o in finished.outcomes] == ["timeout", "timeout"]
    again = run(vllm_engine, samples(2), agent="agents_for_tests:two_turns")  # a new agents' process
    assert [o.status for o in again.outcomes] == ["ok", "ok"] and [e.turns for e in again.episodes] == [2, 2]


def _tensor_parallel_rank(rank, world, model_dir):
    """One of two ranks of a t2 engine (gloo group made by dist_utils), both running the rollout."""
    from conftest import VLLM_TEST_OPTIONS
    from siirl_dag.placement.parallel_dims import ParallelDims
    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.vllm.rollout import VllmRollout

    engine = VllmRollout(RankContext(rank, ParallelDims(tp=2)), model_dir, dict(VLLM_TEST_OPTIONS))
    ctx = SimpleNamespace(engine=engine, validating=False, seed=7, rank=rank,
                          node=SimpleNamespace(id="agent", model="policy", params={**PARAMS, "agent": "agents_for_tests:two_turns"}),
                          data=SimpleNamespace(max_prompt_length=64, max_response_length=160))
    finished = [agents_rollout.run(ctx, samples(8), 2) for _ in range(2)]  # two rollouts: the group is made once
    engine.close()
    return finished


def test_a_tensor_parallel_engine_serves_agents_from_its_first_rank(tiny_model_dir):
    """t2: the first rank runs the agents and tells the other which turns to add and when to step; both
    give the same episodes, each of two turns."""
    first, second = run_ranks(_tensor_parallel_rank, 2, tiny_model_dir, timeout=400)
    for rollouts in (first, second):
        assert [[o.status for o in f.outcomes] for f in rollouts] == [["ok"] * 16] * 2
    for mine, theirs in zip(first, second):
        assert [e.turns for e in mine.episodes] == [2] * 16
        assert [(s.prompt_ids, s.ids, s.mask) for e in mine.episodes for s in e.segments] == \
            [(s.prompt_ids, s.ids, s.mask) for e in theirs.episodes for s in e.segments]
