"""Regenerate the README's figure, docs/tiny_grpo_cpu.svg, from graphs/tiny_grpo_cpu.yaml.

    python scripts/make_readme_figure.py            # needs Graphviz's `dot`
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from siirl_dag.main import main as siirl_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", default=str(ROOT / "docs" / "tiny_grpo_cpu.svg"), help="where to write it")
    output = Path(parser.parse_args(argv).output).resolve()
    os.chdir(ROOT)  # the pipeline's relative paths (models, data) resolve as they do for `make demo`
    return siirl_main(["visualize", "graphs/tiny_grpo_cpu.yaml", "-o", str(output)])


if __name__ == "__main__":
    sys.exit(main())
