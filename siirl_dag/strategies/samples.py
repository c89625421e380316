"""Prompts -> token ids, and generated samples -> the batch layout of docs/ARCHITECTURE.md (verl convention).

Prompts are left-padded to P and responses right-padded to R, so position P+j-1 is always the
logit that produced response token j, whatever the prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

PARTIAL = "partial"  # the finish_reason of a sample a segment of a partial rollout cut short


@dataclass
class Sample:
    """One generated response."""

    prompt_index: int  # which prompt of the call it answers
    token_ids: Sequence[int]
    logprobs: Sequence[float]  # log-prob of each token of token_ids under the sampler
    finish_reason: str  # "stop" (EOS, stop string or stop token), "length", or PARTIAL (to be resumed)
    mask: Sequence[int] | None = None  # 1 where the model generated the token, 0 a tool's (agent rollouts)
    # the experts each token was routed to, [prompt + token_ids - 1, layers, topk] (vLLM's record of the
    # tokens it ran through the model: all but the last), when the engine records them
    routed_experts: Any = None
    text: str | None = None  # the tokens as text, where the engine decoded them (single turns)
    # per token, the most likely tokens and their log-probs [(token id, log-prob), ...], when asked for
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None


def prompt_token_ids(tokenizer: Any, prompt: str | Sequence[int] | Sequence[dict], chat_template: bool,
                     tools: list[dict] | None = None) -> list[int]:
    """Token ids as given; a chat list (the prompt column of verl-style data) always through the chat
    template; a text through it as one user turn when `chat_template`, else raw. `tools` (OpenAI
    format) go to the template, which shows them to the model. The engine and the driver's check of
    prompt lengths before a run both tokenize here, so they agree."""
    if isinstance(prompt, str) and not chat_template:
        return tokenizer.encode(prompt)
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif not (prompt and isinstance(prompt[0], dict)):
        return list(prompt)
    text = tokenizer.apply_chat_template(list(prompt), tools=tools or None, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def pack_batch(prompt_ids: Sequence[Sequence[int]], samples: Sequence[Sample], max_prompt_length: int,
               max_response_length: int, pad_token_id: int) -> dict[str, Any]:
    """Pad and stack; one row per sample, in the order given. Every response token is attended to;
    `response_mask` marks those trained on (a sample's `mask`, else all)."""
    P, R, pad = max_prompt_length, max_response_length, pad_token_id
    prompt_rows = [prompt_ids[s.prompt_index] for s in samples]
    assert all(len(p) <= P for p in prompt_rows) and all(len(s.token_ids) <= R for s in samples), \
        "lengths are checked before generation"
    # rows built as lists, one tensor each: per-row tensor writes cost ~4 ms for 256 rows

    def right_padded(values, n: int, fill) -> list:
        return [*values, *[fill] * (n - len(values))]

    prompts = torch.tensor([[pad] * (P - len(p)) + list(p) for p in prompt_rows], dtype=torch.long).view(-1, P)
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompt_rows], dtype=torch.long).view(-1, P)
    responses = torch.tensor([right_padded(s.token_ids, R, pad) for s in samples], dtype=torch.long).view(-1, R)
    attended = torch.tensor([right_padded([1] * len(s.token_ids), R, 0) for s in samples], dtype=torch.long).view(-1, R)
    response_mask = torch.tensor([right_padded([1] * len(s.token_ids) if s.mask is None else s.mask, R, 0)
                                  for s in samples], dtype=torch.long).view(-1, R)
    logprobs = torch.tensor([right_padded(s.logprobs, R, 0.0) for s in samples], dtype=torch.float32).view(-1, R)
    attention_mask = torch.cat([prompt_mask, attended], dim=1)
    routes = _routes(prompt_ids, samples, P, R) if any(s.routed_experts is not None for s in samples) else {}
    return routes | {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "rollout_logprobs": logprobs,
        "response_length": attended.sum(dim=1),
        "finish_reason": [s.finish_reason for s in samples],
        "sample_index": [s.prompt_index for s in samples],
    }


def _routes(prompt_ids: Sequence[Sequence[int]], samples: Sequence[Sample], P: int, R: int) -> dict[str, torch.Tensor]:
    """`routed_experts` [rows, P+R, layers, topk], each token's experts where its id sits in input_ids
    (0 where the engine recorded none: padding, and the last token)."""
    first = next(s.routed_experts for s in samples if s.routed_experts is not None)
    dtype = torch.uint8 if first.dtype.itemsize == 1 else torch.int32  # vLLM's uint8, or uint16 past 256 experts
    out = torch.zeros((len(samples), P + R, *first.shape[1:]), dtype=dtype)
    for row, s in enumerate(samples):
        if s.routed_experts is None:
            raise ValueError(f"sample {row} came back without routed experts while others have them")
        start = P - len(prompt_ids[s.prompt_index])
        routes = torch.as_tensor(s.routed_experts[:P + R - start].astype(first.dtype)).to(dtype)
        out[row, start:start + len(routes)] = routes
    return {"routed_experts": out}


def unpack_batch(batch: Any) -> tuple[list[list[int]], list[Sample]]:
    """`pack_batch`'s rows back as (prompt ids, samples), one prompt per row: a partial rollout's next
    segment continues them."""
    lengths, prompt_mask = batch["response_length"].tolist(), batch["prompt_mask"].bool()
    prompt_ids = [row[mask].tolist() for row, mask in zip(batch["prompts"], prompt_mask)]
    P = prompt_mask.shape[1]
    routes = batch["routed_experts"] if "routed_experts" in batch else None
    samples = [Sample(i, batch["responses"][i, :n].tolist(), batch["rollout_logprobs"][i, :n].tolist(),
                      batch["finish_reason"][i],
                      routed_experts=None if routes is None else routes[i, P - len(prompt_ids[i]):P + n - 1].numpy())
               for i, n in enumerate(lengths)]
    return prompt_ids, samples
