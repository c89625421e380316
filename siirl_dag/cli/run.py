"""`run` (the default command): validate, start the workers, train, report before/after validation."""

from __future__ import annotations

import os
import sys
import time

from siirl_dag import console
from siirl_dag.cli.json_stdout import json_stdout
from siirl_dag.config import load_pipeline
from siirl_dag.errors import OVERRIDE_FILE, ConfigError, PipelineError, Problem

EXPECTED_ADDRESS = "expected the address of a running Ray cluster (host:port, ray://host:port or auto), or none"


def _check_address(pipe, address: str | None) -> None:
    """An unreachable cluster is bad input, refused before Ray spends minutes retrying it."""
    written = address or pipe.runtime.address
    if not written or pipe.runtime.backend != "ray":
        return
    from siirl_dag.runtime.backends import unreachable

    why = unreachable(written)
    if why and address:
        raise ConfigError(Problem(("--address",), f"{why}; {EXPECTED_ADDRESS}", file=OVERRIDE_FILE))
    if why:
        raise pipe.error(("runtime", "address"), f"{why}; {EXPECTED_ADDRESS}")


def _finished(args, pipe, trainer) -> str:
    """What to do when the checkpoint a run would resume from is already at its last step."""
    t = pipe.trainer
    again = " ".join(["python -m siirl_dag.main", args.pipeline, *[o for o in args.overrides
                                                                  if not o.startswith("trainer.experiment_name=")]])
    name = f"{t.experiment_name or 'default'}-2"
    return (f"[run] {trainer.resume.path} is the end of a finished run (step {trainer.step} of {trainer.total_steps}, "
            f"resumed by trainer.resume_mode={t.resume_mode}): nothing to train.\n"
            f"      to start a new run beside it:  {again} trainer.experiment_name={name}\n"
            f"      to train this one further:     {again} trainer.total_steps={trainer.total_steps * 2}")


def main(args) -> int:
    pipe = load_pipeline(args.pipeline, [*args.overrides, *(["trainer.trace=true"] if args.trace else [])], for_run=True,
                         address=args.address)
    _check_address(pipe, args.address)
    # the data and checkpoint checks (the Trainer's) load neither torch nor Ray: bad input is refused in about a second
    from siirl_dag.trainer.loop import Trainer

    for w in pipe.warnings:
        print(str(w), file=sys.stderr)
    with json_stdout(args.json) as emit:  # --json: stdout holds only the JSON

        def say(*parts) -> None:
            from tqdm import tqdm  # (a tenth of a second to import: not for a run refused at its checks)

            tqdm.write(" ".join(map(str, parts)), file=console.terminal())  # above the training bar, not appended to it

        console.log_format()
        trainer = Trainer(pipe, address=args.address, progress=say)
        if trainer.finished:
            say(_finished(args, pipe, trainer))
            return 0
        log_dir = None if args.verbose else trainer.log_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        weights = f"the weights of {trainer.resume.path}" if trainer.resume.path else "the models as given"
        what = (f"validation only ({len(trainer.val_data)} prompts, {weights})" if pipe.trainer.val_only
                else f"{trainer.total_steps} steps")
        say(f"[run] '{pipe.name}': {what}, {pipe.cluster.describe()}, runtime {pipe.runtime.backend}")
        if pipe.memory:  # the plan's estimate, beside which the run logs memory/<mesh>/peak_gb
            say("[run] " + "\n      ".join(pipe.memory.lines()))
        if log_dir:
            say(f"[run] logs of vLLM, Ray, Megatron and transformers: {log_dir}/ (--verbose shows them here)")
        try:
            with console.quiet(log_dir):
                history = trainer.fit(log_dir)
        except PipelineError as exc:
            say(f"[run] failed: {exc}")
            return 1
        finally:
            if log_dir:
                count, first = console.warnings_in(log_dir)
                say(f"[run] {count} warning line(s) in the logs ({log_dir}/)" +
                    (f"; the engine's first: {first}" if first else ""))
        before, after, only = ({k: v for k, v in history.get(name, {}).items() if "val-core/" in k}
                               for name in ("val_before", "val_last", "val_only"))
        for key, value in sorted(only.items()):
            say(f"[run] {key}: {value:.3f} (validation only)")
        for key in sorted(set(before) | set(after)):
            if key in before and key in after:
                say(f"[run] {key}: before {before[key]:.3f} -> after {after[key]:.3f}")
            else:
                say(f"[run] {key}: {after.get(key, before.get(key)):.3f} ({'after' if key in after else 'before'} training)")
        if args.json:
            emit(history)
    return 0
