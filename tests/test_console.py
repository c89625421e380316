"""The run's closing line: the warnings in its log folder counted, and the engine's earliest shown."""

from __future__ import annotations

from siirl_dag import console


def test_the_engines_earliest_warning_is_shown_among_the_libraries_many(tmp_path):
    (tmp_path / "driver.log").write_text("12:00:09 WARNING siirl_dag.runtime.ray_backend: a later one\n")
    (tmp_path / "gen-rank0-7.log").write_text(
        "12:00:01 WARNING vllm.engine: libtcmalloc is not found\n"
        "[W1201 12:00:02.45 utils.cpp:68] Warning: NUMA binding\n"
        "12:00:05 WARNING nodes.agents.rollout: agent episode 3 (prompt 1) lost, failed: " + "x" * 500 + "\n"
        "12:00:05 WARNING nodes.agents.rollout: ... and 37 more episodes lost\n"
        "12:00:06 INFO nodes.agents.rollout: not a warning\n")
    (tmp_path / "notes.txt").write_text("12:00:00 WARNING nodes.x: not a log file\n")
    count, first = console.warnings_in(tmp_path)
    assert count == 5
    assert first.startswith("gen-rank0-7.log: agent episode 3 (prompt 1) lost, failed: xxx") and first.endswith("x ...")
    assert len(first) == len("gen-rank0-7.log: ") + console.SHOWN_CHARS + len(" ...")  # the message cut
    (tmp_path / "gen-rank0-7.log").write_text("12:00:01 WARNING vllm.engine: a library's\n")
    assert console.warnings_in(tmp_path) == (2, "driver.log: a later one")
    (tmp_path / "driver.log").unlink()
    assert console.warnings_in(tmp_path) == (1, None)
