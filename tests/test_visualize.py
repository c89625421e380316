"""`visualize`: every format for every pipeline in graphs/, parsed back and checked for what it must show."""

from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from siirl_dag.config import load_pipeline, schedule
from siirl_dag.main import main
from siirl_dag.visualize import render
from siirl_dag.visualize.diagram import DATA_NODE, STRATEGY_STYLES, dynamic_sampling_edge, edge_keys, weight_syncs

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = sorted(glob.glob(str(ROOT / "graphs" / "*.yaml")))
NAMES = [Path(g).stem for g in GRAPHS]
SVG = "{http://www.w3.org/2000/svg}"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")


@functools.lru_cache(maxsize=None)
def pipeline(name: str):
    return load_pipeline(ROOT / "graphs" / f"{name}.yaml")


def edges(pipe) -> set[tuple[str, str]]:
    return set(pipe.graph.edges) | set(weight_syncs(pipe))


def svg_groups(root: ET.Element, cls: str) -> dict[str, ET.Element]:
    """Graphviz SVG groups of one class (node, edge, cluster) by their <title>."""
    return {g.find(f"{SVG}title").text: g for g in root.iter(f"{SVG}g") if g.get("class") == cls}


def bbox(group: ET.Element) -> tuple[float, float, float, float]:
    shape = next(e for e in group.iter() if e.tag in (f"{SVG}path", f"{SVG}polygon"))
    nums = [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", shape.get("d") or shape.get("points"))]
    xs, ys = nums[0::2], nums[1::2]
    return min(xs), min(ys), max(xs), max(ys)


class Page(HTMLParser):
    """Collects tags, attributes and text of an HTML page; fails on unbalanced markup."""

    VOID = {"meta", "br", "hr", "img", "link", "input"}

    def __init__(self, text: str):
        super().__init__()
        self.tags, self.attrs, self.text, self.stack = [], [], [], []
        self.feed(text)
        self.close()
        assert not self.stack, f"unclosed tags: {self.stack}"

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


# ---- graph view -------------------------------------------------------------------------------------------

@needs_dot
@pytest.mark.parametrize("name", NAMES)
def test_svg_graph_has_every_node_edge_and_mesh(name):
    pipe = pipeline(name)
    root = ET.fromstring(render(pipe, "svg"))
    nodes, edge_groups, clusters = (svg_groups(root, c) for c in ("node", "edge", "cluster"))
    assert set(nodes) == set(pipe.nodes) | {DATA_NODE}
    assert {tuple(t.split("->")) for t in edge_groups} >= edges(pipe)
    for src, dst in pipe.graph.edges:  # labelled with the keys that flow
        text = " ".join(t.text for t in edge_groups[f"{src}->{dst}"].iter(f"{SVG}text"))
        assert all(k in text for k in edge_keys(pipe, src, dst)), (src, dst, text)
    for src, dst in weight_syncs(pipe):  # dashed, labelled, and the only dashed edge
        group = edge_groups[f"{src}->{dst}"]
        assert next(group.iter(f"{SVG}path")).get("stroke-dasharray")
        assert schedule.edge_label(pipe.runtime) in " ".join(t.text for t in group.iter(f"{SVG}text"))
    dashed = {t for t, g in edge_groups.items() if next(g.iter(f"{SVG}path")).get("stroke-dasharray")}
    resampled = dynamic_sampling_edge(pipe)  # dynamic sampling: dashed from the filter back to the data
    assert dashed == {f"{s}->{d}" for s, d in weight_syncs(pipe)} | ({f"{resampled[0]}->{DATA_NODE}"} if resampled else set())
    if resampled:
        assert "more prompts until" in " ".join(t.text for t in edge_groups[f"{resampled[0]}->{DATA_NODE}"].iter(f"{SVG}text"))
    assert set(clusters) == {f"cluster_{m}" for m in pipe.meshes}
    for m in pipe.meshes.values():  # a colocated mesh is drawn inside the mesh it shares devices with
        if m.colocate_with:
            x0, y0, x1, y1 = bbox(clusters[f"cluster_{m.name}"])
            a0, b0, a1, b1 = bbox(clusters[f"cluster_{m.colocate_with}"])
            assert a0 <= x0 and b0 <= y0 and x1 <= a1 and y1 <= b1, m.name
    fills = {p.get("fill") for g in nodes.values() for p in g.iter() if p.get("fill")}
    assert {STRATEGY_STYLES[n.strategy].fill.lower() for n in pipe.nodes.values()} <= {f.lower() for f in fills}


@needs_dot
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("view", ["graph", "placement"])
def test_dot_source_is_accepted_by_graphviz(name, view):
    pipe = pipeline(name)
    text = render(pipe, "dot", view).decode()
    canon = subprocess.run(["dot", "-Tcanon"], input=text, capture_output=True, text=True)
    assert canon.returncode == 0, canon.stderr
    if view == "graph":
        found = set(re.findall(r'^\s*"?([^\s"]+)"?\s*->\s*"?([^\s"]+)"?\s*\[', canon.stdout, re.M))
        assert found >= edges(pipe)
        for src, dst in weight_syncs(pipe):
            line = next(l for l in text.splitlines() if f'"{src}" -> "{dst}"' in l and "weights" in l)
            assert "style=dashed" in line and "constraint=false" in line


@needs_dot
@pytest.mark.parametrize("fmt, magic", [("png", b"\x89PNG\r\n\x1a\n"), ("pdf", b"%PDF")])
def test_raster_and_pdf(fmt, magic):
    data = render(pipeline("tiny_grpo_cpu"), fmt)
    assert data.startswith(magic) and len(data) > 10_000


@pytest.mark.parametrize("name", NAMES)
def test_mermaid_graph(name):
    pipe = pipeline(name)
    text = render(pipe, "mmd").decode()
    assert text.splitlines()[1] == "flowchart LR"
    ids = dict(re.findall(r'^\s*(n\d+)\("<b>([^<]+)</b>', text, re.M))
    assert sorted(ids.values()) == sorted(pipe.nodes)
    by_name = {v: k for k, v in ids.items()}
    solid = set(re.findall(r"^\s*(n\d+) -->(?:\|[^|]*\|)? (n\d+)$", text, re.M))
    assert solid == {(by_name[s], by_name[d]) for s, d in pipe.graph.edges}
    dotted = set(re.findall(r'^\s*(n\d+) -\.->\|"' + re.escape(schedule.edge_label(pipe.runtime)) + r'"\| (n\d+)$', text, re.M))
    assert dotted == {(by_name[s], by_name[d]) for s, d in weight_syncs(pipe)}
    for m in pipe.meshes:
        assert f"<b>mesh {m}</b>" in text


@needs_dot
@pytest.mark.parametrize("name", NAMES)
def test_html_page_is_self_contained(name):
    pipe = pipeline(name)
    text = render(pipe, "html").decode()
    page = Page(text)
    assert page.tags.count("svg") == 1
    assert not {"script", "link", "img", "iframe", "object", "embed"} & set(page.tags)
    assert not [v for k, v in page.attrs if k == "src"]
    assert all(v.startswith("#") for k, v in page.attrs if k in ("href", "xlink:href"))
    assert "url(" not in text and "@import" not in text
    svg = ET.fromstring(text[text.index("<svg"):text.index("</svg>") + 6])
    assert set(svg_groups(svg, "node")) == set(pipe.nodes) | {DATA_NODE}
    body = " ".join(page.text)
    assert all(n in body for n in pipe.nodes)


# ---- placement view ---------------------------------------------------------------------------------------

def ranks(pipe) -> list[tuple[str, int, int]]:
    return [(m.name, r.rank, r.device) for m in pipe.plan.meshes.values() for r in m.ranks]


@needs_dot
@pytest.mark.parametrize("name", NAMES)
def test_placement_svg_labels_every_rank(name):
    pipe = pipeline(name)
    root = ET.fromstring(render(pipe, "svg", "placement"))
    texts = [t.text for t in root.iter(f"{SVG}text")]
    for mesh, rank, _ in ranks(pipe):
        assert texts.count(f"{mesh}:{rank}") == 1, (mesh, rank)
    for m in pipe.plan.meshes.values():  # coordinates of every dimension larger than 1
        big = [k for k in ("dp", "pp", "tp", "cp", "ep") if getattr(m.dims, k) > 1]
        for r in m.ranks:
            label = " ".join(f"{k}{r.coords[k]}" for k in big)
            assert not big or any(label in (t or "") for t in texts), (m.name, r.rank, label)
    devices = pipe.cluster.total
    assert sum(1 for t in texts if t and re.fullmatch(r"device \d+", t)) == devices


@needs_dot
@pytest.mark.parametrize("name", NAMES)
def test_placement_html_cells_show_colocated_ranks_with_hover(name):
    pipe = pipeline(name)
    text = render(pipe, "html", "placement").decode()
    Page(text)
    assert text.index('id="placement"') < text.index('id="graph"')
    cells = dict(re.findall(r'<td><div class="dev">device (\d+)</div>(.*?)</td>', text))
    assert len(cells) == pipe.cluster.total
    for mesh, rank, device in ranks(pipe):
        title = f'title="{mesh} rank {rank} on device {device} '
        assert title in cells[str(device)], (mesh, rank, device)


@pytest.mark.parametrize("name", NAMES)
def test_placement_mermaid(name):
    pipe = pipeline(name)
    text = render(pipe, "mmd", "placement").decode()
    for mesh, rank, device in ranks(pipe):
        line = next(l for l in text.splitlines() if l.strip().startswith(f'd{device}["device {device}<br/>'))
        assert f"<b>{mesh}:{rank}</b>" in line


# ---- the command ------------------------------------------------------------------------------------------

def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


TINY = str(ROOT / "graphs" / "tiny_grpo_cpu.yaml")


@needs_dot
def test_cli_writes_every_format(capsys, tmp_path):
    for ext in ("svg", "png", "pdf", "dot", "mmd", "html"):
        target = tmp_path / "out" / f"tiny.{ext}"
        rc, out, _ = run_cli(capsys, "visualize", TINY, "-o", str(target))
        assert rc == 0 and target.stat().st_size > 0 and f"wrote {target}" in out
    rc, out, _ = run_cli(capsys, "visualize", TINY, "data.train_batch_size=64", "nodes.actor_update.params.mini_batch_size=64",
                         "-o", str(tmp_path / "p.svg"),
                         "--view", "placement", "--json")
    assert rc == 0 and '"placed": true' in out and "train:0" in (tmp_path / "p.svg").read_text()


def test_unknown_extension_lists_supported(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "visualize", TINY, "-o", str(tmp_path / "dag.jpg"))
    assert rc == 2
    assert "'.jpg'" in err and all(e in err for e in (".svg", ".png", ".dot", ".mmd", ".html"))
    assert not (tmp_path / "dag.jpg").exists()


@pytest.mark.parametrize("target, why", [("isdir.mmd", "Is a directory"), ("afile/x.mmd", "afile"),
                                         ("n" * 300 + ".mmd", "File name too long")])
def test_an_unwritable_output_is_one_clear_error(capsys, tmp_path, target, why):
    (tmp_path / "isdir.mmd").mkdir()
    (tmp_path / "afile").write_text("")
    rc, _, err = run_cli(capsys, "visualize", TINY, "-o", str(tmp_path / target))
    assert rc == 2 and "Traceback" not in err
    assert err.startswith(f"--output: cannot write '{tmp_path / target}' (") and why in err
    assert "expected a file path in a writable folder" in err


@pytest.mark.parametrize("bad", [["nodes.reward.deps=[rollot]"], ["meshes.gen=vllm:d0"]])
def test_invalid_pipeline_fails_like_validate(capsys, tmp_path, bad):
    rc_validate, _, err_validate = run_cli(capsys, "validate", TINY, *bad)
    rc, _, err = run_cli(capsys, "visualize", TINY, *bad, "-o", str(tmp_path / "x.mmd"))
    assert rc == rc_validate == 2
    assert err == err_validate and "error(s)" in err
    assert not (tmp_path / "x.mmd").exists()


def test_placement_view_of_unplaceable_pipeline_fails_like_validate(capsys, tmp_path):
    too_small = "cluster.devices_per_node=1"
    _, _, err_validate = run_cli(capsys, "validate", TINY, too_small)
    rc, _, err = run_cli(capsys, "visualize", TINY, too_small, "-o", str(tmp_path / "p.mmd"), "--view", "placement")
    assert rc == 2 and err == err_validate and "needs 2 devices" in err


def test_graph_of_unplaceable_pipeline_is_drawn_with_a_warning(capsys, tmp_path):
    target = tmp_path / "g.mmd"
    rc, _, err = run_cli(capsys, "visualize", TINY, "cluster.devices_per_node=1", "-o", str(target))
    assert rc == 0 and "warning:" in err and "needs 2 devices" in err and "drawn without placement" in err
    text = target.read_text()
    assert all(f"<b>{n}</b>" in text for n in pipeline("tiny_grpo_cpu").nodes)
    assert "1 device" in text and "device 0" not in text  # meshes keep their size but name no device


def test_missing_dot_is_a_clear_config_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` here
    rc, _, err = run_cli(capsys, "visualize", TINY, "-o", str(tmp_path / "g.svg"))
    assert rc == 2 and "apt-get install graphviz" in err and "brew install graphviz" in err
    rc, _, _ = run_cli(capsys, "visualize", TINY, "-o", str(tmp_path / "g.mmd"))  # Mermaid needs no Graphviz
    assert rc == 0


@needs_dot
def test_readme_figure_script(tmp_path):
    target = tmp_path / "fig.svg"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_readme_figure.py"), "-o", str(target)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    titles = set(svg_groups(ET.parse(target).getroot(), "node"))
    assert titles == set(pipeline("tiny_grpo_cpu").nodes) | {DATA_NODE}


# ---- the page in a real browser ---------------------------------------------------------------------------

CHROMIUM = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here, and the set-up could not install it: "
                                    "apt-get install chromium")


def open_in_chromium(page: Path, tmp_path: Path) -> tuple[set, str]:
    """Open a page headless: the colours of its screenshot and the text of its rendered DOM."""
    image = pytest.importorskip("PIL.Image")
    shot = tmp_path / "shot.png"
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1000"]
    proc = subprocess.run([*flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.is_file(), proc.stderr[-2000:]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    return {c for _, c in image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20)}, dom


def rgb(color: str) -> tuple[int, int, int]:
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


@needs_dot
@needs_chromium
def test_html_page_renders_in_headless_chromium(tmp_path):
    page = tmp_path / "page.html"
    page.write_bytes(render(pipeline("tiny_grpo_cpu"), "html"))
    colors, dom = open_in_chromium(page, tmp_path)
    for strategy in ("vllm", "megatron", None):  # the inline SVG's boxes were painted
        assert rgb(STRATEGY_STYLES[strategy].fill) in colors, strategy
    assert all(node in dom for node in pipeline("tiny_grpo_cpu").nodes)
