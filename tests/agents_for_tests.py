"""Agents and environments the agent endpoint's tests run (in the agents' process, which imports them
by `module:function`): random ones for the token-faithfulness property, and ones that fail every way."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


async def random_agent(client, sample: dict):
    """1-4 turns of chat or completions calls with random follow-ups: user and tool messages, tools
    offered or not, log-probs, streamed answers, stop strings; now and then a rewritten history (a dropped
    turn, an edited reply, a fresh conversation), which starts a new segment; now and then a sub-agent's
    conversation beside the main one, its calls at the same time."""
    seed = sample["extra_info"]["seed"]
    rng = random.Random(seed)
    branches = [_random_turns(client, sample, rng)]
    if rng.random() < 0.3:
        helper = {**sample, "prompt": f"helper: {sample['prompt']}",
                  "messages": [{"role": "system", "content": "helper"}, *sample["messages"]]}
        branches.append(_random_turns(client, helper, random.Random(seed + 1000)))
    for result in await asyncio.gather(*branches, return_exceptions=True):
        # a rewritten history too long for a prompt: the agent stops there
        if isinstance(result, BaseException) and not (isinstance(result, openai.BadRequestError)
                                                      and result.code == "context_length_exceeded"):
            raise result
    return rng.random()


async def _random_turns(client, sample: dict, rng: random.Random) -> None:
    messages, prompt = list(sample["messages"]), sample["prompt"]
    for turn in range(rng.randint(1, 4)):
        if rng.random() < 0.25:  # completions, continuing the text as it came back
            answer = await client.completions.create(model=sample["model"], prompt=prompt, max_tokens=rng.randint(1, 6),
                                                     logprobs=rng.choice([None, 2]))
            prompt += answer.choices[0].text + rng.choice(["\nuser: more\nassistant:", " and", ""])
            continue
        kwargs = {"tools": TOOLS, "parallel_tool_calls": rng.random() < 0.5} if rng.random() < 0.5 else {}
        if rng.random() < 0.3:
            kwargs.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        if rng.random() < 0.2:
            kwargs["stop"] = ["e"]
        if not kwargs and rng.random() < 0.3:  # streamed: the text assembled from the chunks
            stream = await client.chat.completions.create(model=sample["model"], messages=messages, stream=True,
                                                          max_tokens=rng.randint(1, 8))
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            messages.append({"role": "assistant", "content": text})
        else:
            answer = await client.chat.completions.create(model=sample["model"], messages=messages,
                                                          max_tokens=rng.randint(1, 8), **kwargs)
            messages.append(answer.choices[0].message.model_dump(exclude_none=True))
        edit = rng.random()
        if edit < 0.1 and len(messages) > 2:
            messages = messages[:1] + messages[3:]  # a dropped exchange
        elif edit < 0.2:
            messages[-1] = {"role": "assistant", "content": "rewritten"}
        elif edit < 0.25:
            messages = [{"role": "system", "content": "fresh"}, *sample["messages"]]
        messages.append(rng.choice([{"role": "user", "content": rng.choice(["go on", "<eos> not a token", "ok"])},
                                    {"role": "tool", "tool_call_id": "x", "content": rng.choice(["42", "none"])}]))


async def two_turns(client, sample: dict):
    """Two chat turns, the reward left to the pipeline."""
    messages = list(sample["messages"])
    first = await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=8)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
    await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=8)
    return None


async def retries_after_its_timeout(client, sample: dict):
    """Over HTTP, as a client with a short timeout does: its first call gives up before the answer comes
    (the client hangs up), and after a back-off it asks again the same."""
    body = {"model": sample["model"], "messages": sample["messages"], "max_tokens": 48}  # a turn of some ms
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {client.api_key}"}) as http:
        try:
            await http.post(f"{client.base_url}chat/completions", json=body, timeout=httpx.Timeout(30.0, read=0.005))
        except httpx.ReadTimeout:
            pass
        else:
            raise AssertionError("answered within 5 ms")
        await asyncio.sleep(0.3)
        answer = await http.post(f"{client.base_url}chat/completions", json=body, timeout=30.0)
        assert answer.status_code == 200, answer.text
    return 1.0


async def retries_in_process(client, sample: dict):
    """The same with the client handed to the agent (answered without a socket): its timeout holds too."""
    body = {"model": sample["model"], "messages": sample["messages"], "max_tokens": 48}
    try:
        await client.with_options(timeout=0.005).chat.completions.create(**body)
    except openai.APITimeoutError:
        pass
    else:
        raise AssertionError("answered within 5 ms")
    await client.chat.completions.create(**body)
    return 1.0


def sync_retries_in_process(client, sample: dict):
    """The same, written without asyncio."""
    body = {"model": sample["model"], "messages": sample["messages"], "max_tokens": 48}
    try:
        client.with_options(timeout=0.005).chat.completions.create(**body)
    except openai.APITimeoutError:
        pass
    else:
        raise AssertionError("answered within 5 ms")
    client.chat.completions.create(**body)
    return 1.0


def sync_two_turns(client, sample: dict):
    """two_turns written without asyncio, as most harnesses are: an `openai.OpenAI` client, in a thread."""
    assert isinstance(client, openai.OpenAI), type(client)
    messages = list(sample["messages"])
    first = client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=8)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
    client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=8)
    return None


def _traced(solve):
    def wrapper(client, sample):  # a decorator that hides its function's async def
        return solve(client, sample)

    return wrapper


@_traced
async def hidden_async(client, sample: dict):
    return 1.0


def sync_sleeps_on_even(client, sample: dict):
    """A synchronous agent that, on even samples, sleeps through its timeout after its first turn."""
    client.chat.completions.create(model=sample["model"], messages=sample["messages"], max_tokens=4)
    if sample["extra_info"]["seed"] % 2 == 0:
        time.sleep(30)
    return 1.0


async def raises_on_a_third(client, sample: dict):
    """A user's agent of two chat turns that leaves the reward to the pipeline's reward node; but on every
    third prompt (by its operands) it raises after its first turn."""
    messages = list(sample["messages"])
    first = await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=8)
    if sum(sample["extra_info"]["numbers"]) % 3 == 0:
        raise RuntimeError("this agent fails on a third of its episodes")
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
    await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=8)
    return None


async def misbehaves(client, sample: dict):
    """By the sample's seed: raises, hangs past the timeout, returns no reward shape, or behaves."""
    kind = sample["extra_info"]["seed"] % 4
    await client.chat.completions.create(model=sample["model"], messages=sample["messages"], max_tokens=4)
    if kind == 0:
        raise ValueError("broken agent")
    if kind == 1:
        await asyncio.sleep(3600)
    if kind == 2:
        return "not a reward"
    return 0.5


