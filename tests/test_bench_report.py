"""scripts/bench.py --all reads each benchmark's JSON report out of output that Ray's workers also write to."""

from __future__ import annotations

import json

from bench import _report


def test_the_report_is_found_between_worker_log_lines_that_hold_braces():
    report = {"results": [{"sync_s": 0.04, "stages_s": {"load": 0.02}}]}
    stdout = ("\x1b[36m(RankWorker pid=1)\x1b[0m INFO non-default args: {'dtype': 'float32'}\n"
              + json.dumps(report, indent=2) + "\n"
              + "\x1b[36m(RankWorker pid=1)\x1b[0m INFO shutting down {'x': 1}\n")
    assert _report(stdout) == report
    assert "error" in _report("(RankWorker pid=1) INFO {'no': 'report'}\n")
