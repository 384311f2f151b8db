"""The GPU nodes under an autoscaled fleet (`--node-gpus G`): what a cluster autoscaler adds and
removes as the replicas come and go, and what is paid, which is nodes, not replicas.

Each replica (a pod holding its engine's GPUs: tensor x pipeline x data-parallel) runs on one
node of G GPUs of its GPU kind; a replica needing more than G GPUs is refused. A replica started
by the autoscaler is placed at once, as Kubernetes' scheduler and Kubernetes' cluster autoscaler
place a pending pod:
- on a node that is up and has its GPUs free, `node_placement` choosing which: `pack` (the
  fullest that fits, a MostAllocated scoring, the usual choice for GPU pools) or `spread` (the
  emptiest, the default scheduler's LeastAllocated scoring where GPUs are what it weighs);
- else on a node still being provisioned that fits (the cluster autoscaler counts upcoming
  nodes), the earliest ready first;
- else on a new node, ready `node_provision_s` later (the cloud's instance, its boot, the GPU
  driver and device plugin: 300 s by default).
The replica then takes its cold start (`cold_start_s`) once its node is ready, and on a node
that has not pulled the server's image yet first the pull (`node_image_pull_s`, 0 by default:
then counted in the cold start): replicas placed on a node while its pull runs wait for that
pull, and the nodes up from the start have the image. A node whose last
replica stopped (drained and done, or called off while starting) is removed once it has been
empty for `node_unneeded_s` (the cluster autoscaler's --scale-down-unneeded-time, 10 min), and
never within `node_delay_after_add_s` of a node being added (--scale-down-delay-after-add,
10 min), nor below `min_nodes` nodes of its GPU kind (the node group's minimum, kept from the
start: warm headroom). A replica started on a node still up, empty or not, pays no provisioning.
Replicas are never moved to free a node (vLLM pods marked not safe to evict, as inference
servers are: only empty nodes go).

The nodes up at the start are the `min_nodes` of each GPU kind and those the MIN replicas fill,
ready at 0. A node is paid from its provisioning to its removal (or the replay's end): the
section's `gpu_hours` multiplies by G, and `idle_gpu_share` is the part of it no replica held.
The decisions are made at the autoscaler's instants, on its own record of each replica's end,
so the replay stays deterministic, byte for byte. Not modelled: nodes that fail to join, a
node's image cache (a cold pull belongs in cold_start_s), consolidation that moves
running replicas (Karpenter's).

With `node_mtbf_s` nodes fail (a spot instance reclaimed, a host lost): each node, from its
provisioning, at an instant drawn from an exponential of that mean (seeded by
`node_failure_seed`, drawn in the order the nodes are made). The node goes at once (paid until
then); its replicas' requests in flight are lost (simkv/replay/failures.py: retried through the
router with --client-max-retries), a replica that was draining ends, and the others start again
as new pods placed as above (a cold start, on a new node if none has room); a kept node is
replaced by a new one. With `node_reclaim_notice_s` N (a spot reclaim's warning: two minutes
on AWS, 30 s on GCP and Azure) the cluster learns of the failure N seconds before it: the node is
cordoned and its replicas evicted then, as a node termination handler does: each takes no new
request and runs what it has until its end (a scale-down's: `shutdown_timeout_s` within the
grace period, simkv/replay/autoscale.py; at the latest the failure), losing what is left then,
while its replacement is placed at once elsewhere and takes requests after its cold start
(not before the old pod's end: one engine stands for the slot).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from simkv.clock import TICKS_PER_SECOND, to_ticks

PLACEMENTS = ("pack", "spread")


@dataclass
class Node:
    kind: str  # its GPUs' name
    gpus: int
    start: int  # ticks: provisioning started (0 for a node up from the start)
    ready: int
    kept: bool = False  # one of its kind's min_nodes: never removed
    pods: dict = field(default_factory=dict)  # replica key -> its GPUs
    empty_since: int | None = None  # (None: holds a replica)
    removed: int | None = None
    image_at: int | None = None  # (the tick its image is pulled by; None: never pulled)
    fails_at: int | None = None  # (node_mtbf_s: the tick it fails)
    notice_at: int | None = None  # (node_reclaim_notice_s: the tick it is warned of that, and cordoned)
    loses_at: int | None = None  # (the tick its replicas lose what they still run: fails_at, or their end)
    noticed: bool = False

    @property
    def free(self) -> int:
        return self.gpus - sum(self.pods.values())


class NodePool:
    """The cluster's GPU nodes, shared by the autoscalers of one replay (a fleet, or both P/D
    pools). `spec`: an AutoscaleSpec with node_gpus > 0."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.gpus = spec.node_gpus
        self.provision = to_ticks(spec.node_provision_s)
        self.pull = to_ticks(spec.node_image_pull_s)
        self.unneeded = to_ticks(spec.node_unneeded_s)
        self.delay_after_add = to_ticks(spec.node_delay_after_add_s)
        self.nodes: list[Node] = []
        self.added: list[int] = []  # ticks at which nodes were added (not those up from the start)
        self.held: dict = {}  # replica key -> (its node's index, the tick it was placed at)
        self.held_gpu_ticks = 0  # replicas' GPUs x ticks on ready nodes, for those that stopped
        self.waits: list[int] = []  # ticks each placed replica waited for its node to be ready
        self.mtbf_s = spec.node_mtbf_s  # (nodes that fail: each one's failure drawn when it is made)
        self._rng = np.random.default_rng(spec.node_failure_seed) if self.mtbf_s else None
        self.notice = to_ticks(spec.node_reclaim_notice_s)
        self.kill_after = None if spec.kill_after_s is None else to_ticks(spec.kill_after_s)
        self.num_failed = 0

    def _node(self, kind: str, start: int, ready: int, kept: bool = False, image_at: int | None = None) -> Node:
        node = Node(kind, self.gpus, start, ready, kept=kept, empty_since=0 if kept else None, image_at=image_at)
        if self._rng is not None:
            node.fails_at = start + max(1, to_ticks(float(self._rng.exponential(self.mtbf_s))))
            node.loses_at = node.fails_at
            if self.notice:  # (its pods evicted at the notice: each ends as a scale-down's would, by the failure)
                node.notice_at = max(start, node.fails_at - self.notice)
                if self.kill_after is not None:
                    node.loses_at = min(node.fails_at, node.notice_at + self.kill_after)
        self.nodes.append(node)
        return node

    def check(self, key, gpus: int, kind: str) -> None:
        """A replica that needs more GPUs than a node has is refused; its kind's kept nodes are
        up from the start."""
        if gpus > self.gpus:
            raise ValueError(f"--node-gpus {self.gpus}: replica {key[1]} ({key[0]}) needs {gpus} {kind} GPUs; a "
                             f"replica runs on one node here (give --node-gpus >= {gpus})")
        while sum(1 for n in self.nodes if n.kind == kind and n.kept) < self.spec.min_nodes:
            self._node(kind, 0, 0, kept=True, image_at=0)

    def place(self, key, gpus: int, kind: str, tick: int, initial: bool = False) -> int:
        """Replica `key` (pool, slot) starts at `tick`: the tick its cold start begins on its node
        (ready, with the image pulled). `initial`: one of the MIN replicas, up from the start (a
        new node for it is ready at once, with the image)."""
        self.collect(tick)
        live = [(i, n) for i, n in enumerate(self.nodes)
                if n.removed is None and not n.noticed and n.kind == kind and n.free >= gpus]
        ready = [(i, n) for i, n in live if n.ready <= tick]
        if ready:
            sign = 1 if self.spec.node_placement == "pack" else -1
            i, node = min(ready, key=lambda item: (sign * item[1].free, item[0]))
        elif live:
            i, node = min(live, key=lambda item: (item[1].ready, item[0]))
        else:
            node = self._node(kind, tick, tick if initial else tick + self.provision,
                              image_at=tick if initial else None)
            if not initial:
                self.added.append(tick)
            i = len(self.nodes) - 1
        node.pods[key] = gpus
        node.empty_since = None
        self.held[key] = (i, max(tick, node.ready))  # (its GPUs held once the node is up)
        if node.image_at is None:  # (the first replica here: the kubelet pulls the image once)
            node.image_at = max(tick, node.ready) + self.pull
        start = max(tick, node.ready, node.image_at)
        self.waits.append(start - tick)
        return start

    def release(self, key, tick: int) -> None:
        """Replica `key` stopped at `tick` (its last request done, or called off while starting)."""
        node = self._unhold(key, tick)
        if not node.pods:
            node.empty_since = max(tick, node.ready)

    def _unhold(self, key, tick: int) -> Node:
        """Replica `key` leaves its node at `tick`, its GPUs held until then counted: the node."""
        i, since = self.held.pop(key)
        node = self.nodes[i]
        self.held_gpu_ticks += node.pods.pop(key) * max(0, tick - since)
        return node

    def holds(self, key) -> bool:
        return key in self.held

    def failure_of(self, key) -> int | None:
        """When replica `key` loses what it runs with its node's failure (None: it holds no node,
        or nodes never fail)."""
        held = self.held.get(key)
        return self.nodes[held[0]].loses_at if held is not None else None

    def next_failure(self) -> tuple[int, int] | None:
        """(tick, node index) of the next node to be warned of its failure (node_reclaim_notice_s)
        or to fail (None: none will); `noticed` tells which."""
        return min(((n.fails_at if n.noticed or n.notice_at is None else n.notice_at, i)
                    for i, n in enumerate(self.nodes) if n.removed is None and n.fails_at is not None), default=None)

    def due_notice(self, i: int) -> bool:
        """Node `i`'s next event (next_failure) is its notice, not its failure."""
        node = self.nodes[i]
        return node.notice_at is not None and not node.noticed

    def cordon(self, i: int, tick: int) -> list:
        """Node `i` is warned at `tick` that it will fail: nothing more is placed on it and its
        replicas are evicted (to be placed elsewhere); their keys, their GPUs free."""
        node = self.nodes[i]
        node.noticed = True
        keys = list(node.pods)
        for key in keys:
            self._unhold(key, tick)
        if not node.pods and not node.kept:
            node.empty_since = max(tick, node.ready)
        return keys

    def fail(self, i: int, tick: int) -> list:
        """Node `i` fails at `tick`: gone (a kept one replaced by a new node); the keys of the
        replicas it held, their GPUs free."""
        node = self.nodes[i]
        node.removed = tick
        self.num_failed += 1
        keys = list(node.pods)
        for key in keys:
            self._unhold(key, tick)
        if node.kept:  # (the node group's minimum: a new node in its place)
            node.kept = False
            self.added.append(tick)
            self._node(node.kind, tick, tick + self.provision, kept=True)
        return keys

    def _removal(self, node: Node) -> int:
        """When an empty node goes: empty for `unneeded`, and `delay_after_add` after any add."""
        at = node.empty_since + self.unneeded
        for added in self.added:  # (in order: each may push the instant past the next)
            if at - self.delay_after_add < added <= at:
                at = added + self.delay_after_add
        return at

    def collect(self, tick: int) -> None:
        """Remove, in the order they fall due, the empty nodes due by `tick` (a node group keeps
        `min_nodes` of its kind)."""
        while True:
            due = sorted((self._removal(n), i) for i, n in enumerate(self.nodes)
                         if n.removed is None and not n.kept and not n.pods)
            if not due or due[0][0] > tick:
                return
            at, i = due[0]
            self.nodes[i].removed = at

    def section(self, end: int) -> dict:
        """After the replay (its end at `end`): what the nodes cost and how busy they were."""
        for key in list(self.held):  # (replicas still up: they held their GPUs to the end)
            i, since = self.held[key]
            self.held_gpu_ticks += self.nodes[i].pods[key] * max(0, end - since)
        self.collect(end)
        by_gpu: dict[str, float] = {}
        node_ticks = 0
        gone = [n.removed is not None and n.removed <= end for n in self.nodes]  # (removed by the end)
        up_at_end = [n for n, out in zip(self.nodes, gone) if not out]
        for node in self.nodes:
            span = max(0, min(node.removed if node.removed is not None else end, end) - node.start)
            node_ticks += span
            by_gpu[node.kind] = by_gpu.get(node.kind, 0.0) + span * node.gpus / TICKS_PER_SECOND / 3600.0
        changes = sorted([(n.start, 1) for n in self.nodes] + [(n.removed, -1) for n, out in zip(self.nodes, gone)
                                                                if out])
        timeline, count = [], 0
        for tick, delta in changes:
            count += delta
            if timeline and timeline[-1]["time_s"] == tick / TICKS_PER_SECOND:
                timeline[-1]["nodes"] = count
            else:
                timeline.append({"time_s": tick / TICKS_PER_SECOND, "nodes": count})
        gpu_ticks = node_ticks * self.gpus
        spec = self.spec
        waited = [w for w in self.waits if w > 0]
        return {"gpus_per_node": self.gpus, "provision_s": spec.node_provision_s, "image_pull_s": spec.node_image_pull_s,
                "unneeded_s": spec.node_unneeded_s, "delay_after_add_s": spec.node_delay_after_add_s,
                "min_nodes": spec.min_nodes, "placement": spec.node_placement,
                **({"mtbf_s": spec.node_mtbf_s, "failure_seed": spec.node_failure_seed, "nodes_failed": self.num_failed}
                   if self.mtbf_s else {}),
                **({"reclaim_notice_s": spec.node_reclaim_notice_s} if self.notice else {}),
                "nodes_at_start": sum(1 for n in self.nodes if n.start == 0 and n.ready == 0),
                "nodes_added": len(self.added),
                "nodes_removed": sum(gone),
                "peak_nodes": max((entry["nodes"] for entry in timeline), default=0),
                # (paid to the replay's end only: an empty one among them would cost until its removal)
                "nodes_up_at_end": len(up_at_end), "empty_nodes_at_end": sum(1 for n in up_at_end if not n.pods),
                "mean_nodes": node_ticks / end if end > 0 else float(len(self.nodes)),
                "gpu_hours": sum(by_gpu.values()), "gpu_hours_by_gpu": by_gpu,
                "held_gpu_hours": self.held_gpu_ticks / TICKS_PER_SECOND / 3600.0,
                "idle_gpu_share": 1.0 - self.held_gpu_ticks / gpu_ticks if gpu_ticks > 0 else 0.0,
                "replicas_waiting_for_a_node": len(waited),  # (to join, or to pull the image)
                "mean_node_wait_s": sum(waited) / len(waited) / TICKS_PER_SECOND if waited else 0.0,
                "timeline": timeline}


def describe_nodes(section: dict) -> str:
    """One line: the nodes and what they cost."""
    gpus = section["gpus_per_node"]
    return (f"nodes of {gpus} GPU{'s' if gpus != 1 else ''}: {section['nodes_at_start']} at the start, "
            f"{section['nodes_added']} added (provisioned in {section['provision_s']:g} s, "
            f"{section['replicas_waiting_for_a_node']} replicas waited for one), {section['nodes_removed']} removed, "
            f"peak {section['peak_nodes']}; {section['gpu_hours']:.3f} GPU-h paid, "
            f"{section['idle_gpu_share']:.0%} of it held by no replica"
            + (f"; {section['empty_nodes_at_end']} empty at the end, paid only to it"
               if section.get("empty_nodes_at_end") else ""))
