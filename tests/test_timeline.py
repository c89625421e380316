"""`visualize RUN_DIR --view timeline`: a run's trace drawn as rows of spans, each step's critical path
marked, idle time counted; bad traces and folders are one clear error. (The trace of a real run is
drawn in test_e2e_async.)"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from siirl_dag.runtime.trace import Trace
from siirl_dag.visualize import timeline
from test_visualize import SVG, Page, needs_chromium, open_in_chromium, rgb, run_cli

T0 = 1_700_000_000.0  # wall clock of the run's first span


def two_steps() -> Trace:
    """Two synchronous steps: data, rollout, reward, old log-probs on two ranks (rank 1 slower), the
    update, the weight sync; validation and a checkpoint after step 1."""
    trace = Trace()
    for step, base in ((1, 0.0), (2, 2.0)):
        at = lambda a: T0 + base + a  # noqa: E731
        trace.span("driver", "driver", "load data", at(0.0), at(0.01), step=step)
        trace.span("gen", "rank 0", "rollout", at(0.01), at(0.30), step=step, validating=False)
        trace.span("__compute__", "rank 0", "reward", at(0.30), at(0.32), step=step, validating=False)
        trace.span("train", "rank 0", "old_logprob", at(0.32), at(0.50), step=step, validating=False)
        trace.span("train", "rank 1", "old_logprob", at(0.32), at(0.55), step=step, validating=False)
        trace.span("train", "rank 0", "actor_update", at(0.55), at(0.90), step=step, validating=False)
        trace.span("train", "rank 1", "actor_update", at(0.55), at(0.88), step=step, validating=False)
        trace.span("driver", "driver", "sync actor_update -> rollout", at(0.90), at(0.95), step=step, bytes=1000)
    trace.span("gen", "rank 0", "rollout", T0 + 1.0, T0 + 1.3, step=1, validating=True)
    trace.span("driver", "driver", "validation", T0 + 0.96, T0 + 1.35, step=1)
    trace.span("driver", "driver", "save checkpoint", T0 + 1.4, T0 + 1.9, step=1)
    return trace


@pytest.fixture
def run_dir(tmp_path):
    two_steps().write(tmp_path / "run" / "logs" / "20261124-000000-1" / "trace.json")
    return tmp_path / "run"


def test_rows_steps_and_critical_path(run_dir):
    tl = timeline.load(timeline.find_trace(run_dir))
    assert tl.rows == ["driver", "gen · rank 0", "cpu compute · rank 0", "train · rank 0", "train · rank 1"]
    assert set(tl.steps) == {1, 2}
    for step, info in tl.steps.items():
        chain = [(s.name, tl.rows[s.row]) for s in info.critical]
        # the slower rank's log-probs gate the update; the update that ends last gates the sync
        assert chain == [("load data", "driver"), ("rollout", "gen · rank 0"), ("reward", "cpu compute · rank 0"),
                         ("old_logprob", "train · rank 1"), ("actor_update", "train · rank 0"),
                         ("sync actor_update -> rollout", "driver")], step
        assert info.end - info.start == pytest.approx(0.95)  # validation and the checkpoint come after the step
    assert tl.length == pytest.approx(2.95)
    assert tl.busy(1) == pytest.approx(2 * 0.29 + 0.3)  # gen: two rollouts and a validation
    assert tl.busy(0) == pytest.approx(2 * 0.06 + 0.39 + 0.5)


def test_svg_has_a_span_per_event_and_the_critical_path_outlined(run_dir, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "visualize", str(run_dir), "--view", "timeline", "-o", str(tmp_path / "t.svg"))
    assert code == 0 and "2 step(s), 5 track(s)" in out
    root = ET.parse(tmp_path / "t.svg").getroot()
    spans = [g for g in root.iter(f"{SVG}g") if g.get("class") == "span"]
    assert len(spans) == 19
    outlined = [g.find(f"{SVG}title").text.split(",")[0] for g in spans
                if g.find(f"{SVG}rect").get("stroke") == timeline.CRITICAL]
    assert sorted(outlined) == sorted(2 * ["load data", "rollout", "reward", "old_logprob", "actor_update",
                                           "sync actor_update -> rollout"])
    labels = {t.text for t in root.iter(f"{SVG}text")}
    assert {"step 1", "step 2", "driver", "train · rank 1"} <= labels and "busy 30%" in labels  # gen: 0.88 of 2.95 s


def test_html_page_and_json(run_dir, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "visualize", str(run_dir), "--view", "timeline", "-o", str(tmp_path / "t.html"),
                           "--json")
    result = json.loads(out)
    assert code == 0 and result["steps"]["1"]["critical_path"][-1] == "sync actor_update -> rollout"
    page = Page((tmp_path / "t.html").read_text())
    assert "old_logprob 0.23 s" in " ".join(page.text)  # the steps table spells the chain with durations


@pytest.mark.parametrize("make, expected", [
    (lambda d: d.mkdir(), "has no trace.json under it"),
    (lambda d: d.with_suffix(".json").write_text("{not json"), "not a readable trace"),
    (lambda d: d.with_suffix(".json").write_text('{"traceEvents": [{"ph": "X", "name": "x"}]}'), "not a readable trace"),
])
def test_bad_run_folder_or_trace_is_one_clear_error(capsys, tmp_path, make, expected):
    target = tmp_path / "run"
    make(target)
    given = target if target.exists() else target.with_suffix(".json")
    code, _, err = run_cli(capsys, "visualize", str(given), "--view", "timeline", "-o", str(tmp_path / "t.svg"))
    assert code == 2 and expected in err and "Traceback" not in err and not (tmp_path / "t.svg").exists()


def test_timeline_refuses_overrides_and_other_formats(run_dir, capsys, tmp_path):
    code, _, err = run_cli(capsys, "visualize", str(run_dir), "--view", "timeline", "-o", str(tmp_path / "t.png"))
    assert code == 2 and "expected one of: .svg, .html" in err
    code, _, err = run_cli(capsys, "visualize", str(run_dir), "a.b=1", "--view", "timeline", "-o", str(tmp_path / "t.svg"))
    assert code == 2 and "overrides" in err


@needs_chromium
def test_timeline_page_renders_in_headless_chromium(run_dir, tmp_path, capsys):
    page = tmp_path / "t.html"
    assert run_cli(capsys, "visualize", str(run_dir), "--view", "timeline", "-o", str(page))[0] == 0
    colors, dom = open_in_chromium(page, tmp_path)
    assert rgb(timeline.CRITICAL) in colors and rgb(timeline._DRIVER_COLORS["sync"]) in colors
    assert all(name in dom for name in ("rollout", "actor_update", "train · rank 1", "critical path"))
