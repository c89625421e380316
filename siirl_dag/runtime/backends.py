"""Where rank workers live: in this process (`local`), as Ray actors pinned by placement groups (`ray`),
or nowhere (`simulated`: handles answering in shape only, `runtime.simulated`).

All expose the same calls; the Ray one returns ObjectRefs and the others finished calls, so the
driver's scheduling code is the same for all and local and Ray results are identical on the same seed.
A call names the worker's method itself (`backend.call(worker, RankWorker.run, ...)`), so a reader
follows it with grep.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any, Callable

from siirl_dag.refs import importing_env
from siirl_dag.runtime import machines
from siirl_dag.runtime.fan_out import Fanned, FanOut, Held, RankLeader, values
from siirl_dag.runtime.worker import RankWorker


class _Done:
    """A finished in-process call: its value, or the exception it raised (re-raised by `get`)."""

    def __init__(self, value=None, error: BaseException | None = None):
        self.value, self.error = value, error


class LocalBackend:
    """Everything in this process; for debugging and the smallest runs."""

    name = "local"
    immediate = True  # a call has finished when it returns: nothing to wait for, outputs held by value

    def __init__(self, pipeline, address: str | None = None, log_dir=None):
        self.pipeline, self.log_dir = pipeline, log_dir

    def start(self) -> None:
        pass

    def create_worker(self, group: str, rank: int, world: int, device: int | None):
        return RankWorker(group, rank, world, self.pipeline.cluster.device, threads=1, log_dir=self.log_dir)

    def call(self, worker, method: Callable, *args, num_returns: int = 1, **kwargs):
        try:
            value = method(worker, *args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - delivered at `get`, as Ray does (torch's CheckpointException is one)
            return [_Done(error=exc)] * num_returns if num_returns > 1 else _Done(error=exc)
        return [_Done(v) for v in value] if num_returns > 1 else _Done(value)

    def get(self, done, timeout: float | None = None):
        if isinstance(done, list):
            return [self.get(d) for d in done]
        if done.error is not None:
            raise done.error
        return done.value

    def fetch(self, ref):
        return ref

    def output(self, ref):
        """A call's first return as other calls take it (`RankWorker.run`'s shard): its value, here."""
        return self.get(ref)

    def put(self, value):
        """`value` as a shard's reference: itself, in this process."""
        return value

    def wait(self, pending: list, timeout: float | None = None) -> list:  # noqa: ARG002 - Ray's waits that long
        """The calls of `pending` finished by now (all of them: they finished when they returned)."""
        return pending

    def kill(self, worker) -> None:
        pass

    def lost_machines(self) -> list:
        return []

    def shutdown(self) -> None:
        pass


FREE_OBJECTS_PERIOD_MS = 10
# a Ray starts in seconds, a loaded machine's in a minute; past this it is stuck (seen when the machine ran
# out of memory as Ray's processes started: ray.init then waits for them forever)
RAY_START_S = 300


def unreachable(address: str) -> str | None:
    """Why the Ray cluster at `address` cannot be reached, or None ('auto' and 'local' are Ray's to
    resolve): ray.init retries an address nothing listens on for minutes before it gives up."""
    if address in ("auto", "local"):
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return f"'{address}' is not host:port"
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        return f"nothing answers at {host}:{port} ({exc.strerror or exc})"
    return None


