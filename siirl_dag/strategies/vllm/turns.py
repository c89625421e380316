"""Single turns added and finished one at a time on a rank's vLLM engine: an agent's trajectories in
flight (nodes/agent_loop.py, nodes/agents), each turn a request of its own on the engine's step loop,
so a turn can start while others are half-way and while tools or agents run."""

from __future__ import annotations

import itertools
from typing import Any

from siirl_dag.strategies.samples import Sample
from siirl_dag.strategies.vllm.options import sampled_logprobs, sampling_kwargs


class Turns:
    def __init__(self, engine: Any, options: dict, lora_request: Any, sampling: dict, max_response_length: int,
                 stop: list[str]):
        from vllm.sampling_params import RequestOutputKind

        kw = sampling_kwargs(options, sampling, max_response_length)
        kw.pop("seed")
        kw.update(n=1, stop=kw["stop"] + stop, include_stop_str_in_output=True,
                  output_kind=RequestOutputKind.FINAL_ONLY)
        self._kw, self._engine, self._lora = kw, engine, lora_request
        self._ids, self._live, self._requests = itertools.count(), {}, {}

    def add(self, key: int, token_ids: list[int], max_tokens: int, seed: int | None, stop: list[str] = (),
            top_logprobs: int = 0) -> None:
        """Start a turn after `token_ids`; `stop`: strings that end it besides the options' (kept in its
        output); `top_logprobs`: also the most likely tokens at each position, with their log-probs."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        request = f"turn-{next(self._ids)}"
        kw = {**self._kw, "max_tokens": max_tokens, "stop": self._kw["stop"] + list(stop)}
        if top_logprobs:
            kw.update(logprobs=top_logprobs)
        self._engine.add_request(request, TokensPrompt(prompt_token_ids=list(token_ids)), SamplingParams(**kw, seed=seed),
                                 lora_request=self._lora)
        self._live[request], self._requests[key] = (key, top_logprobs), request

    def abort(self, key: int) -> None:
        """Stop a turn in flight (its agent gave up on it); it never finishes."""
        request = self._requests.pop(key, None)
        if request in self._live:
            del self._live[request]
            self._engine.abort_request([request])

    def step(self) -> list[tuple[int, Sample]]:
        """One engine step; the turns it finished, as (key, Sample)."""
        done = []
        for out in self._engine.step():
            if out.finished and out.request_id in self._live:
                key, top = self._live.pop(out.request_id)
                del self._requests[key]
                c = out.outputs[0]
                done.append((key, Sample(0, list(c.token_ids), sampled_logprobs(c), c.finish_reason, text=c.text,
                                         top_logprobs=_top(c.logprobs, top) if top else None)))
        return done

    @property
    def busy(self) -> bool:
        return bool(self._live)


def _top(flat: Any, k: int) -> list[list[tuple[int, float]]]:
    """The `k` most likely tokens at each position of vLLM's flat log-probs (the sampled one comes
    first there, then the top ones, which may hold it again)."""
    out = []
    for start, end in zip(flat.start_indices, flat.end_indices):
        found = dict(zip(flat.token_ids[start:end], flat.logprobs[start:end]))
        out.append(sorted(found.items(), key=lambda item: -item[1])[:k])
    return out