async def blocks_its_loop(client, sample: dict):
    """A blocking call inside an async agent: it stalls the whole event loop of the agents' process."""
    await client.chat.completions.create(model=sample["model"], messages=sample["messages"], max_tokens=2)
    time.sleep(3600)


async def probes_the_endpoint(client, sample: dict):
    """What the endpoint answers to bad calls, as status codes (info). Run one episode at a time: each
    leaves its key in extra_info.dir, and the next tries it once its episode has ended."""
    import pathlib
    import re

    base, key, left = str(client.base_url).rstrip("/"), client.api_key, pathlib.Path(sample["extra_info"]["dir"])
    index = int(re.search(r"/episodes/(\d+)/", base).group(1))
    good = {"model": sample["model"], "messages": sample["messages"], "max_tokens": 2}
    async with httpx.AsyncClient(trust_env=False) as http:
        async def status(url, body=None, token=key, content=None):
            reply = await http.post(url, json=body, content=content, headers={"Authorization": f"Bearer {token}"})
            return reply.status_code, reply.json()["error"] if reply.status_code >= 400 else reply.json()

        codes = {"ok": (await status(f"{base}/chat/completions", good))[0],
                 "wrong_key": (await status(f"{base}/chat/completions", good, token="sk-wrong"))[0],
                 "other_episode": (await status(base.replace(f"/episodes/{index}/", f"/episodes/{index + 1}/")
                                                + "/chat/completions", good))[0],
                 "too_large": (await status(f"{base}/chat/completions", content=b"x" * (2 * 2**20)))[0],
                 "n2": (await status(f"{base}/chat/completions", {**good, "n": 2}))[0],
                 "forced_tool": (await status(f"{base}/chat/completions", {**good, "tool_choice": "required"}))[0],
                 "not_json": (await status(f"{base}/chat/completions", content=b"{oops"))[0],
                 "nested_too_deeply": (await status(f"{base}/chat/completions", content=b"[" * 100_000))[0],
                 "deep_arguments": (await status(f"{base}/chat/completions", {**good, "messages": [
                     *good["messages"], {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                         "function": {"name": "f", "arguments": "[" * 100_000}}]},
                     {"role": "tool", "tool_call_id": "c", "content": "1"}]}))[0],
                 "deep_body": (await status(f"{base}/chat/completions", content=json.dumps(
                     {**good, "metadata": json.loads("[" * 150 + "]" * 150)}).encode()))[0],
                 "not_a_number": (await status(f"{base}/chat/completions", content=b'{"model": "policy", "max_tokens": NaN}'))[0],
                 "lone_surrogate": "lone UTF-16 surrogate" in (await status(f"{base}/chat/completions", content=json.dumps(
                     {**good, "messages": [{"role": "user", "content": "\ud800"}]}).encode()))[1]["message"],
                 "template_of_its_own": (await status(f"{base}/chat/completions", {
                     **good, "chat_template_kwargs": {"chat_template": "{{ 'X' }}"}}))[0]}
        for earlier in left.glob("key-*"):  # an ended episode's key
            codes["reused_key"] = (await status(f"{base.split('/episodes/')[0]}/v1/chat/completions", good,
                                                token=earlier.read_text()))[0]
        (left / f"key-{index}").write_text(key)
        code, error = await status(f"{base}/chat/completions", {**good, "model": "gpt-4"})
        codes["wrong_model"] = code
        codes["no_such_path"] = (await status(f"{base}/chat/completion", good))[0]
        codes["wrong_method"] = (await http.get(f"{base}/chat/completions", headers={"Authorization": f"Bearer {key}"})).status_code
        codes["lowercase_bearer"] = (await http.get(f"{base}/models", headers={"Authorization": f"bearer {key}"})).status_code
        models = (await http.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"})).json()
    # the client handed to the agent answers in-process: the same answers, as the openai package raises them
    for name, call in {"client_wrong_model": client.chat.completions.create(**{**good, "model": "gpt-4"}),
                       "client_n2": client.chat.completions.create(**good, n=2),
                       "client_too_large": client.completions.create(model=sample["model"], prompt="x" * (2 * 2**20)),
                       "client_out_of_vocabulary": client.completions.create(model=sample["model"], prompt=[10**6])}.items():
        try:
            await call
            codes[name] = 200
        except openai.APIStatusError as exc:
            codes[name] = exc.status_code
    retrieved = await client.models.retrieve(sample["model"])
    served = sample["model"] in error["message"] and models["data"][0]["id"] == sample["model"] == retrieved.id
    return {"reward": 1.0, "info": {**codes, "names_the_model": float(served)}}


async def speaks_responses(client, sample: dict):
    """Two turns through the Responses API as a harness calls it: the first whole, the second streamed with
    the first's output items sent back; then, over HTTP, a call that asks the endpoint to remember (400)."""
    first = await client.responses.create(model=sample["model"], input=sample["prompt"], max_output_tokens=4)
    items = [{"role": "user", "content": sample["prompt"]}, *(item.model_dump(exclude_none=True) for item in first.output),
             {"role": "user", "content": "and then?"}]
    kinds, deltas, last = [], [], None
    async with await client.responses.create(model=sample["model"], input=items, max_output_tokens=4, stream=True) as stream:
        async for event in stream:
            kinds.append(event.type)
            deltas += [event.delta] if event.type == "response.output_text.delta" else []
            last = event.response if event.type in ("response.completed", "response.incomplete") else last
    async with httpx.AsyncClient(trust_env=False) as http:
        remote = openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key, http_client=http, max_retries=0)
        try:
            await remote.responses.create(model=sample["model"], input="hi", previous_response_id=first.id)
            chained = 200
        except openai.APIStatusError as exc:
            chained = exc.status_code
    return {"reward": 1.0, "info": {
        "first_has_text": float(first.status in ("completed", "incomplete") and first.usage.output_tokens > 0
                                and first.output[0].type == "message"),
        "stream_ends_with_the_response": float(kinds[0] == "response.created" and last is not None
                                               and "".join(deltas) == last.output_text),
        "chained": chained}}


