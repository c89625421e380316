"""The README's figure is the default pipeline as `visualize` draws it today, not a stale copy."""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURE = ROOT / "docs" / "tiny_grpo_cpu.svg"


def content(svg: Path) -> list[tuple]:
    """What the figure shows, in document order, without what Graphviz's version or fonts change
    (coordinates, sizes, the version comment): every element's tag, class, colours and text."""
    keep = ("class", "fill", "stroke", "stroke-dasharray", "font-weight")
    return [(el.tag.rpartition("}")[2], *(el.get(k) for k in keep), (el.text or "").strip())
            for el in ET.parse(svg).getroot().iter()]


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed: apt-get install graphviz")
def test_the_committed_figure_matches_a_fresh_one(tmp_path, monkeypatch):
    from make_readme_figure import main as make_figure

    monkeypatch.chdir(ROOT)  # the script moves there; the test's folder comes back after
    fresh = tmp_path / "fig.svg"
    assert make_figure(["-o", str(fresh)]) == 0
    assert content(fresh) == content(FIGURE), "docs/tiny_grpo_cpu.svg is stale: python scripts/make_readme_figure.py"
