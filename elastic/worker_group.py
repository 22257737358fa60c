"""The Ray-backed worker group: places, starts, polls and tears down one generation of ranks.

Each node that hosts ranks has one `elastic.agent.NodeAgent` (a Ray actor)
that runs them as child processes; the group talks to the agents, never to a
rank directly. Placement fills nodes in a stable order with consecutive
ranks, so a tensor-parallel group (consecutive ranks, `tp` innermost) stays
on one node whenever a node's slots are a multiple of `tp`.

Every call to an agent has a deadline, and no Ray error leaves this module:
an agent that dies or does not answer while a generation starts is a
`StartError`; while it runs (a poll, a stop), its ranks are dead or
`RanksUnreachable`; the controller hands each to its failure policy.
"""

from __future__ import annotations

import itertools
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic.agent import COMMAND_TIMEOUT_S, ZYGOTE_START_S, NodeAgent
from elastic.config import JobConfig
from elastic.layout import Layout
from elastic.memory import NodeMemory, memory_root
from elastic.messages import RankStatus, Reset, StackDump
from elastic.recipe import working_dir
from elastic.replica_link import SECRET_BYTES


@dataclass
class Member:
    rank: int
    node_id: str
    pid: int = 0


LONG_POLL_S = 1.0
"""How long an agent holds a poll open when its ranks have only step records to report: fewer Ray calls
compete with training, while deaths, saves and errors are still seen at once."""
GATHER_S = 0.02
"""Once one agent's poll answers, how long a round waits for the others' before it takes what has arrived:
a round costs two `ray.wait` calls per batch of answers instead of two per answer, and a death is seen
at most this much later."""
CALL_TIMEOUT_S = COMMAND_TIMEOUT_S + 10.0
"""The deadline of an agent call that waits on its ranks only for a quick command (start, stop after a step)."""
SPARE_TIMEOUT_S = ZYGOTE_START_S + CALL_TIMEOUT_S
"""The deadline of starting a spare. A fork is quick, but a node's first spare waits for its agent to start and for the
agent's fork server to import torch (seconds, more on busy cores; `elastic.agent.ZYGOTE_START_S` at most). The
controller's loop does not wait for it: only a call still unanswered after this is reported as failed."""
REPLICA_HOST_TIMEOUT_S = 5.0
"""How long a node that holds memory replicas but no ranks may leave a call unanswered before it leaves the ring."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours Ray puts in its errors' text


class StartError(RuntimeError):
    """Workers could not be started; the message carries the rank process's own error.

    `cause`: the errors the job's own code raised, without the nodes and
    processes that raised them; "" where a call missed its deadline or an
    agent or node died. A start that fails with the same cause twice in a row
    would fail the same way every time (`elastic.policies.FailurePolicy`).
    """

    def __init__(self, message: str, cause: str = ""):
        super().__init__(message)
        self.cause = cause


class RanksUnreachable(RuntimeError):
    """A call to running ranks failed: their node's agent died, raised, or missed its deadline."""

    def __init__(self, ranks: list[int], why: str):
        super().__init__(f"ranks {ranks}: {why}")
        self.ranks = ranks


@ray.remote(num_cpus=0, max_retries=0)
def _drop_job_memory(memory_dir: str, job: str) -> None:
    """On the node it runs on: remove the job's memory-tier files (an agent that was killed left them there)."""
    NodeMemory(memory_root(memory_dir) / ray.get_runtime_context().get_node_id() / job).destroy()


def _one_line(exc: BaseException) -> str:
    """An error in one line: its message's first line, and its last where more follow. A Ray error whose actor's
    constructor raised (`ActorDiedError`) says so on its first line and ends with the error raised (after the
    traceback), which is what names the cause: an unusable `checkpoint.memory_dir`, say."""
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) == 1:
        return f"{type(exc).__name__}: {lines[0]}"
    first = lines[0].split(" (pid=")[0]  # Ray's process and actor ids follow: the last line says more
    return f"{type(exc).__name__}: {first} ... {lines[-1]}"


def _raised(why: str) -> str | None:
    """The error a failed call's own code raised (the last line of `_gather`'s text for it), without the node, the
    process or the call; None where the call raised nothing (it missed its deadline, its actor or node died) or
    raised a timeout of its own (a rank process slow to start: a busy node, not a setting)."""
    text = _ANSI.sub("", why)
    if not (text.startswith("ray::") or "error raised in its creation task" in text):  # RayTaskError, a constructor's
        return None
    error = [line.strip() for line in text.splitlines() if line.strip()][-1].rsplit(" ... ", 1)[-1]
    return None if error.startswith("TimeoutError") else error