def _claude(client):
    """An `anthropic` client at the episode's endpoint: its base URL without /v1, its key."""
    import anthropic

    return anthropic.AsyncAnthropic(base_url=str(client.base_url).rstrip("/").removesuffix("/v1"), api_key=client.api_key,
                                    max_retries=0)


async def anthropic_calculator(client, sample: dict) -> dict:
    """The openai demo's agent (nodes/demo_agents.py) written against the `anthropic` client, over HTTP at the
    episode's base URL without its /v1: the calculator as a client tool, its answers as tool_result blocks."""
    from nodes.algos.scorers import gsm8k_score
    from nodes.demo_agents import CALCULATOR, calculate

    function = CALCULATOR["function"]
    tool = {"name": function["name"], "description": function["description"], "input_schema": function["parameters"]}
    async with _claude(client) as claude:
        messages, calls = [{"role": "user", "content": sample["prompt"]}], 0
        for _ in range(2):
            reply = await claude.messages.create(model=sample["model"], max_tokens=4096, messages=messages, tools=[tool],
                                                 tool_choice={"type": "auto", "disable_parallel_tool_use": True})
            messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]})
            uses = [block for block in reply.content if block.type == "tool_use"]
            if not uses:
                break
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                          "content": calculate(json.dumps(use.input))} for use in uses]})
            calls += len(uses)
    answer = "".join(block.text for block in reply.content if block.type == "text")
    return {"reward": gsm8k_score(answer, sample["ground_truth"]), "info": {"tool_calls": calls}}


