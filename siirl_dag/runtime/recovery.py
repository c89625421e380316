"""What the runtime does when a node fails (`dispatch.Runtime.finish`): re-dispatch it while its
retry_limit lasts, first replacing its worker group if a process died, or stop the run with a
message naming the cause and the way to resume. A lost machine always stops the run."""

from __future__ import annotations

from siirl_dag.errors import PipelineError
from siirl_dag.runtime.step import COMPUTE, Job, Running, StepResult
from siirl_dag.runtime.worker import NodeError
from siirl_dag.weight_sync.versions import NOT_SYNCED


class Recovery:
    def __init__(self, runtime):
        self.rt = runtime  # the dispatch.Runtime whose nodes it retries and whose groups it replaces
        self.attempts: dict[str, int] = {}  # node id -> its retries so far

    def retry_or_raise(self, run: Running, exc: Exception, result: StepResult, job: Job, validating: bool,
                       others: list[Running]) -> Running:
        """`run` re-dispatched (the new run) while its node's retries last; else a PipelineError."""
        rt, step = self.rt, job.step
        self.stop_if_machines_lost(step)
        node = rt.pipe.nodes[run.node]
        cause = getattr(exc, "cause", None) or exc
        tries = self.attempts.get(run.node, 0)
        if tries < node.retry_limit:
            self.attempts[run.node] = tries + 1
            if not isinstance(cause, NodeError):  # the process died: rebuild the group, then re-run
                self._restart_group(rt.group_of(run.node), step, others)
            return rt.dispatch(run.node, result, job, validating, run.job)
        if isinstance(cause, NodeError):
            raise PipelineError(f"step {step}: node '{cause.node}' failed on rank {cause.rank} (host {cause.host})"
                                f"{f' after {tries} retries' if tries else ''}:\n{cause.detail}") from None
        logs = f" (the ranks' logs: {rt.log_dir}/)" if rt.log_dir else ""
        raise PipelineError(f"step {step}: node '{run.node}' failed: {type(cause).__name__}: {cause}{logs}") from None

    def stop_if_machines_lost(self, step: int) -> None:
        """A lost machine cannot be replaced mid-run (its ranks' state went with it): stop, naming it."""
        lost = self.rt.backend.lost_machines()
        if not lost:
            return
        on = {m.index: [f"{name}:{r.rank}" for name, mesh in self.rt.pipe.plan.meshes.items() for r in mesh.ranks
                        if r.machine == m.index] for m in lost}
        where = "; ".join(f"{m}, with ranks {', '.join(on[m.index]) or 'none'}" for m in lost)
        raise PipelineError(f"step {step}: lost {where}. The run stopped; resume from its last checkpoint on a "
                            "cluster with enough devices again: the same command (trainer.resume_mode=auto)")

    def _restart_group(self, group: str, step: int, others: list[Running]) -> None:
        """Replace a group's workers (one died), rebind their roles and rebuild their engines.

        Rebuilt engines load the model from disk. A rollout engine is then brought back to its
        trainer's weights; a trainer that had already updated its weights cannot be brought back
        (its optimizer state died with it), so that is an error naming the way to resume."""
        rt, versions = self.rt, self.rt.versions
        lost = {n: v for n, v in versions.trainer.items() if v and rt.group_of(n) == group}
        if lost:
            names = ", ".join(f"'{n}' ({v} update{'s' if v > 1 else ''})" for n, v in lost.items())
            raise PipelineError(f"step {step}: a process of mesh '{group}' died, and with it the training state of "
                                f"{names}; restarting it would silently start from the initial weights. Resume "
                                "from the last checkpoint instead: rerun with trainer.resume_mode=auto")
        for dst in [d for d, src in versions.source.items() if group in (rt.group_of(d), rt.group_of(src))]:
            rt.weight_syncs.close(dst)  # its pipe has members that die now
        old = rt.workers[group]
        for w in old:
            rt.backend.kill(w)
        new = rt.workers[group] = rt.create_group(group)
        swap = {id(o): n for o, n in zip(old, new)}
        rt.roles = {node: [(swap.get(id(w), w), role) for w, role in pairs] for node, pairs in rt.roles.items()}
        if group != COMPUTE:
            rt.init_group(new)
        rt.add_roles(new)
        behind = [dst for dst in versions.held if rt.group_of(dst) == group]
        for dst in behind:
            versions.held[dst] = NOT_SYNCED
        if behind:  # a trainer of theirs still updating (another batch's job): its update lands first
            sources = {versions.source[dst] for dst in behind}
            landed = set()
            for other in [r for r in others if r.node in sources]:
                try:
                    rt.backend.get([call[1] for call in other.calls])
                    landed.add(other.node)
                except Exception:  # noqa: BLE001 - it failed: no update landed; its own retry says why
                    pass
            rt.weight_syncs.run(step, frozenset(landed))
