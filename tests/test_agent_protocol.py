"""The agent endpoint's pure logic with the tiny model's tokenizer (no engine: the real engine runs in
test_agent_endpoint.py): requests read or refused as OpenAI's server would, replies as OpenAI shapes them,
episodes' token bookkeeping, the reward node's use of agents' rewards, mini batches of ragged rows."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nodes.agents import messages_api, openai_api, responses_api
from nodes.agents.episode import Episode, Limits, TooLong, normalize
from nodes.agents.openai_api import ApiError
from nodes.agents.server import Reply
from nodes.chat_render import ChatRender
from siirl_dag.strategies.megatron import batching


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


USER = [{"role": "user", "content": "Q: 1+1=? A:"}]


def read(body: dict, chat: bool = True):
    return openai_api.read({"model": "policy", **body}, "policy", chat)


@pytest.mark.parametrize("body, status, param", [
    ({"messages": USER, "model": "gpt-4"}, 404, "model"),
    ({"messages": USER, "n": 3}, 400, "n"),
    ({"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400, "messages.0.content"),
    ({"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": USER, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
    ({"messages": USER, "stop": [""]}, 400, "stop"),
    ({"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": USER, "n": True}, 400, "n"),
])
def test_requests_that_would_change_what_is_sampled_or_do_not_parse_are_refused(body, status, param):
    with pytest.raises(ApiError) as info:
        read(body)
    assert (info.value.status, info.value.param) == (status, param)
    assert info.value.body()["error"]["message"]


def test_a_request_is_read_into_what_the_turn_needs():
    req = read({"messages": [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                             *USER], "temperature": 0.2, "max_completion_tokens": 5, "stop": "x", "logprobs": True,
                "top_logprobs": 2, "tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": False,
                "stream": True, "stream_options": {"include_usage": True}})
    assert req.messages[0] == {"role": "system", "content": "be brief"}  # developer is the system turn, parts joined
    assert (req.max_tokens, req.stop, req.top_logprobs, req.overridden) == (5, ["x"], 2, True)
    assert req.parse_tool_calls and req.one_call_per_turn and req.stream and req.include_usage
    assert read({"prompt": ["text"]}, chat=False).prompt == "text" and read({"prompt": [1, 2]}, chat=False).prompt == [1, 2]
    assert read({"messages": USER, "max_completion_tokens": None, "max_tokens": 3}).max_tokens == 3
    with pytest.raises(ApiError):
        read({"prompt": "x", "echo": True}, chat=False)
    with pytest.raises(ApiError):  # booleans are not token ids
        read({"prompt": [True, False]}, chat=False)


def test_tool_calls_come_back_in_openai_shape_and_malformed_ones_stay_text():
    req = read({"messages": USER, "tools": [{"type": "function", "function": {"name": "calc"}}]})
    text = 'let me see <tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call><tool_call>{oops</tool_call>'
    message, finish = openai_api.assistant_message(req, text, "call-0-0")
    assert finish == "tool_calls" and message["tool_calls"] == [
        {"id": "call-0-0-0", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}]
    assert message["content"] == "let me see <tool_call>{oops</tool_call>"
    plain, finish = openai_api.assistant_message(read({"messages": USER}), text, "c")
    assert plain == {"role": "assistant", "content": text} and finish is None  # no tools offered: all text
    assert openai_api.turn_text(read({"messages": USER, "stop": ["END"]}), "fine END", "stop") == "fine "


def test_a_streamed_answer_is_the_message_then_the_finish():
    answer = openai_api.chat_answer("id", "policy", {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "tool_calls",
        {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}, None)
    first, last, usage = openai_api.stream_chunks(answer, include_usage=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert "content" not in first["choices"][0]["delta"] and last["choices"][0]["finish_reason"] == "tool_calls"
    assert usage["usage"]["total_tokens"] == 3 and usage["choices"] == []


def test_log_probs_come_back_as_the_sampled_tokens_and_their_alternatives(tokenizer):
    sample = SimpleNamespace(token_ids=[70, 71], logprobs=[-0.5, -1.5], top_logprobs=[[(70, -0.5), (9, -2.0)], [(5, -1.0)]])
    content = openai_api.logprobs_content(tokenizer, sample)
    assert [(c["token"], c["logprob"]) for c in content] == [(tokenizer.decode([70]), -0.5), (tokenizer.decode([71]), -1.5)]
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5, -2.0] and content[1]["top_logprobs"][0]["token"] == \
        tokenizer.decode([5])
    assert content[0]["bytes"] == list(tokenizer.decode([70]).encode())


CALC = {"type": "function", "name": "calc", "description": "adds", "parameters": {"type": "object"}, "strict": True}


def read_responses(body: dict) -> responses_api.ResponsesRequest:
    return responses_api.read({"model": "policy", **body}, "policy")


@pytest.mark.parametrize("body, status, param", [
    ({"input": "hi", "model": "gpt-4.1"}, 404, "model"),
    ({"input": "hi", "previous_response_id": "resp-1"}, 400, "previous_response_id"),
    ({"input": "hi", "conversation": "conv-1"}, 400, "conversation"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, 400, "text.format"),
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, 400, "tools.0"),
    ({"input": "hi", "tools": [CALC], "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input.0.content"),
    ({"input": [{"role": "wizard", "content": "x"}]}, 400, "input.0"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, 400, "input.0"),
    ({"input": [{"type": "function_call", "name": "calc"}]}, 400, "input.0"),
])
def test_responses_requests_the_endpoint_cannot_serve_faithfully_are_refused(body, status, param):
    with pytest.raises(ApiError) as info:
        read_responses(body)
    assert (info.value.status, info.value.param) == (status, param)
    assert info.value.body()["error"]["message"]


def test_a_responses_request_is_the_chat_turn_the_chat_api_would_ask():
    """Instructions, items and flat tools read into the messages and tools a chat client sends for the same
    conversation (the Agents SDK's two models, say): the same prompt, so the same tokens."""
    asked = read_responses({
        "instructions": "be brief", "tools": [CALC], "parallel_tool_calls": False, "max_output_tokens": 7,
        "include": ["message.output_text.logprobs"], "top_logprobs": 2, "temperature": 0.3, "stream": True,
        "input": [{"role": "user", "content": "Q: 1+1=? A:"},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me see",
                                                                         "annotations": []}]},
                  {"type": "function_call", "call_id": "c0", "name": "calc", "arguments": '{"x": 1}'},
                  {"type": "function_call_output", "call_id": "c0", "output": "2"},
                  {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}"}]})
    req = asked.chat
    assert req.messages == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "Q: 1+1=? A:"},
        {"role": "assistant", "content": "let me see", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "2"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]}]
    # key for key the chat shape the Agents SDK's chat model sends: the template renders them alike
    assert req.tools == [{"type": "function", "function": {"name": "calc", "description": "adds",
                                                            "parameters": {"type": "object"}, "strict": True}}]
    assert json.dumps(req.tools[0]["function"]) == json.dumps({k: CALC[k] for k in ("name", "description", "parameters", "strict")})
    assert (req.max_tokens, req.logprobs, req.top_logprobs, req.overridden, req.stream) == (7, True, 2, True, True)
    assert req.parse_tool_calls and req.one_call_per_turn
    assert read_responses({"input": "hi"}).chat.messages == [{"role": "user", "content": "hi"}]
    reasoned = read_responses({"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "hi"}]})
    assert reasoned.chat.messages == [{"role": "user", "content": "hi"}]  # another model's reasoning: not rendered


def test_a_turn_comes_back_as_a_response_and_as_its_events():
    asked = read_responses({"input": "hi", "tools": [CALC]})
    message = {"role": "assistant", "content": "let me see", "tool_calls": [
        {"id": "call-0-1-0", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}]}
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
    response = responses_api.answer(openai_api.chat_answer("chatcmpl-0-1", "policy", message, "tool_calls", usage, None), asked)
    assert response["status"] == "completed" and response["incomplete_details"] is None
    text, call = response["output"]
    assert text["type"] == "message" and text["content"][0]["text"] == "let me see"
    assert (call["type"], call["call_id"], call["name"], call["arguments"]) == ("function_call", "call-0-1-0", "calc", '{"x": 1}')
    assert response["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 9,
                                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14}
    # what an agent sends back next is the conversation it had: read, it is the assistant message the turn made
    echoed = read_responses({"input": [{"role": "user", "content": "hi"}, *response["output"]], "tools": [CALC]})
    assert normalize(echoed.chat.messages[-1]) == normalize(message)
    events = responses_api.stream_events(response)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed" and events[-1]["response"] == response
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["delta"] for e in events if e["type"].endswith(".delta")] == ["let me see", '{"x": 1}']
    assert Reply(200, response, events, named=True).payload()[0].startswith(b"event: response.created\ndata: {")
    cut = responses_api.answer(openai_api.chat_answer("chatcmpl-0-2", "policy", {"role": "assistant", "content": "ab"},
                                                      "length", usage, None), asked)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert responses_api.stream_events(cut)[-1]["type"] == "response.incomplete"


def read_messages(body: dict) -> messages_api.MessagesRequest:
    return messages_api.read({"model": "policy", "max_tokens": 8, **body}, "policy")


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, status, param", [
    ({"messages": HI, "model": "claude-x"}, 404, "model"),
    ({"messages": HI, "max_tokens": None}, 400, "max_tokens"),
    ({"messages": HI, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
    ({"messages": HI, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ({"messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools.0"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "messages.0"),
    ({"messages": [*HI, {"role": "assistant", "content": "The answer is"}]}, 400, "messages.1"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400,
     "messages.0.content.0"),
])
def test_messages_requests_the_endpoint_cannot_serve_faithfully_are_refused(body, status, param):
    with pytest.raises(ApiError) as info:
        read_messages(body)
    assert (info.value.status, info.value.param) == (status, param)
    shaped = messages_api.error_body(info.value)
    assert shaped["type"] == "error" and shaped["error"]["message"] and shaped["error"]["type"].endswith("error")


def test_count_tokens_reads_a_messages_body_without_its_max_tokens_and_refuses_what_a_turn_refuses():
    counted = messages_api.read({"model": "policy", "messages": HI, "system": "be brief"}, "policy", counting=True)
    assert counted.chat.messages == [{"role": "system", "content": "be brief"}, *HI] and counted.chat.max_tokens is None
    with pytest.raises(ApiError) as info:
        messages_api.read({"model": "policy", "messages": HI, "tool_choice": {"type": "any"}}, "policy", counting=True)
    assert info.value.param == "tool_choice"


def test_a_messages_request_is_the_chat_turn_and_its_answer_reads_back_as_the_turn():
    asked = read_messages({
        "system": [{"type": "text", "text": "be brief"}], "stop_sequences": ["END"], "top_k": 5, "stream": True,
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "tools": [{"name": "calc", "description": "adds", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": "Q: 1+1=? A:"},
                     {"role": "assistant", "content": [{"type": "text", "text": "let me see"},
                                                       {"type": "tool_use", "id": "t0", "name": "calc", "input": {"x": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t0", "content": "2"},
                                                  {"type": "text", "text": "sure?"}]}]})
    req = asked.chat
    assert req.messages == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "Q: 1+1=? A:"},
        {"role": "assistant", "content": "let me see", "tool_calls": [
            {"id": "t0", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "t0", "content": "2"}, {"role": "user", "content": "sure?"}]
    assert req.tools == [{"type": "function", "function": {"name": "calc", "description": "adds", "parameters": {"type": "object"}}}]
    assert (req.max_tokens, req.stop, req.overridden, req.stream, req.one_call_per_turn) == (8, ["END"], True, True, True)
    message = {"role": "assistant", "content": "let me see", "tool_calls": [
        {"id": "call-0-1-0", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}]}
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
    reply = messages_api.answer(openai_api.chat_answer("chatcmpl-0-1", "policy", message, "tool_calls", usage, None), asked)
    assert reply["stop_reason"] == "tool_use" and reply["usage"] == {"input_tokens": 5, "output_tokens": 9}
    assert reply["content"] == [{"type": "text", "text": "let me see"},
                                {"type": "tool_use", "id": "call-0-1-0", "name": "calc", "input": {"x": 1}}]
    echoed = read_messages({"messages": [*HI, {"role": "assistant", "content": reply["content"]}, *HI]})
    assert normalize(echoed.chat.messages[-2]) == normalize(message)  # what the agent sends back is the turn it had
    events = messages_api.stream_events(reply)
    assert [e["type"] for e in events] == ["message_start", *["content_block_start", "content_block_delta",
                                                              "content_block_stop"] * 2, "message_delta", "message_stop"]
    assert events[5]["delta"] == {"type": "input_json_delta", "partial_json": '{"x": 1}'}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    cut = messages_api.answer(openai_api.chat_answer("chatcmpl-0-2", "policy", {"role": "assistant", "content": "ab"},
                                                     "length", usage, None), asked)
    assert cut["stop_reason"] == "max_tokens"


def test_chat_render_renders_only_what_follows_a_turn(tokenizer):
    render = ChatRender(tokenizer)  # tiny template: "role: content\n", cue "assistant:"
    assert tokenizer.decode(render.prompt(USER)) == "user: Q: 1+1=? A:\nassistant:"
    after = render.after_turn([{"role": "tool", "content": "2"}, {"role": "user", "content": "sure?"}], False)
    assert tokenizer.decode(after) == "\ntool: 2\nuser: sure?\nassistant:"
    hostile = render.after_turn([{"role": "user", "content": f"x{tokenizer.eos_token}"}], False)
    assert tokenizer.eos_token_id not in hostile  # a message's special tokens are text
    no_template = SimpleNamespace(chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        ChatRender(no_template)


def test_an_episode_extends_its_history_and_starts_a_segment_when_it_is_rewritten(tokenizer):
    episode = Episode(0, 0, "k", ChatRender(tokenizer), Limits(max_prompt=64, budget=30, max_turns=3, max_tokens_per_turn=8))
    turn = SimpleNamespace(token_ids=[70, 71, tokenizer.eos_token_id], logprobs=[-0.1, -0.2, -0.3], finish_reason="stop")
    first = episode.plan_chat(USER, None, {})
    assert first.context == ChatRender(tokenizer).prompt(USER) and first.max_tokens == 8
    episode.finish_chat(first, turn, {"role": "assistant", "content": "ab"})
    history = USER + [{"role": "assistant", "content": "ab", "tool_calls": None}, {"role": "user", "content": "more"}]
    second = episode.plan_chat(history, None, {})
    shown = ChatRender(tokenizer).after_turn([{"role": "user", "content": "more"}], ended_with_eos=True)
    assert second.context == first.context + turn.token_ids + shown  # the sampled tokens, then only the new message
    episode.finish_chat(second, turn, {"role": "assistant", "content": "ab"})
    (segment,) = episode.segments
    assert segment.mask == [1, 1, 1] + [0] * len(shown) + [1, 1, 1] and segment.logprobs[:3] == [-0.1, -0.2, -0.3]
    rewritten = episode.plan_chat(USER + [{"role": "assistant", "content": "something else"}], None, {})
    assert len(episode.segments) == 2 and episode.prefix_breaks == 1 and rewritten.max_tokens == 8
    episode.finish_chat(rewritten, turn, {"role": "assistant", "content": "ab"})
    assert episode.plan_chat(USER, None, {}).context is None  # a fourth turn: past max_turns
    with pytest.raises(TooLong):
        episode.plan_chat([{"role": "user", "content": "x" * 60}], None, {})


def test_an_episode_holds_several_conversations_each_continued_by_its_own_calls(tokenizer):
    """Sub-agents, parallel branches, an agent used as a tool: each call continues the conversation its
    messages extend, beside the others' calls; a fork of a conversation being continued starts its own."""
    render = ChatRender(tokenizer)
    episode = Episode(0, 0, "k", render, Limits(max_prompt=64, budget=200, max_turns=7, max_tokens_per_turn=8))
    turn = SimpleNamespace(token_ids=[70, 71], logprobs=[-0.5, -0.5], finish_reason="stop")
    helper = [{"role": "system", "content": "helper"}, {"role": "user", "content": "sub"}]

    def reply(messages, text="ab"):
        return messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]

    main = episode.plan_chat(USER, None, {})
    episode.finish_chat(main, turn, {"role": "assistant", "content": "ab"})
    sub = episode.plan_chat(helper, None, {})  # the agent used as a tool: a conversation of its own
    episode.finish_chat(sub, turn, {"role": "assistant", "content": "ab"})
    assert episode.prefix_breaks == 0 and len(episode.segments) == 2  # another conversation, no break
    # both continued at once: each after its own tokens, with only its new message rendered
    again, sub_again = episode.plan_chat(reply(USER), None, {}), episode.plan_chat(reply(helper), None, {})
    shown = render.after_turn([{"role": "user", "content": "more"}], ended_with_eos=False)
    assert again.context == main.context + [70, 71] + shown and sub_again.context == sub.context + [70, 71] + shown
    assert (again.number, sub_again.number, episode.in_flight) == (2, 3, 2)  # seeds and ids apart
    fork = episode.plan_chat(reply(USER), None, {})  # the same conversation while a call continues it
    assert fork.context == render.prompt(reply(USER)) and len(episode.segments) == 3
    episode.release(fork)  # refused or cancelled: no turn, and no segment left
    episode.finish_chat(sub_again, turn, {"role": "assistant", "content": "ab"})
    episode.finish_chat(again, turn, {"role": "assistant", "content": "ab"})
    assert episode.in_flight == 0 and episode.turns == 4 and episode.prefix_breaks == 0  # not the released fork
    first, second = episode.segments
    assert first.ids == [70, 71] + shown + [70, 71] and second.ids == first.ids
    assert episode.record().rows() == [second, first]  # the turn that finished last is the final answer's row
    # two calls alike at once: two segments alike; one refused takes its own away, not its twin's
    twin, other = episode.plan_chat(USER, None, {}), episode.plan_chat(USER, None, {})
    twin_segment = episode.segments[-2]
    episode.release(other)
    episode.finish_chat(twin, turn, {"role": "assistant", "content": "ab"})
    assert episode.segments[-1] is twin_segment and twin_segment.ids == [70, 71] and len(episode.segments) == 3
    assert episode.prefix_breaks == 1  # it opens as the first does: a fork
    # a released call leaves its conversation to be continued as before
    late = episode.plan_chat(reply(reply(USER)), None, {})
    assert late.context is not None
    episode.release(late)
    again = episode.plan_chat(reply(reply(USER)), None, {})
    assert again.context == late.context and again.number == late.number + 1  # never a live call's number
    assert episode.plan_chat(reply(reply(helper)), None, {}).context is not None
    assert episode.plan_chat(helper, None, {}).context is None  # past max_turns, with the turns in flight
    assert episode.past_limits == 1 and episode.record().past_limits == 1


def test_an_episodes_calls_past_max_turns_are_seeded_apart_from_the_next_episodes():
    from nodes.agents.service import turn_seed

    assert [turn_seed(11, 3, k, 4) for k in range(4)] == [11 + 12 + k for k in range(4)]  # the engine's own loop's
    seeds = {turn_seed(11, e, k, 4) for e in range(64) for k in range(12)}  # retries: numbers past max_turns
    assert len(seeds) == 64 * 12


def test_completions_extend_an_episode_as_text_or_as_token_ids(tokenizer):
    episode = Episode(0, 0, "k", ChatRender(tokenizer), Limits(40, 12, 5, 8))
    turn = SimpleNamespace(token_ids=[70, 71], logprobs=[-1.0, -1.0], finish_reason="length")
    first = episode.plan_text("Q:")
    episode.finish_text(first, turn, "ab")
    second = episode.plan_text("Q:ab and")
    assert second.context == first.context + [70, 71] + tokenizer.encode(" and", add_special_tokens=False)
    episode.finish_text(second, turn, "cd")
    ids = episode.plan_text(first.context)  # ids, not the text the episode holds: a new segment
    assert len(episode.segments) == 2 and episode.prefix_breaks == 1 and ids.context == first.context
    episode.finish_text(ids, turn, "ab")
    assert episode.plan_text(first.context + [70, 71, 5]).context == first.context + [70, 71, 5]  # ids extend ids
    assert normalize({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}) \
        == normalize({"role": "assistant", "content": "", "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": {"a": 1}}}]})


def test_the_reward_node_takes_an_agents_reward_and_scores_the_rest_on_their_final_answers(tokenizer):
    from nodes.reward import _scores

    nan = math.nan
    right, wrong = tokenizer.encode(" #### 2", add_special_tokens=False), tokenizer.encode(" #### 3", add_special_tokens=False)
    width = max(len(right), len(wrong))
    rows = [wrong, right, wrong, wrong]  # episode a: two segments, its answer in the last; b: its own reward; c
    batch = {"responses": torch.tensor([r + [0] * (width - len(r)) for r in rows]),
             "response_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
             "agent_reward": torch.tensor([nan, nan, 0.25, nan]), "episode": ["u#a", "u#a", "u#b", "u#c"],
             "data_source": ["gsm8k"] * 4, "ground_truth": ["2"] * 4}
    ctx = SimpleNamespace(tokenizer=tokenizer, metrics={})
    params = {"scorer": "auto", "method": "strict", "format_score": 0.0}
    assert _scores(batch, ctx, params) == [1.0, 1.0, 0.25, 0.0] and ctx.metrics["reward/from_agent"] == 0.25
    assert _scores(batch, ctx, {**params, "scorer": "agent"}) == [0.0, 0.0, 0.25, 0.0] and ctx.metrics["reward/unscored"] == 2


@pytest.mark.parametrize("rows, total, widest, mini, micro, dp, parts, size", [
    (8, 8, 8, 4, 2, 1, [(0, 4), (4, 8)], 4),  # whole mini batches: cut as they are
    (7, 7, 7, 4, 2, 1, [(0, 4), (4, 7)], 4),  # round(7 / 4) = 2 mini batches, each padded to 4 rows
    (11, 11, 11, 8, 4, 1, [(0, 11)], 12),  # round(11 / 8) = 1, padded to whole micro batches
    (3, 7, 4, 8, 2, 2, [(0, 3)], 4),  # the rank holding 3 of 7 pads to the widest rank's 4
    (13, 13, 13, 4, 1, 1, [(0, 4), (4, 9), (9, 13)], 5),  # round(13 / 4) = 3 of at most 5 rows
])
def test_ragged_rows_spread_over_the_nearest_number_of_mini_batches(rows, total, widest, mini, micro, dp, parts, size):
    found, padded, micro_size = batching.mini_batches(rows, total, widest, mini, micro, 16, dp, None, 1, 1)
    assert (found, padded, micro_size) == (parts, size, micro)


OPENAI_GRAPH = Path(__file__).resolve().parents[1] / "graphs" / "tiny_agent_openai_cpu.yaml"


def door_problems(model_dir, *overrides: str) -> dict[str, str]:
    from siirl_dag.config import load_pipeline
    from siirl_dag.errors import ConfigError, format_path

    with pytest.raises(ConfigError) as exc:
        load_pipeline(OPENAI_GRAPH, [f"models.policy.path={model_dir}", *overrides])
    return {format_path(p.path): p.message for p in exc.value.problems if p.severity == "error"}


def test_agents_are_checked_at_the_door(tiny_model_dir, tmp_path):
    from siirl_dag.config import load_pipeline

    params = "nodes[0].params"
    both = door_problems(tiny_model_dir, "+nodes.agent.params.tools=[calculator]")[params]
    assert "tools and agent are given" in both and "set the other to null (nodes.agent.params.tools=null)" in both
    assert door_problems(tiny_model_dir, "nodes.agent.params.agent=my_agent")[params + ".agent"].startswith(
        "unknown agent 'my_agent'; expected module:function (a colon")
    assert "cannot be called as solve(client, sample): its arguments are (client)" in door_problems(
        tiny_model_dir, "nodes.agent.params.agent=agents_for_tests:takes_the_client_only")[params + ".agent"]
    assert "cannot import module 'no_such_agents'" in door_problems(
        tiny_model_dir, "nodes.agent.params.agent=no_such_agents:solve")[params + ".agent"]
    assert "cannot be called as solve(client, sample): its arguments are (obj, *" in door_problems(
        tiny_model_dir, "nodes.agent.params.agent=json:dumps")[params + ".agent"]
    swapped = ["nodes.agent.params.agent=null"]  # swapping the agent for another kind by override
    assert "has no reset or step" in door_problems(tiny_model_dir, *swapped, "+nodes.agent.params.env=json:JSONDecoder")[
        params + ".env"]
    script = tmp_path / "agent.py"
    script.write_text("print(1)\n")
    assert "is a file but not executable; expected an executable program (chmod +x it, with a #! line naming its " \
        f"interpreter; or name the interpreter first, for a Python script the one whose packages it imports: [{sys.executable}, " \
        f"{script}])" in door_problems(tiny_model_dir, *swapped, f"+nodes.agent.params.agent_command=[{script}]")[
            params + ".agent_command[0]"]
    assert door_problems(tiny_model_dir, *swapped, f"+nodes.agent.params.agent_command=[python3, {tmp_path}/nope.py]")[
        params + ".agent_command[1]"].startswith(f"'{tmp_path}/nope.py' is not a file; expected the script python3 runs "
                                                 "(its path from the folder the run starts in)")
    assert "not a program found on PATH" in door_problems(
        tiny_model_dir, *swapped, "+nodes.agent.params.agent_command=[no-such-agent-program]")[params + ".agent_command[0]"]
    env = load_pipeline(OPENAI_GRAPH, [f"models.policy.path={tiny_model_dir}", *swapped,
                                       "+nodes.agent.params.env=agents_for_tests:CountingEnv"])
    assert env.nodes["agent"].params["env"] == "agents_for_tests:CountingEnv"
    assert {"agent_reward", "episode"} <= set(env.produces("agent")) and "agent_reward" in env.reads["reward"]
    assert "'many' is not allowed; expected one of: 'auto', or an integer >= 1" in door_problems(
        tiny_model_dir, "+nodes.agent.params.agent_processes=many")[params + ".agent_processes"]
    assert "expected a value >= 1" in door_problems(tiny_model_dir, "+nodes.agent.params.agent_processes=0")[
        params + ".agent_processes"]


def test_agent_processes_auto_is_one_beside_a_cpu_engine_and_four_beside_a_gpus(tiny_model_dir):
    from nodes.agents import agent_processes
    from nodes.agents.rollout import concurrency_shares, spread
    from siirl_dag.config import load_pipeline

    pipeline = load_pipeline(OPENAI_GRAPH, [f"models.policy.path={tiny_model_dir}"])
    asked = pipeline.nodes["agent"].params["agent_processes"]
    assert asked == "auto" and (agent_processes(asked, "cpu", 64), agent_processes(asked, "cuda", 64)) == (1, 4)
    assert agent_processes(asked, "cuda", 2) == 2  # no more processes than episodes in flight
    assert concurrency_shares(6, 4) == [2, 2, 1, 1] and concurrency_shares(64, 1) == [64]
    assert spread(12, [2, 2, 1, 1]) == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 10], [5, 11]]  # two rounds each
    assert spread(8, [4, 4]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert "128 episodes at once, up to 2 turns" in pipeline.does("agent")  # in one process (not said)
    gpu = load_pipeline(OPENAI_GRAPH, [f"models.policy.path={tiny_model_dir}", "cluster.device=cuda"])
    assert "128 episodes at once in 4 processes" in gpu.does("agent")
    two = load_pipeline(OPENAI_GRAPH, [f"models.policy.path={tiny_model_dir}", "+nodes.agent.params.agent_processes=2"])
    assert agent_processes(two.nodes["agent"].params["agent_processes"], "cuda", 64) == 2


@pytest.mark.engines  # a whole CLI run up to its data checks: too slow for `make test-fast`
def test_an_agent_needs_a_chat_template(tiny_model_dir, tmp_path, demo_data):
    """Refused before anything starts: exit 2, one message naming the model."""
    import json
    import shutil
    import subprocess
    import sys

    model = tmp_path / "no_template"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", str(OPENAI_GRAPH), f"models.policy.path={model}",
                          f"data.train_files={demo_data / 'train.parquet'}", f"data.val_files={demo_data / 'test.parquet'}",
                          "data.max_prompt_length=64", "nodes.reward.params.scorer=agent", f"trainer.default_local_dir={tmp_path}/c",
                          f"trainer.log_dir={tmp_path}/l", f"trainer.tensorboard_dir={tmp_path}/t"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "node 'agent': the chat template of model 'policy' cannot show the messages that follow a turn" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_rollout_that_lost_everything_says_how_and_what_was_refused():
    """Agents that caught their calls' errors and returned without a turn: the message says the calls were
    refused and why (a conversation too long, say), not only that no turn was taken."""
    from nodes.agents import rows
    from nodes.agents.rollout import Finished
    from nodes.agents.runners import Outcome

    episode = SimpleNamespace(refused=2, first_refusal="400 this conversation is 152 tokens, more than the 120")
    finished = Finished([episode, SimpleNamespace(refused=0, first_refusal="")],
                        [Outcome("ok", 0.0), Outcome("failed", error="ValueError: x")], 0)
    assert rows.lost_everything(finished) == (
        "every episode of this rollout was lost (1 failed, 0 timed out, 1 returned without a turn of the model's); the "
        "first: ValueError: x; 2 of their calls were refused, the first: 400 this conversation is 152 tokens, more than "
        "the 120")


def test_a_lost_episodes_error_names_the_agents_own_line_not_the_librarys():
    import json as json_module

    from nodes.agents.runners import _described

    def agent():
        return json_module.loads("{oops")  # raises inside the standard library

    with pytest.raises(ValueError) as info:
        agent()
    line = agent.__code__.co_firstlineno + 1
    assert _described(info.value).endswith(f"(at {__file__}:{line})")


def test_a_turn_the_engine_refuses_fails_that_call_not_the_rollout():
    """The rank's loop over a stand-in engine whose request checks refuse one turn: that turn is answered
    'refused' (its call gets a 400), the other is generated, and the rollout ends with the agents' results."""
    import socket
    import threading
    from multiprocessing.connection import Connection

    from vllm.exceptions import VLLMValidationError

    from nodes.agents import engine_link

    class Engine:  # each turn added finishes at the next step; a context of [999] is refused as vLLM does
        def __init__(self):
            self.pending = []

        @property
        def busy(self):
            return bool(self.pending)

        def add(self, key, context, *rest):
            if context == [999]:
                raise VLLMValidationError("Token id 999 is out of vocabulary")
            self.pending.append(key)

        def step(self):
            done, self.pending = self.pending, []
            return [(key, SimpleNamespace(token_ids=[7], logprobs=[-0.5], finish_reason="stop", text="x",
                                          top_logprobs=None)) for key in done]

        def abort(self, key):
            raise AssertionError("nothing is aborted")

    ours, theirs = socket.socketpair()
    agents, heard = Connection(theirs.detach()), []

    def agents_side():
        agents.send(("add", 0, [999], 4, None, [], 0))
        agents.send(("add", 1, [1, 2], 4, None, [], 0))
        heard.extend([agents.recv(), agents.recv()])
        agents.send(("finished", "their results"))

    thread = threading.Thread(target=agents_side)
    thread.start()
    link = engine_link.RankEnd(Connection(ours.detach()))
    found = engine_link.serve([link], Engine(), time.monotonic() + 30)
    thread.join()
    link.close()
    assert found == (["their results"], 1)
    refused, done = sorted(heard, key=lambda m: m[0], reverse=True)
    assert refused == ("refused", 0, "VLLMValidationError: Token id 999 is out of vocabulary")
    assert done[:2] == ("done", 1) and done[2].token_ids == [7]


def test_a_request_may_set_only_the_chat_templates_own_variables(tokenizer):
    """Qwen3's enable_thinking, not the template itself or the render's arguments: a request's
    chat_template_kwargs never hand Jinja a template of theirs."""
    import copy

    thinking = copy.copy(tokenizer)
    thinking.chat_template = ("{% for m in messages %}{% if m.role == 'assistant' %}{% set content = m['content'] %}"
                              "{% else %}{% set content = m['content'] | trim %}{% endif %}{{ content }}{% break %}{% endfor %}"
                              "{% if add_generation_prompt %}{% if enable_thinking is false %}<nothink>{% endif %}{% endif %}"
                              "{{ eos_token }}")
    assert ChatRender(thinking).template_variables == {"enable_thinking"}
    assert ChatRender(tokenizer).template_variables == frozenset()  # the tiny model's template reads none


def test_control_tokens_are_refused_where_the_template_writes_them_as_its_own(tokenizer):
    """A message's content may hold the model's control tokens (they are split into plain text); tools and
    tool calls, which the template writes as its own text, may not."""
    render, eos = ChatRender(tokenizer), tokenizer.eos_token
    tool = {"type": "function", "function": {"name": "f", "description": f"ends here{eos}", "parameters": {}}}
    assert tokenizer.eos_token_id not in render.prompt([{"role": "user", "content": f"a{eos}b"}])
    with pytest.raises(ValueError, match="control token"):
        render.prompt(USER, [tool])
    called = [*USER, {"role": "assistant", "content": None,
                      "tool_calls": [{"id": "c", "type": "function", "function": {"name": f"f{eos}", "arguments": "{}"}}]}]
    with pytest.raises(ValueError, match="control token"):
        render.prompt(called)


# a template as Qwen3's behaves where it matters here: tools and tool calls written with tojson (keys in
# their order), an empty think block on the last assistant turn after the last user message only
QWEN3_LIKE = (
    "{%- if tools %}{{ 'system: tools ' }}{% for t in tools %}{{ t | tojson }}{% endfor %}{{ eos_token + '\\n' }}{% endif %}"
    "{%- set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{%- for m in messages %}{% if m.role == 'assistant' %}{{ 'assistant: ' }}"
    "{% if loop.index0 > ns.last and loop.last %}{{ '<think></think>' }}{% endif %}{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{{ '<tool_call>' + (c.function | tojson) + '</tool_call>' }}{% endfor %}"
    "{{ eos_token + '\\n' }}{% else %}{{ m.role + ': ' + m.content + eos_token + '\\n' }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def test_a_turn_continues_as_a_qwen3_like_template_writes_it_with_tools(tokenizer):
    """After a turn the model ended with EOS, the tool's answer and the next prompt are what the template
    writes once more messages follow, though it writes the turn itself differently while it is the last
    (its think block); tools keep their keys' order. Control tokens are refused where the template writes
    them as its own text, an escaped one in a tool call's arguments too."""
    import copy

    qwen = copy.copy(tokenizer)
    qwen.chat_template = QWEN3_LIKE
    render, eos = ChatRender(qwen), qwen.eos_token
    tools = [{"type": "function", "function": {"name": "add", "description": "adds", "parameters": {"type": "object"}}}]
    asked = [{"role": "user", "content": "Q: 1+1=?"}]
    turn = qwen.encode("let me add", add_special_tokens=False) + [qwen.eos_token_id]
    answer = [{"role": "tool", "tool_call_id": "c", "content": "2"}]
    ids = render.prompt(asked, tools) + turn + render.after_turn(answer, True, tools)
    whole = qwen.apply_chat_template([*asked, {"role": "assistant", "content": "let me add"}, *answer], tools=tools,
                                     add_generation_prompt=True, tokenize=False)
    assert qwen.decode(ids) == whole and '{"type": "function", "function": {"name": "add"' in whole
    escaped = json.dumps({"x": eos}).replace("<", "\\u003c")
    called = [*asked, {"role": "assistant", "content": None,
                       "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": escaped}}]}]
    with pytest.raises(ValueError, match="control token"):
        render.prompt([*called, *answer], tools)


def test_templates_that_move_or_repeat_messages_are_refused_not_silently_changed(tokenizer):
    """A template that writes a new system message at the top (before the turn it follows) cannot go on from
    the model's tokens, and one that writes the turn's content again would show the model a stand-in: both
    refused; a first prompt whose template repeats a content is rendered whole instead."""
    import copy

    def render_with(template):
        changed = copy.copy(tokenizer)
        changed.chat_template = template
        return ChatRender(changed)

    turn = "{% for m in messages if m.role != 'system' %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
    hoisting = render_with("{% for m in messages if m.role == 'system' %}{{ 'system: ' + m.content + '\\n' }}{% endfor %}"
                           + turn + "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ValueError, match="before that turn"):
        hoisting.after_turn([{"role": "system", "content": "new rules"}, *USER], False)
    assert hoisting.text_after_turn(USER) == "\nuser: Q: 1+1=? A:\nassistant: "  # without a system message: fine
    echoing = render_with(turn + "{% if messages|length > 1 %}{{ 'again: ' + messages[-2].content + '\\n' }}{% endif %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ValueError, match="again after it"):
        echoing.after_turn([{"role": "tool", "content": "2"}], False)
    two = [*USER, {"role": "user", "content": "and?"}]
    assert tokenizer.decode(echoing.prompt(two)) == "user: Q: 1+1=? A:\nuser: and?\nagain: Q: 1+1=? A:\nassistant: "


def test_a_tool_call_with_nan_or_infinity_stays_text():
    from nodes.tool_calls import call_spans

    for arguments in ('{"a": NaN}', '{"a": 1e999}', '{"a": -Infinity}'):
        (_, _, call), = call_spans(f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>')
        assert call.error is not None and call.name is None
