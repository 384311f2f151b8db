"""Routers of a fleet of engine replicas: which replica gets each arriving request.

A router sees what a real one sees: the requests it sent to each replica, which of them have
finished, and the prompts' block hashes. It does not read the replicas' schedulers; the
`prefix_aware` policy keeps its own approximate index of the prefixes each replica has cached,
as cache-aware routers (SGLang's, llm-d's) do.

- `round_robin`: the next replica in turn (a Kubernetes service, vLLM's production-stack
  default); rejected requests take no turn.
- `least_outstanding`: the replica with the fewest requests in flight (sent, not yet finished).
- `prefix_aware`: the replica holding the longest prefix of the prompt, unless loads are
  unbalanced (then the least loaded) or no replica holds at least `cache_threshold` of it (then
  the least loaded). Loads are unbalanced when the largest exceeds the smallest by more than
  `balance_abs` requests and by a factor `balance_rel`. Block hashes are chained as the engine
  chains them, cache salt included, so a block matches only where the whole prefix up to it
  does, and a salted prompt only its own tenant's.
- `session_affinity`: every turn of a conversation (the trace's `session_id`) to the same
  replica, picked by rendezvous hashing of the session id over the replicas (the highest
  md5 of "session/replica": stable across runs and machines, and a replica added or removed
  moves only its own sessions), as vLLM production-stack's `session` routing logic and
  sticky-session gateways do; a request without a session goes to the least loaded replica.
Ties go to the first replica after the last one chosen, so equal replicas take turns.

With `class_replicas` (`--class-replicas docs=3`) a request class (simkv/replay/classes.py) has
replicas of its own: its requests go there only, the other classes' to the replicas no class
claims, and the policy picks within those (turns and ties counted per set of replicas), as a
gateway that sends long documents to a pool of their own does.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

ROUTERS = ("round_robin", "least_outstanding", "prefix_aware", "session_affinity")


class RouterError(ValueError):
    """A router name or option that does not exist or has a bad value."""


@dataclass(frozen=True)
class RouterOptions:
    cache_threshold: float = 0.3  # prefix_aware: fraction of the prompt's blocks a replica must hold
    balance_abs: int = 64  # prefix_aware: outstanding-request gap that counts as unbalanced ...
    balance_rel: float = 1.5  # ... when the largest load is also this many times the smallest

    @classmethod
    def parse(cls, items: tuple[str, ...] | list[str]) -> "RouterOptions":
        """From KEY=VALUE strings (`--router-option cache_threshold=0.5`)."""
        values: dict = {}
        kinds = {"cache_threshold": float, "balance_abs": int, "balance_rel": float}
        for item in items:
            key, sep, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in kinds:
                raise RouterError(f"router option {item!r}: expected KEY=VALUE with KEY one of {', '.join(kinds)}")
            try:
                values[key] = kinds[key](raw)
            except ValueError:
                raise RouterError(f"router option {key}: {raw!r} is not a {kinds[key].__name__}") from None
        opts = cls(**values)
        if not 0.0 <= opts.cache_threshold <= 1.0:
            raise RouterError(f"router option cache_threshold must be within [0, 1], got {opts.cache_threshold}")
        if opts.balance_abs < 0 or opts.balance_rel < 1.0:
            raise RouterError("router options balance_abs must be >= 0 and balance_rel >= 1")
        return opts

    def to_dict(self) -> dict:
        return {"cache_threshold": self.cache_threshold, "balance_abs": self.balance_abs,
                "balance_rel": self.balance_rel}


def parse_class_replicas(items: tuple[str, ...] | list[str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``["docs=3", "chat=0-2"]`` (or ``chat=0,1,2``) -> ``(("docs", (3,)), ("chat", (0, 1, 2)))``."""
    out: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, spec = item.rpartition("=")
        if not sep or not name.strip():
            raise RouterError(f"--class-replicas {item!r}: expected CLASS=REPLICAS (docs=3, chat=0-2 or chat=0,1,2)")
        replicas: list[int] = []
        try:
            for part in spec.split(","):
                lo, dash, hi = part.strip().partition("-")
                replicas += list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
        except ValueError:
            raise RouterError(f"--class-replicas {item!r}: {spec!r} is not a list of replica numbers "
                              "(0-2 or 0,1,2)") from None
        if not replicas:
            raise RouterError(f"--class-replicas {item!r}: no replica")
        if name in out:
            raise RouterError(f"--class-replicas names class {name!r} twice")
        out[name] = tuple(sorted(set(replicas)))
    return tuple(out.items())


def class_replica_items_of(mapping: dict) -> list[str]:
    """A config file's class_replicas mapping ({class: "0-2" | 3 | [0, 1]}) as CLASS=REPLICAS items."""
    return [f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in mapping.items()]


