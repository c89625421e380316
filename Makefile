# make demo: set up (if needed) and run the default pipeline.  make test: set up, then the whole suite.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp
DEMO   ?= graphs/tiny_grpo_cpu.yaml
# test processes: most real runs keep one core busy while they start libraries and wait on each other
TEST_WORKERS ?= 2

.PHONY: demo compose agents test test-fast setup validate bench clean

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml scripts/setup_env.sh
	VENV=$(VENV) bash scripts/setup_env.sh
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) scripts/make_demo_task.py data/demo
	OMP_NUM_THREADS=1 $(PY) -m siirl_dag.main $(DEMO)

# the models of the composed graphs (graphs/tiny_{judge,distill,two_agents}_cpu.yaml): a judge, a reviewer, a student
compose: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) scripts/make_demo_task.py data/demo
	OMP_NUM_THREADS=1 $(PY) scripts/make_compose_task.py data/compose

# the agent demos' task and warm start (graphs/tiny_agent_tools_cpu.yaml, graphs/tiny_agent_openai_cpu.yaml)
agents: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) scripts/make_agent_task.py data/agent

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=20 tests

# the tests that start no vLLM engine, Megatron rank or Ray and take no seconds each (tests/conftest.py:
# SLOW_*): config, graph, placement, algorithms, pictures
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not engines and not slow" tests

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) scripts/bench.py

clean:
	rm -rf outputs .pytest_cache