def init_ray(address: str | None = None, num_cpus: int | None = None, log_to_driver: bool = True) -> None:
    """Attach to a cluster at `address`, or start a local Ray whose workers see this process's sys.path.
    `log_to_driver`: Ray forwards what its workers print (not when they log to files of their own)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": log_to_driver}
    if address:
        kwargs["address"] = address
    else:
        from siirl_dag.runtime import reaper

        reaper.guard()  # the Ray about to start, and all it starts, ends with this process (a SIGKILL included)
        kwargs["address"] = "local"  # a new Ray of its own, never a cluster this machine already runs (ray start)
        # workers import the same code the driver sees (the checkout, user kinds, tests)
        kwargs.update(num_cpus=num_cpus, runtime_env={"env_vars": importing_env()},
                      # Ray batches object frees for up to 1 s, so every step's outputs
                      # land on untouched shared memory and pay its page faults (up to 10x
                      # a warm copy on a VM); freed promptly, the store reuses warm pages
                      _system_config={"free_objects_period_milliseconds": FREE_OBJECTS_PERIOD_MS,
                                      # idle workers started ahead go unused: every actor here carries
                                      # its own runtime env (OMP_NUM_THREADS), so each starts its own process
                                      "prestart_worker_first_driver": False, "enable_worker_prestart": False})
    stuck = threading.Timer(RAY_START_S, _stuck_starting)
    stuck.daemon = True
    stuck.start()
    try:
        ray.init(**kwargs)
    finally:
        stuck.cancel()


def _stuck_starting() -> None:
    """ray.init has not returned (it waits in Ray's C++ core, which nothing in Python can interrupt): say
    so and end this process, which takes the Ray it was starting with it (reaper.guard)."""
    print(f"[runtime] Ray did not start within {RAY_START_S} s: its processes died as they started (out of memory? "
          "see the raylet's log, /tmp/ray/session_latest/logs/raylet.out); stopping", file=sys.stderr, flush=True)
    os._exit(1)


def stop_ray() -> None:
    """Stop the Ray this process started, and remove the semaphores its weight-sync channels left in
    /dev/shm (named after its raylet, now gone: see `weight_sync.shared_memory`)."""
    import ray

    from siirl_dag.orphan_files import RAY_SEMAPHORES, sweep_dead

    ray.shutdown()
    sweep_dead(RAY_SEMAPHORES)


class RayBackend:
    """One Ray actor per rank, placed with one STRICT_PACK placement group per machine."""

    name = "ray"
    immediate = False

    def __init__(self, pipeline, address: str | None = None, log_dir=None):
        self.pipeline, self.log_dir = pipeline, log_dir
        self.address = address or pipeline.runtime.address
        self.started_ray = False
        self.groups: list = []
        self.actors: list = []
        self.machines: list[machines.Machine] = []
        self.made: dict[tuple[str, int], int] = {}  # workers made per (group, rank), which names them in Ray
        self.methods: dict[tuple, tuple] = {}  # (id(worker), method, num_returns) -> (worker, its bound method)
        # a large mesh's ranks are called through leaders, one per runtime.fan_out ranks (runtime.fan_out)
        self.fan = FanOut(pipeline.runtime.fan_out, self._start_leader,
                          lambda leader, number, calls: leader.call.remote(number, calls), self._ray_get)

    def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        cluster, cpr = self.pipeline.cluster, self.pipeline.runtime.cpus_per_rank
        if not ray.is_initialized():
            init_ray(self.address, int(max(os.cpu_count() or 1, cluster.total * cpr + 1)), log_to_driver=not self.log_dir)
            self.started_ray = True
        self.machines = machines.choose(ray.nodes(), cluster, cpr, ray.get_runtime_context().get_node_id())
        bundle, n = machines.bundle(cluster, cpr), cluster.devices_per_node
        self.groups = [placement_group([dict(bundle)] * n, strategy="STRICT_PACK",
                                       bundle_label_selector=[{machines.NODE_LABEL: m.node_id}] * n) for m in self.machines]
        ray.get([pg.ready() for pg in self.groups], timeout=120)

    def create_worker(self, group: str, rank: int, world: int, device: int | None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cluster = self.pipeline.cluster
        threads = max(1, int(self.pipeline.runtime.cpus_per_rank))
        made = self.made[group, rank] = self.made.get((group, rank), 0) + 1  # a restarted rank gets a new name
        options: dict[str, Any] = {"name": f"{group}:{rank}" + (f"#{made}" if made > 1 else ""), "max_concurrency": 1,
                                   "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}}
        if device is None:  # a compute worker: reward, advantage ... beside the driver (threaded actors are slower)
            options.update(num_cpus=0)
        else:
            machine, local = divmod(device, cluster.devices_per_node)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.groups[machine], placement_group_bundle_index=local)
            options.update(num_gpus=1, num_cpus=1) if cluster.device == "cuda" else options.update(num_cpus=self.pipeline.runtime.cpus_per_rank)
        actor = ray.remote(RankWorker).options(**options).remote(group, rank, world, cluster.device, threads,
                                                                 self.log_dir and str(self.log_dir), own_process=True)
        self.actors.append(actor)
        self.fan.add(actor, group, rank, world, device)
        return actor

    def _start_leader(self, workers: list, device: int):
        """A block's leader (`fan_out.RankLeader`), on the machine of its first rank (held there: a soft
        affinity lets Ray start it on another node, the head say), holding no resource."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = self.machines[device // self.pipeline.cluster.devices_per_node].node_id
        leader = ray.remote(RankLeader).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(workers)
        self.actors.append(leader)
        return leader

    def call(self, worker, method: Callable, *args, num_returns: int = 1, **kwargs):
        if self.fan.fanned(worker):
            return self.fan.call(worker, method.__name__, args, kwargs, num_returns)
        key = (id(worker), method.__name__, num_returns)  # made once: `.options` costs about a third of a call
        held, bound = self.methods.get(key, (None, None))
        if held is not worker:
            bound = getattr(worker, method.__name__).options(num_returns=num_returns)
            self.methods[key] = (worker, bound)  # the worker held: its id is not reused while cached
        return bound.remote(*args, **kwargs)

    def get(self, ref, timeout: float | None = None):
        return self.fan.get(ref, timeout) if isinstance(ref, list) else self.fan.get([ref], timeout)[0]

    @staticmethod
    def _ray_get(refs: list, timeout: float | None) -> list:
        import ray

        return ray.get(refs, timeout=timeout)

    def output(self, ref):
        """A call's first return as other calls take it: its reference (a leader's answer holds it)."""
        return self.get(ref) if isinstance(ref, Fanned) else ref

    def fetch(self, ref):
        """A shard from the object store (one a leader's round returned, `Held`, too), or one held here
        (read back from a checkpoint)."""
        import ray

        if isinstance(ref, Held):
            return values((ref,))[0]
        return ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref

    def put(self, value):
        """`value` in the object store once: a value passed inline to a call is serialized into each call
        (the prompts of a step, to every rollout rank)."""
        import ray

        return ray.put(value)

    def wait(self, pending: list, timeout: float | None = None) -> list:
        """Every call of `pending` finished by now, once one has (none if none has within `timeout` s): a
        node's ranks finish together, and a wait per call would cost the driver calls x pending."""
        import ray

        self.fan.flush()
        waitable = {}  # the references to wait on (a handle's: its round's) -> the calls they finish
        for call in pending:
            waitable.setdefault(self.fan.waitable(call), []).append(call)
        refs = list(waitable)
        ready, rest = ray.wait(refs, num_returns=1, timeout=timeout)
        if rest:
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        return [call for ref in ready for call in waitable[ref]]

    def kill(self, worker) -> None:
        import ray

        ray.kill(worker, no_restart=True)

    def lost_machines(self) -> list[machines.Machine]:
        """Machines whose node is gone (one Ray node standing for every machine is never lost mid-run)."""
        import ray

        return machines.lost(self.machines, ray.nodes()) if len(set(self.machines)) > 1 else []

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        self.fan.flush()  # calls not waited for (closing pipes) reach their ranks before they are killed
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine during teardown
                pass
        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        self.actors, self.groups, self.methods = [], [], {}
        if self.started_ray:
            stop_ray()
            self.started_ray = False


# runtime.backend -> its class ("module:Class"); a new backend is one module plus one line
BACKENDS = {
    "local": "siirl_dag.runtime.backends:LocalBackend",
    "ray": "siirl_dag.runtime.backends:RayBackend",
    "simulated": "siirl_dag.runtime.simulated:SimulatedBackend",
}