def parse_replica_sets(items: tuple[str, ...] | list[str]) -> tuple:
    """``("2-3:gpu=H200,tensor_parallel_size=2",)`` -> ``(((2, 3), (("gpu", "H200"), ("tensor_parallel_size",
    2))),)`` (FleetSpec.replica_sets; the options checked when the replicas' configs are built)."""
    from simkv.sweep.grid import parse_value

    out = []
    for item in items:
        span, sep, rest = item.partition(":")
        lo, dash, hi = span.strip().partition("-")
        try:
            replicas = tuple(range(int(lo), int(hi) + 1)) if dash else (int(lo),)
        except ValueError:
            replicas = ()
        options = []
        for part in rest.split(",") if sep else ():
            key, eq, value = part.partition("=")
            if not eq or not key.strip() or not value.strip():
                replicas = ()
                break
            options.append((key.strip().replace("-", "_"), parse_value(value)))
        if not replicas or not options:
            raise RouterError(f"--replica-set {item!r}: expected REPLICAS:KEY=VALUE,... (2-3:gpu=H200)")
        out.append((replicas, tuple(options)))
    return tuple(out)


def replica_set_items_of(mapping) -> list[str]:
    """A config file's replica_sets mapping ({"2-3": {gpu: H200, ...}}) as REPLICAS:KEY=VALUE,... items;
    RouterError if it is not such a mapping."""
    if not isinstance(mapping, dict) or not all(isinstance(v, dict) for v in mapping.values()):
        raise RouterError("replica_sets must be a mapping of REPLICAS: {option: value, ...}")
    return [f"{span}:" + ",".join(f"{k}={v}" for k, v in options.items()) for span, options in mapping.items()]


def replica_sets_text(sets: tuple) -> str:
    """parse_replica_sets' result as one canonical line: sets by first replica, options by name
    (``0-1:gpu=H200,tensor_parallel_size=2;3:gpu=A100-80GB``)."""
    def span(replicas):
        return f"{replicas[0]}-{replicas[-1]}" if len(replicas) > 1 else str(replicas[0])

    return ";".join(span(replicas) + ":" + ",".join(f"{k}={v}" for k, v in sorted(options))
                    for replicas, options in sorted(sets))


def split_pool_class_replicas(items: list[str]) -> tuple[tuple, tuple]:
    """P/D pools: ``["prefill:docs=1", "decode:docs=0-1"]`` -> each pool's parse_class_replicas."""
    pools: dict[str, list[str]] = {"prefill": [], "decode": []}
    for item in items:
        pool, sep, rest = item.partition(":")
        if not sep or pool not in pools:
            raise RouterError(f"--class-replicas {item!r}: with P/D pools an item names its pool "
                              "(prefill:docs=1 or decode:docs=0-1)")
        pools[pool].append(rest)
    return parse_class_replicas(pools["prefill"]), parse_class_replicas(pools["decode"])


def check_class_replicas(class_replicas: tuple, num_replicas: int) -> dict[str, tuple[int, ...]]:
    """As a mapping, each replica number checked against the fleet's size."""
    out = {}
    for name, replicas in class_replicas:
        bad = [r for r in replicas if not 0 <= r < num_replicas]
        if bad:
            raise RouterError(f"--class-replicas {name}: replica {bad[0]} is not one of the fleet's 0-{num_replicas - 1}")
        out[name] = tuple(sorted(set(replicas)))
    return out


def session_replica(session: str, candidates: tuple[int, ...]) -> int:
    """The replica of `candidates` a session belongs to: rendezvous (highest random weight)
    hashing, each replica's weight the md5 of "session/replica"."""
    def weight(r: int) -> bytes:
        return hashlib.md5(f"{session}/{r}".encode()).digest()
    return max(candidates, key=weight)


def chained(hashes: np.ndarray | None, salt: str | None = None) -> list[int]:
    """Keys of a prompt's blocks that, like the engine's block hashes, each stand for the whole
    prefix up to their block (and the request's cache salt): block i of two prompts matches
    only where blocks 0..i all do."""
    if hashes is None:
        return []
    key = hash(salt) if salt else 0
    out = []
    for h in hashes.tolist():
        key = hash((key, h))
        out.append(key)
    return out