def _start_failure(what: str, failed: dict[str, str], timeout_s: float | None = None) -> StartError:
    """A start's failed calls as one error: each distinct cause once (`_causes`), the deadline where one was missed."""
    raised = [_raised(why) for why in failed.values()]
    deadline = f" (fault.startup_timeout_s={timeout_s}s)" if timeout_s is not None and None in raised else ""
    return StartError(f"{what}{deadline}: {_causes(failed)}", "" if None in raised else "; ".join(sorted(set(raised))))


def _causes(failed: dict[str, str]) -> str:
    """A start's failed calls ({call: why}; a call is named by its node's id) in one line, each distinct error once
    with the calls it failed, their node ids cut to 8 characters as in the report: a bad setting fails every node
    alike, and its error must not be cut off behind the first node's."""
    calls: dict[str, list[str]] = {}
    for call, why in sorted(failed.items()):
        *verb, node = call.split(" ")
        calls.setdefault(why, []).append(" ".join([*verb, node[:8]]))
    return "; ".join(f"{why} ({', '.join(names)})" for why, names in calls.items())


@dataclass
class RayWorkerGroup:
    cfg: JobConfig
    store_host: str
    store_port: int
    members: list[Member] = field(default_factory=list)
    excluded_nodes: set[str] = field(default_factory=set)
    agents: dict[str, object] = field(default_factory=dict)  # by node; each keeps its warm rank processes
    generation: int = -1
    memory_floor: tuple[int, int] | None = None  # (generation, step) of the newest committed memory step: agents drop older snapshots
    memory_job: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # names this job's memory directories
    replica_secret: str = field(default_factory=lambda: secrets.token_hex(SECRET_BYTES))  # opens the agents' replication links
    memory_staged: dict[str, dict] = field(default_factory=dict)  # the last start's memory restore, per node (agent.memory_stage)
    replica_ring: list[str] = field(default_factory=list)  # the nodes whose agents pass memory replicas on, each to the next
    _spares: dict[str, tuple[object, float]] = field(default_factory=dict)  # a node's spare call in flight, and when it went
    _host_call: tuple[object, float] | None = None  # the last call to the ring's node without ranks, and when it went
    _host_sought: float = 0.0  # when a ring without such a node last looked for one (monotonic)
    _peer_calls: itertools.count = field(default_factory=lambda: itertools.count(1))  # numbers the agents' set_peer calls
    _adopting: tuple[str, object] | None = None  # the host being taken into the ring, and the set_peer call to the ranks' node
    _ring_news: list[dict] = field(default_factory=list)  # a ring without a replica at a start, its changes mid-generation: events
    _pending: dict[str, object] = field(default_factory=dict)  # an agent's poll in flight, by node
    _retiring: list[tuple[object, object]] = field(default_factory=list)  # (agent, its shutdown's ref) of nodes that left
    _killed_on: set[str] = field(default_factory=set)  # nodes whose agent was killed: its memory files may be left there

    # -- capacity ----------------------------------------------------------------
    def _slots(self, resources: dict) -> int:
        s = self.cfg.scaling
        slots = int(resources.get("CPU", 0) // s.cpus_per_worker)
        if s.gpus_per_worker > 0:
            slots = min(slots, int(resources.get("GPU", 0) // s.gpus_per_worker))
        return slots

    def node_slots(self, alive: list[dict] | None = None) -> list[tuple[str, int]]:
        """Alive, non-excluded nodes and how many workers each can host, in a stable order (of `alive`, `_alive()`'s
        listing, when given)."""
        nodes = [n for n in (self._alive() if alive is None else alive) if n["NodeID"] not in self.excluded_nodes]
        out = [(n["NodeID"], self._slots(n["Resources"])) for n in nodes]
        return sorted((n, s) for n, s in out if s > 0)

    @staticmethod
    def _alive() -> list[dict]:
        """Ray's records of the nodes that are up, excluded ones too (an excluded node gets no ranks, but its memory
        is still good)."""
        return [n for n in ray.nodes() if n["Alive"]]

    def capacity(self) -> int:
        return sum(s for _, s in self.node_slots())

    # -- lifecycle ---------------------------------------------------------------
    def _agent(self, node_id: str, slots: int):
        """The node's agent, created on first use with the node's whole worker capacity reserved."""
        if node_id not in self.agents:
            s, c = self.cfg.scaling, self.cfg.checkpoint
            memory = {"dir": c.memory_dir, "job": self.memory_job, "replicas": c.memory_replicas, "secret": self.replica_secret} if c.memory else None
            self.agents[node_id] = NodeAgent.options(
                num_cpus=slots * s.cpus_per_worker,
                num_gpus=slots * s.gpus_per_worker,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(s.cpus_per_worker, s.gpus_per_worker, working_dir(), memory, self.store_host == "127.0.0.1")
        return self.agents[node_id]

    def _by_node(self) -> dict[str, list[Member]]:
        out: dict[str, list[Member]] = {}
        for m in self.members:
            out.setdefault(m.node_id, []).append(m)
        return out

    def start(self, layout: Layout, specs: list[dict], *, with_spares: bool = False, memory_restore: dict | None = None) -> None:
        """Place the ranks node by node, have each node's agent bring up its rank processes, then start training.

        `with_spares` also starts the warm spare of each node that gets ranks
        alongside them, so that its start-up overlaps the ranks' own instead
        of taking CPU from training later (the job's first start, which no
        failure is waiting on; `replenish` then covers the other nodes).
        `memory_restore` (`elastic.checkpointing.MemoryTier.find`'s plan): the
        memory step the ranks resume from, which every node that gets ranks
        first gathers from the nodes that hold its files (while its rank
        processes come up). With the memory tier on, each node that gets ranks
        replicates to the next one (a ring); a job whose ranks all fit on one
        node keeps its replicas on another node that is up (`_replica_host`).
        """
        up = self._alive()
        nodes = self.node_slots(up)
        placeable, alive = dict(nodes), {n["NodeID"] for n in up}
        placement: list[str] = []
        for node_id, slots in nodes:
            placement += [node_id] * slots
        if len(placement) < layout.world_size:
            raise StartError(f"need {layout.world_size} worker slots, the cluster has {len(placement)}")
        # An excluded node (its ranks hung) that is up keeps its agent, without rank processes, where it holds files
        # of the memory step being restored (the new ranks read them after this start) or is to hold the replicas
        # of a job left on one node (`_replica_host`). Any other agent of a node that is excluded or gone goes,
        # with its ranks.
        self.members = [Member(rank, placement[rank]) for rank in range(layout.world_size)]
        self.generation, self._pending = specs[0]["generation"], {}
        by_node = self._by_node()
        holders = set(memory_restore["holders"].values()) & alive if memory_restore else set()
        host = self._replica_host(by_node, placeable, alive)
        self.replica_ring = sorted(by_node) + ([host] if host else []) if self.cfg.checkpoint.memory else []
        self._host_call = self._adopting = None
        if len(self.replica_ring) == 1 and self.cfg.checkpoint.memory_replicas:
            self._ring_news.append({"generation": self.generation, "ring": list(self.replica_ring), "reason": (
                f"the ranks are all on node {self.replica_ring[0][:8]} and no other node of the job is up: its memory snapshots "
                "have no replica until one is (a loss of that node restores from the durable tier)")})
        for node_id in [n for n in self.agents if n not in placeable and n not in holders and n != host]:
            self._retire(self.agents.pop(node_id), node_up=node_id in alive)
        self._reap_retired()
        serving = {n: self.agents[n] for n in holders | ({host} if host else set()) if n not in placeable}
        keep_idle = 1 if self._spares_wanted() else 0  # warm processes this layout has no slot for: one per node stays
        timeout = self.cfg.fault.startup_timeout_s
        agents = {node_id: self._agent(node_id, slots) for node_id, slots in nodes if node_id in by_node or node_id in self.agents}
        # A rank process that cannot start (import error, no such device) fails here with its own error; the
        # controller then shuts the group down (every agent) and asks its failure policy.
        calls = {n: a.prepare.remote(len(by_node.get(n, [])), keep_idle, timeout, with_spares and keep_idle > 0) for n, a in agents.items()}
        calls |= {n: a.prepare.remote(0, 0, timeout) for n, a in serving.items()}  # no rank processes left there
        calls |= self._memory_calls(by_node, agents, memory_restore)
        answers, failed = self._gather(calls, timeout + 10)
        self.memory_staged = {n.removeprefix("stage "): a for n, a in answers.items() if n.startswith("stage ")}
        if failed:
            raise _start_failure("workers did not start", failed, timeout)
        store_timeout = max(60.0, timeout)
        pids, failed = self._gather({
            n: agents[n].start.remote([(m.rank, specs[m.rank]) for m in ms], self.store_host, self.store_port, store_timeout)
            for n, ms in by_node.items()
        }, CALL_TIMEOUT_S)
        if failed:  # an agent that died between prepare and start (its node went), or a rank process that did
            raise _start_failure("workers could not be given their ranks", failed)
        for node_pids in pids.values():
            for m in self.members:
                m.pid = node_pids.get(m.rank, m.pid)  # for diagnostics and the recovery benchmark's start-up breakdown

    def _replica_host(self, by_node: dict[str, list[Member]], placeable: dict[str, int], alive: set[str]) -> str | None:
        """Where a job whose ranks are all on one node keeps its memory replicas: another node that is up and has an
        agent already (none is started for it on the recovery path), one that can take ranks before one excluded for
        its hangs (its agent and memory still serve). None: the ranks span nodes (they replicate to each other), or
        no such node is up."""
        if not (self.cfg.checkpoint.memory and self.cfg.checkpoint.memory_replicas) or len(by_node) != 1:
            return None
        others = [n for n in self.agents if n in alive and n not in by_node]
        return min(others, key=lambda n: (n not in placeable, n), default=None)

    def _memory_calls(self, by_node: dict[str, list[Member]], agents: dict, restore: dict | None) -> dict[str, object]:
        """The memory tier's part of a start: each node's replica peer (the next in `replica_ring`), and the restore's
        staging on the nodes that get ranks."""
        if not self.cfg.checkpoint.memory:
            return {}
        ring = self.replica_ring
        calls = {f"peer {n}": self._set_peer(n, ring[(i + 1) % len(ring)] if len(ring) > 1 else None) for i, n in enumerate(ring)}
        if restore is not None:
            gone = sorted({node for node in restore["holders"].values() if node not in self.agents})
            if gone:
                raise StartError(f"the memory snapshot of step {restore['step']} is held on nodes that are gone: {gone}")
            sources = {rank: self.agents[node] for rank, node in restore["holders"].items()}
            for n in sorted(by_node):
                calls[f"stage {n}"] = agents[n].memory_stage.remote(
                    restore["step"], restore["generation"], restore["rows"], sources, restore["layout"], restore["train_state"])
        return calls

    def memory_inventory(self) -> dict[str, dict]:
        """The memory inventory ({(generation, step): {rank: rows}}) of each agent whose node is up, excluded or not; a
        node that is gone, or whose agent does not answer, holds nothing (a lost node's agent can outlive its node for a
        moment)."""
        alive = {n["NodeID"] for n in self._alive()}
        answers, _ = self._gather({n: a.memory_inventory.remote() for n, a in self.agents.items() if n in alive}, CALL_TIMEOUT_S)
        return answers

    def memory_records(self, generation: int, step: int, holders: dict[int, str]) -> dict[int, list[dict]]:
        """The step records that the files of memory step `step` carry, from the node holding each rank's ({rank: node})."""
        by_node: dict[str, list[int]] = {}
        for rank, node in holders.items():
            by_node.setdefault(node, []).append(rank)
        answers, _ = self._gather({n: self.agents[n].memory_records.remote(generation, step, ranks) for n, ranks in by_node.items()},
                                  CALL_TIMEOUT_S)
        return {rank: records for per_rank in answers.values() for rank, records in per_rank.items()}

    def memory_verify(self, step: int, files: dict[str, dict[int, list[dict]]]) -> dict[tuple[str, int], str]:
        """Check the files of `step` on the nodes that hold them ({node: {rank: rows}}); {(node, rank): why} for each that fails."""
        answers, failed = self._gather({n: self.agents[n].memory_verify.remote(step, rows) for n, rows in files.items()}, CALL_TIMEOUT_S)
        bad = {(n, rank): why for n, per_rank in answers.items() for rank, why in per_rank.items()}
        bad |= {(n, rank): f"its node did not answer: {why}" for n, why in failed.items() for rank in files[n]}
        return bad

    def replica_holder(self, node_id: str) -> str | None:
        """The node that holds `node_id`'s memory replicas this generation (the next in `replica_ring`), or None."""
        ring = self.replica_ring
        if not self.cfg.checkpoint.memory_replicas or len(ring) < 2 or node_id not in ring:
            return None
        return ring[(ring.index(node_id) + 1) % len(ring)]

    def memory_corrupt(self, seed: int) -> str:
        """Flip a byte in every memory snapshot file on every node (fault injection); says how many."""
        answers, _ = self._gather({n: a.memory_corrupt.remote(seed) for n, a in self.agents.items()}, CALL_TIMEOUT_S)
        return f"memory: {sum(answers.values())} snapshot files on {len(answers)} nodes"

    def poll(self, timeout_s: float) -> list[RankStatus]:
        """One round of polls; a rank whose process (or whose node's agent) is dead comes back with alive=False.

        Each agent's poll is a long poll (up to LONG_POLL_S) over its node's
        ranks: it answers when a rank records something (a save, an error, the
        end: at once; steps: in batches every `elastic.train.STEP_REPORT_S`) or
        dies. A round returns what arrived within `timeout_s`, and within
        GATHER_S when a rank is dead: Ray fails a dead agent's outstanding poll
        within moments, so detection does not depend on the poll rate.
        """
        by_node = self._by_node()
        self._tend_ring(by_node)
        for node_id in by_node:
            if node_id not in self._pending:
                self._pending[node_id] = self.agents[node_id].poll.remote(self.generation, LONG_POLL_S, self.memory_floor)
        deadline = time.monotonic() + timeout_s
        results: dict[int, RankStatus] = {}
        waiting = dict(self._pending)
        while waiting:
            refs = list(waiting.values())
            if not ray.wait(refs, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))[0]:
                break  # the round is over
            # Agents answer within moments of each other when ranks are in lockstep: take them in one call.
            gather_s = min(GATHER_S, max(0.0, deadline - time.monotonic()))
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=gather_s)[0])
            for node_id, ref in list(waiting.items()):
                if ref in ready:
                    del waiting[node_id], self._pending[node_id]
                    for status in self._statuses(by_node[node_id], ref):
                        results[status.rank] = status
            if any(not s.alive for s in results.values()):
                break
        return [results[m.rank] for m in self.members if m.rank in results]

    def _tend_ring(self, by_node: dict[str, list[Member]]) -> None:
        """Mid-generation care of the replicas of a job whose ranks are all on one node, about once per LONG_POLL_S.

        A ring without a node to hold them takes one as soon as a node that is
        up has an agent (`_replica_host`; a warm spare's, on a node that joined
        or at the job's first start: `replenish`): the ranks' node replicates
        to it from the next snapshot on, rather than from the next generation's
        start. That node is not polled: it is sent the memory floor (it drops
        the older replicas it holds, as polled nodes do); once it has died or
        left a call unanswered for REPLICA_HOST_TIMEOUT_S, it leaves the ring:
        the ranks' node stops sending it replicas (a send to a node that is
        gone can hold the ranks up for `checkpoint.memory_replica_timeout_s` a
        step), and the steps commit unreplicated (`memory_committed` says so).
        """
        if len(by_node) != 1 or not (self.cfg.checkpoint.memory and self.cfg.checkpoint.memory_replicas):
            return
        now, (node,) = time.monotonic(), by_node
        hosts = [n for n in self.replica_ring if n not in by_node]
        if not hosts:
            self._adopt_host(node, by_node, now)
            return
        if self._host_call is not None and now < self._host_call[1] + LONG_POLL_S:
            return
        if self._host_call is not None:
            ref, sent = self._host_call
            if not ray.wait([ref], timeout=0)[0] and now < sent + REPLICA_HOST_TIMEOUT_S:
                return  # not answered yet: wait, without holding up the poll
            try:
                ray.get(ref, timeout=0)
            except RayError as exc:  # gone, or not answering (GetTimeoutError)
                self._set_peer(node, None)
                self._set_ring([node], f"node {hosts[0][:8]} holding the replicas did not answer: {_one_line(exc)}")
                return
        self._host_call = (self.agents[hosts[0]].poll.remote(self.generation, 0.0, self.memory_floor), now)

    def _adopt_host(self, node: str, by_node: dict[str, list[Member]], now: float) -> None:
        """Find a host for the ring (`_replica_host`), tell the agent of the ranks' `node`, and take the host into the
        ring once that agent has its address (the host's agent may still be starting)."""
        if self._adopting is not None:
            host, ref = self._adopting
            if not ray.wait([ref], timeout=0)[0]:
                return
            self._adopting = None
            try:
                ray.get(ref, timeout=0)
            except RayError:
                return  # the host went before it answered: look again
            if host in self.agents:
                self._set_ring([node, host], f"node {host[:8]} holds the replicas from the next snapshot on")
            return
        if now < self._host_sought + LONG_POLL_S or all(n in by_node for n in self.agents):
            return
        self._host_sought = now
        up = self._alive()
        host = self._replica_host(by_node, dict(self.node_slots(up)), {n["NodeID"] for n in up})
        if host is not None:
            self._adopting = (host, self._set_peer(node, host))

    def _set_peer(self, node_id: str, peer: str | None):
        """Tell `node_id`'s agent where its replicas go (the ref of the call)."""
        return self.agents[node_id].set_peer.remote(self.agents[peer] if peer is not None else None, next(self._peer_calls))

    def _set_ring(self, ring: list[str], reason: str) -> None:
        """The ring of a job on one node changes mid-generation (its ranks' node first): for the controller's events."""
        self.replica_ring, self._host_call = ring, None
        self._ring_news.append({"generation": self.generation, "ring": list(ring), "reason": reason})

    def ring_changes(self) -> list[dict]:
        """The ring's changes since the last call ({generation, ring, reason} each): a generation that starts with its
        ranks on one node and no node to hold their replicas, and what changes mid-generation."""
        news, self._ring_news = self._ring_news, []
        return news

    @staticmethod
    def _statuses(members: list[Member], ref) -> list[RankStatus]:
        try:
            answers = {s.rank: s for s in ray.get(ref)}  # ready: returns at once
        except RayError as exc:  # the agent is gone, and every rank on its node with it (or its poll failed: the same to us)
            return [RankStatus(m.rank, False, error=_one_line(exc)) for m in members]
        return [answers[m.rank] for m in members if m.rank in answers]

    @staticmethod
    def _gather(refs: dict[str, object], timeout_s: float) -> tuple[dict[str, object], dict[str, str]]:
        """Each node's answer to a call, and why a node gave none (its agent died, the call raised, or missed `timeout_s`)."""
        ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)[0]) if refs else set()
        answers, failed = {}, {}
        for node_id, ref in refs.items():
            if ref not in ready:
                failed[node_id] = f"no answer within {timeout_s}s"
                continue
            try:
                answers[node_id] = ray.get(ref)
            except RayTaskError as exc:  # the agent raised: its message is the rank process's own error
                failed[node_id] = str(exc)
            except RayError as exc:
                failed[node_id] = _one_line(exc)
        return answers, failed

    def stop_after(self, step: int) -> None:
        """Have every rank stop after `step`; raises RanksUnreachable naming the ranks that may not have."""
        by_node = self._by_node()
        answers, failed = self._gather({n: self.agents[n].stop_after.remote(step) for n in by_node}, CALL_TIMEOUT_S)
        ranks = sorted([r for refused in answers.values() for r in refused] + [m.rank for n in failed for m in by_node[n]])
        if ranks:
            raise RanksUnreachable(ranks, f"could not be told to stop after step {step}: {failed or 'no answer from the rank'}")

    def stacks(self, timeout_s: float = 5.0) -> dict[int, StackDump]:
        answers, failed = self._gather({n: self.agents[n].stacks.remote(timeout_s) for n in self._by_node()}, timeout_s + 1)
        out = {rank: dump for dumps in answers.values() for rank, dump in dumps.items()}
        return {m.rank: out.get(m.rank) or StackDump.missing(failed.get(m.node_id, "no answer")) for m in self.members}

    def node_of(self, rank: int) -> str | None:
        return self.members[rank].node_id if rank < len(self.members) else None

    def node_alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id for n in self._alive())

    def _spares_wanted(self) -> bool:
        """A GPU spare would hold a GPU a rank needs, so GPU jobs have none."""
        return self.cfg.scaling.gpus_per_worker == 0

    def replenish(self) -> None:
        """Have one warm spare rank process on every usable node that has none (torch and the training code imported).

        A rank that dies is then replaced by a process that is already up: the
        next generation starts without paying a cold start. After a failure it
        is called once the new generation is training, so the spares'
        start-up never delays a restart. Not waited for: on a node that just
        joined, the agent's first spare waits for its fork server to import
        torch (seconds), and the controller watches the job meanwhile;
        `spare_errors` says how the calls went.
        """
        if not self._spares_wanted():
            return
        for node_id, slots in self.node_slots():
            if node_id not in self._spares:
                self._spares[node_id] = (self._agent(node_id, slots).spare.remote(), time.monotonic())

    def spare_errors(self, wait_s: float = 0.0) -> dict[str, str]:
        """Why a node has no spare, for each `replenish` call that failed, or went unanswered for SPARE_TIMEOUT_S,
        since the last look ({} when none did); `wait_s`: how long to wait for the calls in flight first (they fork,
        they do not wait for the imports)."""
        if not self._spares:
            return {}
        refs = [ref for ref, _ in self._spares.values()]
        done = set(ray.wait(refs, num_returns=len(refs), timeout=wait_s)[0])
        now = time.monotonic()
        late = {n: f"no answer within {SPARE_TIMEOUT_S}s" for n, (ref, sent) in self._spares.items()
                if ref not in done and now >= sent + SPARE_TIMEOUT_S}
        _, failed = self._gather({n: ref for n, (ref, _) in self._spares.items() if ref in done}, 0.0)
        self._spares = {n: call for n, call in self._spares.items() if call[0] not in done and n not in late}
        return failed | late

    def teardown(self, kill_ranks=(), grace_s: float = 0.1) -> int:
        """End the generation, keeping the survivors' processes warm for the next one; returns how many were kept.

        Each agent kills its ranks in `kill_ranks` (dead, or the culprit of a
        hang) first: that breaks the collectives the others wait in, so their
        loops end and can be reset. A survivor whose loop has not ended after
        `grace_s` (most are inside a collective with a peer that will never
        answer) has its collectives aborted, and is killed only if even that
        leaves it stuck: nobody waits for a collective timeout, and a survivor
        is not replaced by a cold process. The grace is short because the
        generation is over: it only lets a loop at a step boundary leave
        cleanly.
        """
        refs = {n: self.agents[n].teardown.remote([m.rank for m in ms if m.rank in set(kill_ranks)], grace_s)
                for n, ms in self._by_node().items()}
        answers, failed = self._gather(refs, Reset(grace_s).longest_s + 2.0)
        # An agent that died (its node went, or it was killed) or cannot end its generation in time goes, with
        # its ranks: the next start makes a new one.
        for node_id in failed:
            self._kill(self.agents.pop(node_id))
            self._killed_on.add(node_id)
        self.members, self._pending = [], {}
        return sum(answers.values())

    def shutdown(self) -> None:
        """Kill every rank process, warm ones included, and the agents (the end of the job); remove the memory files
        that killed agents left on nodes that are up (an agent that shuts down removes its own)."""
        for agent in self.agents.values():
            self._retire(agent, node_up=True)
        orphans = self._killed_on - set(self.agents) if self.cfg.checkpoint.memory else set()
        drops = [_drop_job_memory.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                 .remote(self.cfg.checkpoint.memory_dir, self.memory_job) for n in (self._alive() if orphans else []) if n["NodeID"] in orphans]
        self._reap_retired(wait_s=5.0)
        if drops:
            ray.wait(drops, num_returns=len(drops), timeout=5.0)
        self.members, self.agents, self._pending, self._killed_on = [], {}, {}, set()

    def _retire(self, agent, node_up: bool) -> None:
        """An agent whose node left the job: on a node that is up it first shuts down (its rank processes and its
        node's memory files go, which a kill would leave behind in that node's RAM), without the caller waiting."""
        if node_up:
            self._retiring.append((agent, agent.shutdown.remote()))
        else:
            self._kill(agent)

    def _reap_retired(self, wait_s: float = 0.0) -> None:
        """Kill the retiring agents whose shutdown is done (all of them once `wait_s` is over, when it is > 0)."""
        if not self._retiring:
            return
        refs = [ref for _, ref in self._retiring]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        left = []
        for agent, ref in self._retiring:
            if wait_s > 0 or ref in done:
                self._kill(agent)
            else:
                left.append((agent, ref))
        self._retiring = left

    @staticmethod
    def _kill(agent) -> None:
        try:
            ray.kill(agent, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
