"""Single turns added and finished one at a time on a rank's vLLM engine: an agent's trajectories in
flight (nodes/agent_loop.py), each turn a request of its own on the engine's step loop, so a turn can
start while others are half-way and while tools run."""

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
        self._ids, self._live = itertools.count(), {}

    def add(self, key: int, token_ids: list[int], max_tokens: int, seed: int | None) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        request = f"turn-{next(self._ids)}"
        params = SamplingParams(**{**self._kw, "max_tokens": max_tokens}, seed=seed)
        self._engine.add_request(request, TokensPrompt(prompt_token_ids=list(token_ids)), params, lora_request=self._lora)
        self._live[request] = key

    def step(self) -> list[tuple[int, Sample]]:
        """One engine step; the turns it finished, as (key, Sample)."""
        done = []
        for out in self._engine.step():
            if out.finished and out.request_id in self._live:
                c = out.outputs[0]
                done.append((self._live.pop(out.request_id), Sample(0, list(c.token_ids), sampled_logprobs(c),
                                                                    c.finish_reason)))
        return done

    @property
    def busy(self) -> bool:
        return bool(self._live)