async def speaks_messages(client, sample: dict):
    """Two turns through Anthropic's Messages API, the second streamed with the first's blocks sent back;
    then a forced tool (400, in Anthropic's error shape); the first call's messages counted; the models."""
    import anthropic

    async with _claude(client) as claude:
        first = await claude.messages.create(model=sample["model"], max_tokens=4, system="be brief",
                                             messages=[{"role": "user", "content": sample["prompt"]}])
        history = [{"role": "user", "content": sample["prompt"]},
                   {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
                   {"role": "user", "content": "and then?"}]
        async with claude.messages.stream(model=sample["model"], max_tokens=4, system="be brief", messages=history) as stream:
            streamed = "".join([text async for text in stream.text_stream])
            final = await stream.get_final_message()
        try:
            await claude.messages.create(model=sample["model"], max_tokens=4, messages=history, tool_choice={"type": "any"},
                                         tools=[{"name": "f", "input_schema": {"type": "object"}}])
            forced = (200, "")
        except anthropic.APIStatusError as exc:
            forced = (exc.status_code, exc.body["error"]["type"])
        counted = await claude.messages.count_tokens(model=sample["model"], system="be brief",
                                                     messages=[{"role": "user", "content": sample["prompt"]}])
        listed = [model.id async for model in claude.models.list()]
        retrieved = await claude.models.retrieve(sample["model"])
        try:
            await claude.models.retrieve("another")
            unknown = 200
        except anthropic.NotFoundError as exc:
            unknown = exc.status_code if exc.body["error"]["type"] == "not_found_error" else 0
    return {"reward": 1.0, "info": {
        "counted_as_prompted": float(counted.input_tokens == first.usage.input_tokens),
        "models": float(listed == [sample["model"]] and retrieved.id == sample["model"] and retrieved.type == "model"),
        "unknown_model": unknown,
        "first": float(first.stop_reason in ("end_turn", "max_tokens") and first.usage.output_tokens > 0),
        "streamed_is_the_message": float(streamed == "".join(b.text for b in final.content if b.type == "text")
                                         and final.usage.output_tokens > 0),
        "forced": forced[0], "forced_is_anthropic_shaped": float(forced[1] == "invalid_request_error")}}


async def takes_the_client_only(client):
    """An agent written with the wrong signature: refused at validate."""
    return 1.0


async def remembers_its_key(client, sample: dict):
    """Leaves its address and key where the test finds them (to call again after the rollout)."""
    await client.chat.completions.create(model=sample["model"], messages=sample["messages"], max_tokens=2)
    with open(sample["extra_info"]["path"], "w") as f:
        json.dump({"base_url": str(client.base_url), "key": client.api_key}, f)
    return 1.0


class CountingEnv:
    """A gym-shaped environment: asks for `turns` answers, rewards each with 0.25, ends after the last."""

    def __init__(self, turns: int = 2):
        self.turns, self.seen = turns, 0

    def reset(self, sample: dict):
        return f"count to {self.turns}: {sample['prompt']}"

    def step(self, text: str):
        self.seen += 1
        done = self.seen >= self.turns
        return ("" if done else f"you said {len(text)} characters; again"), 0.25, done


def _calculate(expression: str) -> str:
    from nodes.tools.calculator import evaluate

    try:
        return str(evaluate(expression))
    except ValueError as exc:  # the model's expression: its mistake is the tool's answer
        return f"error: {exc}"


async def openai_agents_sdk(client, sample: dict, responses_api: bool = False, streamed: bool = False):
    """The calculator agent as the OpenAI Agents SDK writes it, on its chat completions model (or its
    Responses model; `streamed`: run with `Runner.run_streamed`, every event read)."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression, e.g. 123+456*2."""
        return _calculate(expression)

    model = (OpenAIResponsesModel if responses_api else OpenAIChatCompletionsModel)(model=sample["model"], openai_client=client)
    agent = Agent(name="solver", tools=[calculator], model=model, model_settings=ModelSettings(parallel_tool_calls=False))
    if streamed:
        result = Runner.run_streamed(agent, sample["prompt"], max_turns=3)
        deltas = [event async for event in result.stream_events() if event.type == "raw_response_event"]
        if not deltas:
            raise AssertionError("the streamed run gave no model events")
    else:
        result = await Runner.run(agent, sample["prompt"], max_turns=3)
    return float(f"#### {sample['ground_truth']}" in str(result.final_output))


async def openai_agents_sdk_responses(client, sample: dict):
    """The same agent on the Agents SDK's default model, which calls the Responses API (/v1/responses)."""
    return await openai_agents_sdk(client, sample, responses_api=True)


async def openai_agents_sdk_streamed(client, sample: dict):
    """The same agent on the Responses API, run as a UI runs it: `Runner.run_streamed`, events read as they come."""
    return await openai_agents_sdk(client, sample, responses_api=True, streamed=True)


async def langgraph_react(client, sample: dict):
    """The calculator agent as LangGraph's prebuilt ReAct agent over LangChain's ChatOpenAI."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression, e.g. 123+456*2."""
        return _calculate(expression)

    # the client handed to the agent (answered in-process): LangChain's own would go over HTTP
    model = ChatOpenAI(model=sample["model"], api_key=client.api_key, root_async_client=client,
                       async_client=client.chat.completions, max_retries=0)
    graph = create_react_agent(model.bind_tools([calculator], parallel_tool_calls=False), [calculator])
    state = await graph.ainvoke({"messages": [("user", sample["prompt"])]}, {"recursion_limit": 6})
    return float(f"#### {sample['ground_truth']}" in str(state["messages"][-1].content))


async def langgraph_parallel(client, sample: dict):
    """Two LangGraph branches at once, the solver and a checker with a system prompt of its own, then the
    solver told what the checker said: two conversations in one episode, the solver's continued after
    the other's turn."""
    from typing import TypedDict

    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    model = ChatOpenAI(model=sample["model"], api_key=client.api_key, root_async_client=client,
                       async_client=client.chat.completions, max_retries=0, max_tokens=8)

    class State(TypedDict, total=False):
        solver: list
        checker: str
        answer: str

    async def solve(state: State) -> State:
        asked = [("user", sample["prompt"])]
        return {"solver": asked + [await model.ainvoke(asked)]}

    async def check(state: State) -> State:
        return {"checker": (await model.ainvoke([("system", "Check."), ("user", sample["prompt"])])).content}

    async def decide(state: State) -> State:
        told = ("user", f"Checker: {state['checker'][:8]}")
        return {"answer": (await model.ainvoke(state["solver"] + [told])).content}

    graph = StateGraph(State)
    for name, node in (("solve", solve), ("check", check), ("decide", decide)):
        graph.add_node(name, node)
    graph.add_edge(START, "solve")
    graph.add_edge(START, "check")
    graph.add_edge(["solve", "check"], "decide")
    graph.add_edge("decide", END)
    state = await graph.compile().ainvoke({})
    return float(f"#### {sample['ground_truth']}" in state["answer"])
