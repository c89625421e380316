"""Shared session fixtures: a tiny offline model and ONE vLLM engine for the whole test session."""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import pytest  # noqa: E402

# The modules all of whose tests start a vLLM engine, Megatron ranks or Ray (marked `engines`); in other
# modules such a test carries @pytest.mark.engines itself. `make test-fast` runs the rest: config, graph,
# placement, algorithms, pictures, packaging.
ENGINE_MODULES = {"test_e2e", "test_e2e_ppo", "test_e2e_algorithms", "test_e2e_async", "test_lora_sync",
                  "test_megatron_lora", "test_cuda", "test_megatron_checkpoint", "test_megatron_cpu_compat",
                  "test_megatron_critic", "test_memory_measured", "test_e2e_agent", "test_kill_driver", "test_e2e_compose"}
# Tests that take seconds without an engine (a fresh interpreter per module, a real MLflow server, a
# browser, a pip install, a sandbox's limits, a checkpoint written by Megatron's format): marked `slow`;
# `make test-fast` leaves these out too, `make test` runs them.
SLOW_MODULES = {"test_trackers"}
SLOW_TESTS = {"test_every_module_imports_before_any_other_of_ours", "test_lean_layers_match_megatrons_and_are_what_the_local_spec_builds",
              "test_the_cli_refuses_with_exit_2_and_loses_nothing", "test_demo_task_data",
              "test_freed_activations_stay_with_the_heap", "test_a_plain_install_validates_a_pipeline_from_another_folder",
              "test_a_ray_that_never_starts_ends_the_process_with_a_message", "test_each_sandbox_has_its_own_process_budget",
              "test_timeline_page_renders_in_headless_chromium", "test_html_page_renders_in_headless_chromium",
              "test_options_are_checked_before_any_engine_starts", "test_validate_and_a_refused_run_do_not_load_torch",
              "test_output_into_a_pipe_whose_reader_left_ends_quietly", "test_readme_figure_script"}
# Options of the session engine; tests that compare against HF need fp32.
VLLM_TEST_OPTIONS = {"dtype": "float32", "kv_cache_gb": 0.25, "max_model_len": 256, "enforce_eager": True}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in ENGINE_MODULES:
            item.add_marker(pytest.mark.engines)
        if item.module.__name__ in SLOW_MODULES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def made_once(tmp_path_factory, request) -> Callable[[str, Callable[[Path], object]], Path]:
    """made_once(name, make): a folder made once for the whole run, under a lock in the folder
    pytest-xdist's workers share: the first worker that needs it pays for `make(folder)`, the others
    wait for it and read the files (a module's fixture would be made again on each worker its tests
    land on)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if hasattr(request.config, "workerinput") else base

    def made(name: str, make: Callable[[Path], object]) -> Path:
        out = shared / name
        with open(f"{out}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / ".made").is_file():
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                make(out)
                (out / ".made").touch()
        return out

    return made


@pytest.fixture(scope="session")
def demo_data(made_once):
    """The demo task's parquet files (make_demo_task.py), written once for the run."""
    from make_demo_task import write_task

    return made_once("demo", lambda out: write_task(out, seed=0))


@pytest.fixture
def sandboxes_alone():
    """Sandbox tests check that no sandbox process is left on the machine: one such test at a time over
    the xdist workers, so that none sees another's sandboxes as left behind."""
    import tempfile

    with open(Path(tempfile.gettempdir()) / "siirl-dag-sandbox-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session", autouse=True)
def row_cache_dir(tmp_path_factory):
    """Prompt token counts kept for the session (and the runs it starts), not in the user's cache."""
    os.environ["SIIRL_DAG_CACHE"] = str(tmp_path_factory.mktemp("row_cache"))


@pytest.fixture(scope="session")
def tiny_model_dir(made_once) -> str:
    """Made once for the run: the first worker pays for transformers' model classes, the others only
    read the files."""
    def make(out: Path) -> None:
        from make_tiny_model import make_tiny_model

        make_tiny_model(out)

    return str(made_once("tiny_model", make))


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.vllm.rollout import VllmRollout

    engine = VllmRollout(RankContext(rank=0), tiny_model_dir, dict(VLLM_TEST_OPTIONS))
    yield engine
    engine.close()
