"""The Ray-backed worker group: places, starts, polls and tears down one generation of workers.

Placement fills nodes in a stable order with consecutive ranks, so a
tensor-parallel group (consecutive ranks, `tp` innermost) stays on one node
whenever a node's slots are a multiple of `tp`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic.config import JobConfig
from elastic.layout import Layout
from elastic.worker import Worker


@dataclass
class RankStatus:
    rank: int
    alive: bool
    poll: dict | None = None
    error: str | None = None


@dataclass
class Member:
    rank: int
    node_id: str
    actor: object
    pid: int = 0
    pending: object = None


LONG_POLL_S = 1.0
"""How long a worker holds a poll open when it has only step records to report: fewer Ray calls compete
with training (each poll takes the worker's GIL), while deaths, saves and errors are still seen at once."""
GATHER_S = 0.02
"""Once one rank's poll answers, how long a round waits for the others' before it takes what has arrived:
a round costs two `ray.wait` calls per batch of answers instead of two per answer (quadratic in the
ranks, since each call takes every outstanding poll), and a death is seen at most this much later."""


class StartError(RuntimeError):
    """Workers could not be started; the message carries the worker's own error."""


@dataclass
class RayWorkerGroup:
    cfg: JobConfig
    store_host: str
    store_port: int
    members: list[Member] = field(default_factory=list)
    excluded_nodes: set[str] = field(default_factory=set)
    idle: dict[str, list] = field(default_factory=dict)  # warm workers of ended generations, by node

    # -- capacity ----------------------------------------------------------------
    def _slots(self, resources: dict) -> int:
        s = self.cfg.scaling
        slots = int(resources.get("CPU", 0) // s.cpus_per_worker)
        if s.gpus_per_worker > 0:
            slots = min(slots, int(resources.get("GPU", 0) // s.gpus_per_worker))
        return slots

    def node_slots(self) -> list[tuple[str, int]]:
        """Alive, non-excluded nodes and how many workers each can host, in a stable order."""
        nodes = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] not in self.excluded_nodes]
        out = [(n["NodeID"], self._slots(n["Resources"])) for n in nodes]
        return sorted((n, s) for n, s in out if s > 0)

    def capacity(self) -> int:
        return sum(s for _, s in self.node_slots())

    # -- lifecycle ---------------------------------------------------------------
    def start(self, layout: Layout, specs: list[dict], *, with_spares: bool = False) -> None:
        """Create one actor per rank (node by node), check each started, then start training.

        `with_spares` also starts the warm spares (`replenish`) alongside the
        ranks, so that their start-up overlaps the ranks' own instead of
        taking CPU from training later (the job's first start, which no
        failure is waiting on).
        """
        s = self.cfg.scaling
        placement: list[str] = []
        for node_id, slots in self.node_slots():
            placement += [node_id] * slots
        if len(placement) < layout.world_size:
            raise StartError(f"need {layout.world_size} worker slots, the cluster has {len(placement)}")
        self.members = []
        for rank in range(layout.world_size):
            node = placement[rank]
            warm = self.idle.get(node)
            actor = warm.pop() if warm else Worker.options(
                num_cpus=s.cpus_per_worker,
                num_gpus=s.gpus_per_worker,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote()
            self.members.append(Member(rank, node, actor))
        # Warm workers this layout has no slot for: one per node stays as a spare, the rest go.
        spares = {node: actors[:1] for node, actors in self.idle.items() if actors and self._spares_wanted()}
        self._kill([a for node, actors in self.idle.items() for a in actors[len(spares.get(node, [])):]])
        self.idle = spares
        if with_spares:
            self.replenish()
        try:  # an actor that cannot start (import error, no such device) fails here with its own error
            infos = ray.get([m.actor.info.remote() for m in self.members], timeout=self.cfg.fault.startup_timeout_s)
            for member, info in zip(self.members, infos):
                member.pid = info["pid"]  # for diagnostics and the recovery benchmark's start-up breakdown
        except GetTimeoutError:
            raise StartError(f"workers did not start within fault.startup_timeout_s={self.cfg.fault.startup_timeout_s}s") from None
        except (RayActorError, RayTaskError) as exc:
            raise StartError(f"a worker failed to start: {exc}") from None
        timeout = max(60.0, self.cfg.fault.startup_timeout_s)
        ray.get([m.actor.start.remote(spec, self.store_host, self.store_port, timeout) for m, spec in zip(self.members, specs)])

    def poll(self, timeout_s: float) -> list[RankStatus]:
        """One round of polls; a rank whose actor is dead comes back with alive=False.

        Each rank's poll is a long poll (up to LONG_POLL_S): it answers when its
        loop records something (a save, an error, the end: at once; steps: in
        batches every `elastic.train.STEP_REPORT_S`). A round returns what arrived within `timeout_s`, and
        within GATHER_S when a rank is dead: Ray fails a dead actor's outstanding
        poll within moments, so detection does not depend on the poll rate.
        """
        for m in self.members:
            if m.pending is None:
                m.pending = m.actor.poll.remote(LONG_POLL_S)
        deadline = time.monotonic() + timeout_s
        results: dict[int, RankStatus] = {}
        waiting = [m for m in self.members if m.pending is not None]
        while waiting:
            refs = [m.pending for m in waiting]
            if not ray.wait(refs, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))[0]:
                break  # the round is over
            # Ranks in lockstep answer within moments of each other: take them in one call, not one call each.
            gather_s = min(GATHER_S, max(0.0, deadline - time.monotonic()))
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=gather_s)[0])
            for m in waiting:
                if m.pending in ready:
                    ref, m.pending = m.pending, None
                    results[m.rank] = self._status(m.rank, ref)
            if any(not s.alive for s in results.values()):
                break
            waiting = [m for m in waiting if m.pending is not None]
        return [results[m.rank] for m in self.members if m.rank in results]

    @staticmethod
    def _status(rank: int, ref) -> RankStatus:
        try:
            return RankStatus(rank, True, ray.get(ref))
        except RayActorError as exc:
            return RankStatus(rank, False, error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    def stop_after(self, step: int) -> None:
        ray.get([m.actor.stop_after.remote(step) for m in self.members])

    def stacks(self, timeout_s: float = 5.0) -> dict[int, str]:
        refs = {m.rank: m.actor.stacks.remote() for m in self.members}
        out = {}
        for rank, ref in refs.items():
            try:
                out[rank] = ray.get(ref, timeout=timeout_s)
            except Exception as exc:  # noqa: BLE001 - a rank that cannot answer is reported as such
                out[rank] = f"<no stack: {type(exc).__name__}>"
        return out

    def node_of(self, rank: int) -> str | None:
        return self.members[rank].node_id if rank < len(self.members) else None

    def node_alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())

    def _spares_wanted(self) -> bool:
        """Spares hold no CPU reservation; a GPU spare would hold a GPU a rank needs, so GPU jobs have none."""
        return self.cfg.scaling.gpus_per_worker == 0

    def replenish(self) -> None:
        """Start one warm spare worker on every usable node that has none (torch and the training code imported).

        A rank that dies is then replaced by a process that is already up: the
        next generation starts without paying a cold start. After a failure it
        is called once the new generation is training, so the spares'
        start-up never delays a restart.
        """
        if not self._spares_wanted():
            return
        for node, _ in self.node_slots():
            if not self.idle.get(node):
                self.idle[node] = [
                    Worker.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                ]

    def teardown(self, kill_ranks=(), grace_s: float = 0.5) -> int:
        """End the generation, keeping the survivors' processes warm for the next one; returns how many were kept.

        The ranks in `kill_ranks` (dead, or the culprit of a hang) are killed
        first: that breaks the collectives the others wait in, so their loops
        end and `reset` can release them. A survivor still stuck after
        `grace_s` is killed too: nobody waits for a collective timeout.
        """
        doomed = [m for m in self.members if m.rank in set(kill_ranks)]
        self._kill([m.actor for m in doomed])
        rest = [m for m in self.members if m not in doomed]
        resets = {m.rank: m.actor.reset.remote(grace_s) for m in rest}
        ready, _ = ray.wait(list(resets.values()), num_returns=len(resets), timeout=grace_s + 0.5) if resets else ([], [])
        kept = 0
        for m in rest:
            ref = resets[m.rank]
            try:
                reusable = ref in ready and ray.get(ref)
            except RayActorError:
                reusable = False
            if reusable:
                self.idle.setdefault(m.node_id, []).append(m.actor)
                kept += 1
            else:
                self._kill([m.actor])
        self.members = []
        return kept

    def shutdown(self) -> None:
        """Kill every worker, warm ones included (the end of the job)."""
        self._kill([m.actor for m in self.members] + [a for actors in self.idle.values() for a in actors])
        self.members, self.idle = [], {}

    @staticmethod
    def _kill(actors) -> None:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