class PrefixIndex:
    """The block hashes a router has sent to one replica, least recently sent first, holding
    at most `capacity_tokens` tokens of them (the replica's KV cache size)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.tokens = 0
        self._blocks: OrderedDict[int, int] = OrderedDict()  # hash -> tokens it stands for

    def matched_blocks(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[int], block_tokens: int) -> None:
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = block_tokens
                self.tokens += block_tokens
        while self.tokens > self.capacity_tokens and blocks:
            _, tokens = blocks.popitem(last=False)
            self.tokens -= tokens


class Router:
    def __init__(self, policy: str, num_replicas: int, options: RouterOptions | None = None,
                 cache_tokens_per_replica: int | list[int] = 0, class_replicas: tuple = ()) -> None:
        """`class_replicas`: ((request class, replicas), ...): that class's requests go to those
        replicas only, the other classes' to the replicas no class claims (all, where every one
        is claimed); the policy picks among them."""
        if policy not in ROUTERS:
            raise RouterError(f"unknown router {policy!r}; choose one of {', '.join(ROUTERS)}")
        if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
            raise RouterError(f"replicas must be a whole number >= 1, got {num_replicas!r}")
        self.policy = policy
        self.num_replicas = num_replicas
        self.options = options or RouterOptions()
        self.class_replicas = check_class_replicas(class_replicas, num_replicas)
        claimed = {r for replicas in self.class_replicas.values() for r in replicas}
        self._others = tuple(r for r in range(num_replicas) if r not in claimed) or tuple(range(num_replicas))
        self._last: dict[tuple[int, ...], int] = {}  # per set of candidates, the replica it chose last
        self.num_by_reason = {"round_robin": 0, "least_loaded": 0, "prefix_match": 0, "rebalance": 0, "session": 0}
        capacities = (cache_tokens_per_replica if isinstance(cache_tokens_per_replica, list)
                      else [cache_tokens_per_replica] * num_replicas)  # (replicas of different engines: each its own)
        self.indexes = ([PrefixIndex(tokens) for tokens in capacities] if policy == "prefix_aware" else None)

    def forget(self, replica: int) -> None:
        """A replica started anew (a new pod): nothing it cached before is there any more."""
        if self.indexes is not None:
            self.indexes[replica] = PrefixIndex(self.indexes[replica].capacity_tokens)

    #: An autoscaled fleet's replicas that are up (simkv/replay/autoscale.py); None: every one.
    up: tuple[int, ...] | None = None

    def candidates(self, request_class: str | None) -> tuple[int, ...]:
        """The replicas a request of this class may go to."""
        cands = self.class_replicas.get(request_class, self._others) if request_class is not None else self._others
        return cands if self.up is None else tuple(r for r in cands if r in self.up)

    def choose(self, loads: list[int], hashes: np.ndarray | None, block_tokens: int, salt: str | None = None,
               request_class: str | None = None, session: str | None = None) -> int:
        """The replica for one request, given each replica's outstanding requests (and, for
        prefix_aware, the prompt's block hashes and cache salt; for session_affinity, its
        session id; with `class_replicas`, its class)."""
        cands = self.candidates(request_class)
        last = self._last.get(cands, self.num_replicas - 1)  # (so that the first tie goes to the first candidate)
        if self.policy == "round_robin":
            choice, reason = self._first_after(list(cands), last), "round_robin"
        elif self.policy == "least_outstanding" or (self.policy == "session_affinity" and session is None):
            choice, reason = self._least_loaded(loads, cands, last), "least_loaded"
        elif self.policy == "session_affinity":
            choice, reason = session_replica(session, cands), "session"
        else:
            choice, reason = self._prefix_aware(loads, chained(hashes, salt), block_tokens, cands, last)
        self._last[cands] = choice
        self.num_by_reason[reason] += 1
        return choice

    def _first_after(self, candidates: list[int], last: int) -> int:
        n = self.num_replicas
        return min(candidates, key=lambda r: (r - last - 1) % n)

    def _least_loaded(self, loads: list[int], cands: tuple[int, ...], last: int) -> int:
        low = min(loads[r] for r in cands)
        return self._first_after([r for r in cands if loads[r] == low], last)

    def _prefix_aware(self, loads: list[int], keys: list[int], block_tokens: int, cands: tuple[int, ...],
                      last: int) -> tuple[int, str]:
        opts = self.options
        low, high = min(loads[r] for r in cands), max(loads[r] for r in cands)
        if high - low > opts.balance_abs and high > opts.balance_rel * low:
            choice, reason = self._least_loaded(loads, cands, last), "rebalance"
        else:
            choice, reason = self._least_loaded(loads, cands, last), "least_loaded"
            if keys:
                matched = {r: self.indexes[r].matched_blocks(keys) for r in cands}
                best = max(matched.values())
                if best > 0 and best >= opts.cache_threshold * len(keys):
                    top = [r for r in cands if matched[r] == best]
                    least = min(loads[r] for r in top)
                    choice, reason = self._first_after([r for r in top if loads[r] == least], last), "prefix_match"
        if keys:
            self.indexes[choice].insert(keys, block_tokens)
        return choice, reason

    def describe(self) -> dict:
        out = {"policy": self.policy, "num_replicas": self.num_replicas,
               "decisions": {k: v for k, v in self.num_by_reason.items() if v}}
        if self.class_replicas:
            out["class_replicas"] = {name: list(rs) for name, rs in self.class_replicas.items()}
        if self.policy == "prefix_aware":
            out["options"] = self.options.to_dict()
        return out
