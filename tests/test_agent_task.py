"""scripts/make_agent_task.py: a trajectory, calling or answering at once, trains on the model's tokens only,
and the warm start's steps are the same for the same seed (one thread, deterministic algorithms)."""

import numpy as np
import pytest
import torch

from make_agent_task import optimizer, seeded, train_step, trajectory
from nodes.tool_calls import Observations


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from make_tiny_model import make_tiny_model
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_model(path, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return path, AutoTokenizer.from_pretrained(path)


@pytest.fixture
def torch_settings():
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def test_a_trajectory_labels_the_call_and_the_answer_not_the_prompt_or_the_tool(tiny):
    _, tokenizer = tiny
    ids, labels = trajectory(tokenizer, Observations(tokenizer), [123, 456, 789])
    trained = tokenizer.decode([t for t, lab in zip(ids, labels) if lab != -100])
    assert trained == ('<tool_call>{"name":"calculator","arguments":{"expression":"123+456+789"}}</tool_call>'
                       " #### 1368<eos>")
    masked = tokenizer.decode([t for t, lab in zip(ids, labels) if lab == -100])
    assert masked == "user: Q: 123+456+789=? A:\nassistant:\ntool: 1368\nassistant:"  # the prompt, the tool's answer
    direct, direct_labels = trajectory(tokenizer, Observations(tokenizer), [123, 456, 789], call=False)
    assert tokenizer.decode([t for t, lab in zip(direct, direct_labels) if lab != -100]) == " #### 1368<eos>"
    assert tokenizer.decode(direct) == "user: Q: 123+456+789=? A:\nassistant: #### 1368<eos>"


def test_warm_start_steps_are_deterministic_for_a_seed(tiny, torch_settings):
    from transformers import AutoModelForCausalLM

    path, tokenizer = tiny
    observe, numbers = Observations(tokenizer), np.random.default_rng(0).integers(100, 1000, (64, 3)).tolist()

    def weights(seed: int) -> dict:
        seeded(seed)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        optim, sched = optimizer(model)
        rng = np.random.default_rng(seed)
        for _ in range(3):
            train_step(model, optim, sched, tokenizer, observe, [numbers[i] for i in rng.integers(0, len(numbers), 8)])
        return model.state_dict()

    first, again, other = weights(1), weights(1), weights(2)
    assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)
