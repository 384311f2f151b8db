"""Replicas that fail (`--replica-failure T:R`, `--restart-s S`): a fleet's replica R crashes at
T seconds (the server process dies: a CUDA error, an out-of-memory kill, a lost node) and comes
back S seconds later as a new pod, its caches empty.

At T every request in flight on R, waiting or running, is lost: its client's connection drops,
vLLM's engine with it (modelled as an abort at T: a step running then ends with its tokens
undelivered, as when a client's deadline passes during a step; simkv/replay/
client_timeouts.py). A client with retries left (`--client-max-retries`, the back-off of
`--client-retry-backoff`) sends the request again through the router, as the OpenAI client
does on a connection error; without, the request is `failed`. The router sends R nothing from T
until it is back, and then R starts anew (ReplayEngine.start_anew: prefix cache, CPU tier,
adapter and encoder caches empty; a prefix-aware router forgets what it sent there). Failures
are given per replica in time order; a replica fails again only once it is back, and at every
instant some replica is up. The GPUs stay paid (the pod restarts on its node).

With `--replica-mtbf-s M` each replica also fails at random, a Poisson process of mean gap M
seconds (its next failure drawn once it is back) over the trace's arrivals, seeded by
`--failure-seed`: the same seed, the same failures. A drawn failure that would leave a fixed
fleet with no replica up, or falls while its replica is down, is left out.

In an autoscaled fleet (`--autoscale MIN-MAX`) R is a slot: a pod up or starting there restarts
in place (ready S seconds after T, paid meanwhile, a new pod), a drained one just ends, and a
slot that is down loses nothing; with no slot up, requests wait for the first one ready, as a
fleet scaled to zero holds them, and a request waiting for a slot whose pod fails before it is
up waits for the next pod (it never reached the one that failed).

Modelled for fleets of simulated replicas (`--replicas N`, fixed or autoscaled); not yet for P/D
pools, data-parallel ranks or encoder replicas. Paced requests (conversations paced on their
replies, a client's concurrency limit) are: a turn lost for good ends its conversation, as a
time-out does, and frees its client's slot; drawn failures fall within the trace's arrival span,
which a paced replay may outrun.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simkv.clock import TICKS_PER_SECOND, to_ticks


class FailureError(ValueError):
    """A bad --replica-failure / --restart-s."""


@dataclass(frozen=True)
class FailureSpec:
    failures: tuple[tuple[float, int], ...]  # (time_s, replica), in time order
    restart_s: float = 120.0
    mtbf_s: float | None = None  # each replica's mean time between failures, drawn (None: only those given)
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.restart_s >= 1.0 and math.isfinite(self.restart_s)):
            raise FailureError(f"--restart-s must be a number of seconds >= 1 (a pod's restart), got {self.restart_s}")
        if self.mtbf_s is not None and not (self.mtbf_s > 0 and math.isfinite(self.mtbf_s)):
            raise FailureError(f"--replica-mtbf-s must be a number of seconds > 0, got {self.mtbf_s}")
        last_down: dict[int, float] = {}
        for t, r in self.failures:
            if t < last_down.get(r, -math.inf):
                raise FailureError(f"--replica-failure {t:g}:{r}: replica {r} is down until "
                                   f"{last_down[r]:g} s (it failed {self.restart_s:g} s before)")
            last_down[r] = t + self.restart_s

    @classmethod
    def parse(cls, items, restart_s: float | None, num_replicas: int, mtbf_s: float | None = None,
              seed: int | None = None) -> "FailureSpec | None":
        """`items`: 'T:R' texts, on a fleet of `num_replicas`; with neither them nor `mtbf_s`, None."""
        if not items and mtbf_s is None:
            if restart_s is not None or seed is not None:
                raise FailureError(f"{'--restart-s' if restart_s is not None else '--failure-seed'}: give "
                                   "--replica-failure T:R or --replica-mtbf-s too")
            return None
        failures = []
        for item in items:
            when, colon, replica = str(item).partition(":")
            try:
                t, r = float(when), int(replica)
            except ValueError:
                t, r = math.nan, -1
            if not colon or not (t >= 0 and math.isfinite(t)) or r < 0:
                raise FailureError(f"--replica-failure {item!r}: expected T:R, T seconds >= 0 and R a replica")
            failures.append((t, r))
        spec = cls(tuple(sorted(failures)), 120.0 if restart_s is None else float(restart_s),
                   None if mtbf_s is None else float(mtbf_s), int(seed or 0))
        spec.check_fleet(num_replicas, fixed=False)  # (the fleet checks the rest: FleetSpec)
        return spec

    def check_fleet(self, num_replicas: int, fixed: bool = True) -> None:
        """Every failing replica is one of the fleet's, and in a `fixed` fleet one is up at every
        instant (an autoscaled one holds requests for the first slot back, as when scaled to zero)."""
        for t, r in self.failures:
            if r >= num_replicas:
                raise FailureError(f"--replica-failure {t:g}:{r}: not a replica of the fleet's 0-{num_replicas - 1}")
        for t, _ in self.failures if fixed else ():  # (at a failure's instant, is any replica up?)
            if len(self._down(self.failures, t)) >= num_replicas:
                raise FailureError(f"--replica-failure: at {t:g} s every replica is down; the router would have "
                                   "nowhere to send a request (not modelled)")

    def _down(self, failures, t: float) -> set[int]:
        """The replicas that `failures` have down at `t` seconds."""
        return {r for t0, r in failures if t0 <= t < t0 + self.restart_s}

    def to_dict(self) -> dict:
        return {"restart_s": self.restart_s, "failures": [{"time_s": t, "replica": r} for t, r in self.failures]} | (
            {"mtbf_s": self.mtbf_s, "seed": self.seed} if self.mtbf_s is not None else {})

    def drawn(self, num_replicas: int, span_s: float, fixed: bool) -> tuple[tuple[float, int], ...]:
        """The failures given and those drawn from `mtbf_s` over [0, span_s), in time order: a
        drawn one is left out when its replica is down then, or when a `fixed` fleet would have
        none up."""
        if self.mtbf_s is None:
            return self.failures
        import numpy as np

        rng = np.random.default_rng(self.seed)
        draws = []
        for r in range(num_replicas):  # (each replica's own stream, drawn in replica order)
            t = 0.0
            while True:
                t += float(rng.exponential(self.mtbf_s))
                if t >= span_s:
                    break
                draws.append((t, r))
                t += self.restart_s
        kept = list(self.failures)
        for t, r in sorted(draws):
            down = self._down(kept, t)
            if r in down or any(q == r and t < t0 < t + self.restart_s for t0, q in kept):
                continue  # (down then, or a failure given falls within its restart)
            if fixed and len(down | {r}) >= num_replicas:
                continue
            kept.append((t, r))
        return tuple(sorted(kept))


class FailurePlan:
    """The fleet router's view of the failures: which replicas are down at an instant, and the
    restarts to make (each replica starts anew once back, and once its engine holds nothing)."""

    def __init__(self, spec: FailureSpec, failures: tuple[tuple[float, int], ...] | None = None) -> None:
        """`failures`: those given and drawn (FailureSpec.drawn; None: those given)."""
        self.spec = spec
        self.restart = to_ticks(spec.restart_s)
        failures = spec.failures if failures is None else failures
        self.windows = [(to_ticks(t), to_ticks(t) + self.restart, r) for t, r in failures]
        self.pending: list[tuple[int, int]] = [(end, r) for _, end, r in self.windows]  # restarts not yet made
        self.renewing: set[int] = set()  # back, but its engine not yet empty: still down
        self.aborted = [0] * len(self.windows)  # attempts each failure aborted
        self.failed = [0] * len(self.windows)  # of them, requests whose clients gave up for good
        self.node_aborted = self.node_failed = 0  # (likewise, lost with a node that failed)

    def failure_ticks(self, replica: int) -> list[int]:
        return [start for start, _, r in self.windows if r == replica]

    def up(self, tick: int, engines, router) -> tuple[int, ...]:
        """The replicas that take requests at `tick`; restarts due by then are made first."""
        while self.pending and self.pending[0][0] <= tick:
            _, r = self.pending.pop(0)
            self.renewing.add(r)
            router.forget(r)
        for r in sorted(self.renewing):
            if engines[r].start_anew():
                self.renewing.discard(r)
        failed = {r for start, end, r in self.windows if start <= tick < end}
        up = tuple(r for r in range(len(engines)) if r not in failed and r not in self.renewing)
        # (a restart whose engine still ends a step: the others are up, unless none is)
        return up or tuple(r for r in range(len(engines)) if r not in failed)

    def note_abort(self, replica: int, at: int, for_good: bool) -> None:
        """An attempt on `replica` aborted by its failure at tick `at` (or its node's:
        simkv/replay/autoscale_nodes.py)."""
        i = next((i for i, (start, _, r) in enumerate(self.windows) if r == replica and start == at), None)
        if i is None:
            self.node_aborted += 1
            self.node_failed += for_good
            return
        self.aborted[i] += 1
        self.failed[i] += for_good

    def section(self) -> dict:
        return self.spec.to_dict() | {"given": len(self.spec.failures),
                                      "requests_lost": sum(self.aborted) + self.node_aborted,
                                      "requests_failed": sum(self.failed) + self.node_failed,
                                      "lost_with_nodes": self.node_aborted, "failures": [
            {"time_s": start / TICKS_PER_SECOND, "replica": r, "aborted": self.aborted[i], "failed": self.failed[i]}
            for i, (start, _, r) in enumerate(self.windows)]}


def describe_failures(section: dict) -> str:
    """One line for the terminal and report.html."""
    failures = section["failures"]
    drawn = f", MTBF {section['mtbf_s']:g} s a replica" if section.get("mtbf_s") is not None else ""
    if len(failures) > 3:
        lost, failed = sum(f["aborted"] for f in failures), sum(f["failed"] for f in failures)
        return (f"{len(failures)} failures{drawn} ({lost:,} requests lost, {failed:,} for good); each back "
                f"{section['restart_s']:g} s later")
    parts = [f"replica {f['replica']} at {f['time_s']:g} s ({f['aborted']:,} requests lost, {f['failed']:,} for good)"
             for f in failures] or ["none"]
    return f"{'; '.join(parts)}{drawn}; back {section['restart_s']:g} s later"
