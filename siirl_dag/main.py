"""The one entry point: `python -m siirl_dag.main [run|validate|plan|visualize|import] PIPELINE.yaml [key=value ...]`.

Bad input of any kind prints every problem as FILE:LINE:COL: key: what; expected, and exits 2
without a traceback; nothing has been started by then.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from siirl_dag.errors import ConfigError

COMMANDS = ("run", "validate", "plan", "visualize", "import")
MODULES = {"import": "import_config"}  # `import` is a Python keyword
PEERS = ("siirl", "verl", "roll", "areal", "slime", "nemo-rl", "openrlhf")  # importers.PEERS (not imported: slow)

EPILOG = """examples:
  python -m siirl_dag.main graphs/tiny_grpo_cpu.yaml trainer.total_steps=5      run a pipeline
  python -m siirl_dag.main validate graphs/qwen3_30b_a3b_moe.yaml --json        check it, machine-readable
  python -m siirl_dag.main plan graphs/qwen3_8b_grpo_megatron.yaml              where every rank sits
  python -m siirl_dag.main plan --alloc 'vllm:d4t2+megatron:d2p2t2' --json     parse an allocation string
  python -m siirl_dag.main visualize graphs/tiny_grpo_cpu.yaml -o dag.svg       draw it (.svg .png .pdf .dot .mmd .html)
  python -m siirl_dag.main visualize RUN_DIR --view timeline -o timeline.html   a run traced with --trace
  python -m siirl_dag.main import --from verl run_qwen3-8b-megatron.sh -o p.yaml  a peer's configuration

overrides: key.path=value (value typed as YAML), applied before validation; nodes by id:
  nodes.actor_update.params.mini_batch_size=16   data.train_batch_size=64   runtime.backend=local
  a plain key must exist; +key=value adds one (+models.critic.path=models/c), ++key=value adds or sets
exit status: 0 ok, 1 a run failed, 2 bad input (nothing started)."""


def _add_pipeline_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("pipeline", nargs=None if required else "?", help="pipeline YAML file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides applied before validation")
    p.add_argument("--json", action="store_true", help="print a machine-readable result")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m siirl_dag.main", description=__doc__.split("\n\n")[0],
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{run,validate,plan,visualize,import}")
    run = sub.add_parser("run", help="run the pipeline (the default command)")
    _add_pipeline_args(run)
    run.add_argument("--address", help="attach to a running Ray cluster instead of starting one")
    run.add_argument("--verbose", action="store_true",
                     help="stream the logs of vLLM, Ray, Megatron and transformers here (else: the run's log folder)")
    run.add_argument("--trace", action="store_true", help="write the run's timeline (trainer.trace=true)")
    validate = sub.add_parser("validate", help="check a pipeline and print its summary or every problem")
    _add_pipeline_args(validate)
    plan = sub.add_parser("plan", help="show where every rank of every mesh runs")
    _add_pipeline_args(plan, required=False)
    plan.add_argument("--alloc", help="parse an allocation string instead of a pipeline")
    vis = sub.add_parser("visualize", help="draw the pipeline (.svg .png .pdf .dot .mmd .html), or a traced run's timeline")
    _add_pipeline_args(vis)
    vis.add_argument("-o", "--output", required=True, help="output file; the format follows the extension")
    vis.add_argument("--view", choices=("graph", "placement", "timeline"), default="graph",
                     help="timeline: give the run's folder (or its trace.json) instead of a pipeline")
    imp = sub.add_parser("import", help="write a pipeline from a peer's run script or YAML (siiRL, verl, ROLL, AReaL, slime, "
                         "NeMo-RL, OpenRLHF)")
    imp.add_argument("--from", dest="peer", required=True, choices=PEERS,
                     help="the framework SOURCE is written for")
    imp.add_argument("source", help="siirl/verl: the run script (or a YAML of its keys); slime, openrlhf: the run "
                     "script; roll, areal, nemo-rl: the YAML")
    imp.add_argument("-o", "--output", required=True, help="the pipeline YAML to write")
    imp.add_argument("--json", action="store_true", help="print a machine-readable result")
    return parser


def _report(exc: ConfigError, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"valid": False, "errors": [p.to_json() for p in exc.problems]}, indent=2))
    else:
        errors = [p for p in exc.problems if p.severity == "error"]
        for p in exc.problems:
            print(str(p), file=sys.stderr)
        print(f"{len(errors)} error(s); nothing was started.", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):
        argv.insert(0, "run")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # overrides may also follow options (`--json a.b=1`)
    unknown = [e for e in extra if e.startswith("-") or "=" not in e or args.command == "import"]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = list(getattr(args, "overrides", []) or []) + extra
    if args.command is None:
        parser.print_help()
        return 2
    from importlib import import_module

    command = import_module(f"siirl_dag.cli.{MODULES.get(args.command, args.command)}")
    try:
        code = command.main(args)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at exit
        return code
    except ConfigError as exc:
        return _report(exc, getattr(args, "json", False))
    except KeyboardInterrupt:
        print("interrupted; stopped cleanly.", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader has what it wanted: end quietly, as other tools do on SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the rest of stdout goes nowhere
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
