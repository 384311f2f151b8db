"""A fleet that grows and shrinks with its load (`--autoscale MIN-MAX`), as a Kubernetes
autoscaler does in front of vLLM replicas (HPA, or KEDA on vLLM's request gauges); or a P/D
pool that does (`--prefill-autoscale`, `--decode-autoscale`: an Autoscaler per pool, each on
its own metric, as a planner that scales prefill and decode workers apart).

The fleet has MAX replica slots; MIN are up from the start. Every `interval_s` (HPA's sync
period, 15 s) the autoscaler reads its metric over the replicas that are up, adds it up, and
wants ceil(sum / `target`) replicas, within [MIN, MAX] (an HPA or KEDA AverageValue target).
The metrics (`metric`):
- `in_flight` (default, target 8): requests sent and not finished (the finishes strictly before
  that instant), what vLLM's `num_requests_running` + `num_requests_waiting` add up to;
- `waiting` (5), `running` (8): vLLM's `num_requests_waiting` or `num_requests_running` alone;
- `kv_usage` (0.5): vLLM's `kv_cache_usage_perc`, the share of the usable KV blocks in use;
- `gpu_util` (0.7): DCGM's GPU utilisation, the share of the last 30 s the replica ran steps
  (simkv/replay/autoscale_util.py).
- `ttft_pQ`, `e2e_pQ`, `itl_pQ` (a target in seconds, no default): the Q-th percentile of
  vLLM's time-to-first-token, end-to-end or inter-token latency histogram over the fleet's last minute
  (simkv/replay/autoscale_latency.py), an HPA Value target: it wants ceil(replicas * value /
  target); with no observation in that minute it recommends nothing.
Several metrics, each with its target (`waiting=5,kv_usage=0.7`), as an HPA with several: each
recommends, and the largest recommendation wins (with none, the fleet stays as it is).
The engine gauges are read as vLLM's engine last reported them: after its last step that ended
strictly before that instant (StepLog.gauges_before); a replica still starting reads 0. With
`metrics_delay_s` every metric is read as it was that long before the decision (a scrape
interval, an adapter's cache): requests in flight from InFlightHistory, the gauges and the
latency windows at that earlier instant.
As HPA does, a sum within `tolerance` (10 %) of what the replicas it has aim at changes
nothing, and its scaling policies limit how many replicas it adds or removes at once
(`scale_up_policy`, `scale_down_policy`, HPA's behavior policies: simkv/replay/autoscale_policy.py;
by default a scale-up adds at most max(4 replicas, 100 %) of those it had 15 s before, and a
scale-down may remove any number). It then wants:
- more than it has (ready or starting): it starts the lowest slots that are down at once; a slot
  takes requests `cold_start_s` later (the pod's scheduling, image and weights loading, CUDA
  graphs: 120 s by default), and is paid for from its start;
- fewer: only once every wish over the last `scale_down_window_s` (HPA's stabilisation window,
  300 s) has been below what it has, it drains the highest slots that are up: they take no new
  requests, finish the ones they have, and are paid for until then. A drained slot that is
  started again before its last request finishes is still warm: it takes requests at once.
  With `shutdown_timeout_s` (vLLM's --shutdown-timeout) a drained slot's pod ends
  min(`prestop_s` + timeout, `termination_grace_s`) after the decision (its preStop hook, then
  vLLM's drain after SIGTERM, within Kubernetes' grace period): what it still has in flight then
  is lost (its feed aborts it, ReplicaClientFeed.shutdown; the clients retry it through the
  router, or it is `failed`), and until then it cannot be started again (a new pod can, once
  the old one is gone; scaled to zero with every pod ending, the one that ends first is
  followed by a new pod, its cold start from that end). The autoscaler then decides at its own
  instants, not as arrivals are routed (FleetRouting._next_decision), so that a pod ends on time.
With `scale_up_window_s` (HPA's scale-up stabilisation window, 0 by default) it starts only as
many as the least wish over that window asked for. A drained slot started again after its last
request is a new pod: its engine's GPU prefix cache starts empty, and a prefix-aware router
forgets what it sent there (`new_pods` counts them); so do its CPU tier, encoder cache and LoRA
adapter caches (ReplayEngine.start_anew).
A scale-down drains the slots still starting first (their start is called off), then the
highest that are up, so the MIN lowest slots, up from the start, always take requests. The
router chooses among the slots that are up (ready and not draining). With MIN 0 the fleet may
scale to zero: a request that finds no slot up goes to the slot that will be ready first, and
waits for it; if none is starting, it starts the lowest slot at once (KEDA's activation) and
waits for its cold start (`held_requests`, `mean_hold_s`); a client whose deadline passes
meanwhile gives up before vLLM schedules it (taken when the slot is ready; its retry is sent at
the deadline plus its back-off, and waits too if no slot is up then). Decisions are made at
fixed instants on the finishes strictly before them, so the replay stays deterministic, byte
for byte.

Paid replica-seconds run until the replay's end (its last step); `gpu_hours` multiplies them by
each slot's GPUs. With `node_gpus` the replicas run on GPU nodes a cluster autoscaler adds and
removes (simkv/replay/autoscale_nodes.py): a replica that finds no room waits for a new node
before its cold start, and `gpu_hours` is the nodes' (the replicas' own: `replica_gpu_hours`).
Not modelled: a P/D pool's latencies other than its own (the prefill pool's TTFT, the decode
pool's ITL), pods that fail to start.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

from simkv.clock import TICKS_PER_SECOND, to_ticks
from simkv.replay.autoscale_latency import HISTOGRAMS, LatencyWatch, custom_buckets, latency_bounds, latency_metric
from simkv.replay.autoscale_nodes import PLACEMENTS, NodePool
from simkv.replay.autoscale_policy import DEFAULT_DOWN, DEFAULT_UP, PolicyError, ScalingRules
from simkv.replay.autoscale_util import BusyWindow


class AutoscaleError(ValueError):
    """A bad --autoscale setting: one line that names it."""


# The settings beside `autoscale` ("MIN-MAX"), by the names flags, --config files and sweep keys
# give them, and the AutoscaleSpec fields they set.
SETTINGS = {"autoscale_metric": "metric", "autoscale_target": "target", "autoscale_tolerance": "tolerance",
            "autoscale_interval_s": "interval_s", "cold_start_s": "cold_start_s",
            "scale_down_window_s": "scale_down_window_s", "scale_up_window_s": "scale_up_window_s",
            "autoscale_latency_window_s": "latency_window_s", "scale_up_policy": "scale_up_policy",
            "scale_down_policy": "scale_down_policy", "autoscale_histogram_buckets": "histogram_buckets",
            "autoscale_metrics_delay_s": "metrics_delay_s",
            "autoscale_latency_target_type": "latency_target_type", "node_gpus": "node_gpus",
            "node_provision_s": "node_provision_s", "node_image_pull_s": "node_image_pull_s",
            "node_unneeded_s": "node_unneeded_s", "node_delay_after_add_s": "node_delay_after_add_s",
            "min_nodes": "min_nodes", "node_placement": "node_placement", "node_mtbf_s": "node_mtbf_s",
            "node_failure_seed": "node_failure_seed", "node_reclaim_notice_s": "node_reclaim_notice_s",
            "shutdown_timeout": "shutdown_timeout_s",
            "termination_grace_s": "termination_grace_s", "prestop_s": "prestop_s"}
# (the others are numbers)
TEXT_SETTINGS = ("autoscale_metric", "scale_up_policy", "scale_down_policy", "autoscale_histogram_buckets",
                 "autoscale_latency_target_type", "node_placement")
# how a latency target reads (HPA's metric target types): Value, ceil(replicas x value / target);
# AverageValue (KEDA's default metricType), ceil(value / target) whatever the replicas
LATENCY_TARGET_TYPES = {"value": "Value", "averagevalue": "AverageValue"}
# the cluster's nodes under the replicas (simkv/replay/autoscale_nodes.py): one set for both P/D pools
NODE_SETTINGS = ("node_gpus", "node_provision_s", "node_image_pull_s", "node_unneeded_s", "node_delay_after_add_s",
                 "min_nodes", "node_placement", "node_mtbf_s", "node_failure_seed", "node_reclaim_notice_s")

# Each metric: its default target per replica, and how a line names it.
METRICS = {"in_flight": (8.0, "in flight"), "running": (8.0, "running"), "waiting": (5.0, "waiting"),
           "kv_usage": (0.5, "KV-cache usage"), "gpu_util": (0.7, "GPU utilisation")}
SHARES = {"kv_usage": "the KV blocks", "gpu_util": "the time"}  # (metrics in (0, 1], their targets too: of what)
GAUGES = ("running", "waiting", "kv_usage")  # (read from the engines' step logs)
# a percentile of vLLM's latency histograms (simkv/replay/autoscale_latency.py)
LATENCY_METRICS = "ttft_pQ, e2e_pQ, itl_pQ"


@dataclass(frozen=True)
class AutoscaleSpec:
    min_replicas: int
    max_replicas: int
    target: float | None = None  # the metric per replica it aims at (None: METRICS' default; several: None)
    interval_s: float = 15.0
    cold_start_s: float = 120.0
    scale_down_window_s: float = 300.0
    metric: str = "in_flight"  # a name, or several with their targets: "waiting=5;kv_usage=0.7"
    tolerance: float = 0.1
    scale_up_window_s: float = 0.0  # HPA's scale-up stabilisation window (0: its default)
    latency_window_s: float = 60.0  # latency metrics: the range of the query's rate()
    latency_target_type: str = "Value"  # latency metrics: HPA's Value, or AverageValue (KEDA's default)
    scale_up_policy: str = DEFAULT_UP  # HPA's behavior.scaleUp policies (simkv/replay/autoscale_policy.py)
    scale_down_policy: str = DEFAULT_DOWN
    histogram_buckets: str = ""  # latency metrics: vLLM's --custom-histogram-buckets JSON ("": its defaults)
    metrics_delay_s: float = 0.0  # each metric read as it was this long before the decision (scrapes, adapters)
    # the GPU nodes under the replicas (simkv/replay/autoscale_nodes.py; 0 GPUs a node: not modelled)
    node_gpus: int = 0
    node_provision_s: float = 300.0
    node_image_pull_s: float = 0.0  # the server's image pulled on a node's first replica (0: in the cold start)
    node_unneeded_s: float = 600.0  # the cluster autoscaler's --scale-down-unneeded-time
    node_delay_after_add_s: float = 600.0  # its --scale-down-delay-after-add
    min_nodes: int = 0  # of each GPU kind, up from the start
    node_placement: str = "pack"
    node_mtbf_s: float | None = None  # nodes that fail: their mean time between failures (None: never)
    node_failure_seed: int = 0
    node_reclaim_notice_s: float = 0.0  # the warning before a node fails (a spot reclaim's: 120 s on AWS)
    # a scale-down's end (Autoscaler._shut_down): vLLM's --shutdown-timeout (None: a drain
    # to the last request), Kubernetes' terminationGracePeriodSeconds and a preStop hook's sleep
    shutdown_timeout_s: float | None = None
    termination_grace_s: float = 30.0
    prestop_s: float = 0.0
    # (metric, target) of each metric, from `metric` and `target`
    targets: tuple[tuple[str, float], ...] = field(init=False, default=(), compare=False, repr=False)
    # the policies and the latency histograms' bounds, parsed from the texts above
    up_rules: ScalingRules = field(init=False, default=None, compare=False, repr=False)
    down_rules: ScalingRules = field(init=False, default=None, compare=False, repr=False)
    bounds: dict = field(init=False, default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas < self.max_replicas:
            raise AutoscaleError(f"--autoscale {self.min_replicas}-{self.max_replicas}: expected MIN-MAX replicas "
                                 "with 0 <= MIN < MAX")
        targets = self._targets()
        if len(targets) == 1:
            (name, target), = targets
            object.__setattr__(self, "metric", name)
            object.__setattr__(self, "target", target)
        else:
            object.__setattr__(self, "metric", ";".join(f"{name}={_number(target)}" for name, target in targets))
        object.__setattr__(self, "targets", targets)
        if not (0 <= self.tolerance < 1):
            raise AutoscaleError(f"--autoscale-tolerance must be in [0, 1), got {self.tolerance}")
        if not (self.interval_s > 0 and math.isfinite(self.interval_s)):
            raise AutoscaleError(f"--autoscale-interval-s must be a number > 0, got {self.interval_s}")
        for name, value in (("--cold-start-s", self.cold_start_s), ("--scale-down-window-s", self.scale_down_window_s),
                            ("--scale-up-window-s", self.scale_up_window_s),
                            ("--autoscale-metrics-delay-s", self.metrics_delay_s)):
            if not (value >= 0 and math.isfinite(value)):
                raise AutoscaleError(f"{name} must be a number of seconds >= 0, got {value}")
        for name, rules in (("scale_up_policy", "up_rules"), ("scale_down_policy", "down_rules")):
            try:  # (written as HPA would list them)
                parsed = ScalingRules.parse(getattr(self, name), "--" + name.replace("_", "-"))
            except PolicyError as exc:
                raise AutoscaleError(str(exc)) from None
            object.__setattr__(self, rules, parsed)
            object.__setattr__(self, name, str(parsed))
        try:  # (written as compact JSON, the families in order)
            buckets = custom_buckets(self.histogram_buckets, "--autoscale-histogram-buckets")
        except ValueError as exc:
            raise AutoscaleError(str(exc)) from None
        object.__setattr__(self, "histogram_buckets", json.dumps(buckets, sort_keys=True, separators=(",", ":"))
                           if buckets else "")
        object.__setattr__(self, "bounds", latency_bounds(buckets))
        if not (self.latency_window_s > 0 and math.isfinite(self.latency_window_s)):
            raise AutoscaleError(f"--autoscale-latency-window-s must be a number of seconds > 0, got "
                                 f"{self.latency_window_s}")
        kind = LATENCY_TARGET_TYPES.get(str(self.latency_target_type).strip().lower().replace("_", ""))
        if kind is None:
            raise AutoscaleError(f"--autoscale-latency-target-type {self.latency_target_type!r}: expected Value or "
                                 "AverageValue")
        object.__setattr__(self, "latency_target_type", kind)
        self._check_nodes()
        self._check_shutdown()

    def _check_shutdown(self) -> None:
        for name, flag in (("shutdown_timeout_s", "--shutdown-timeout"),
                           ("termination_grace_s", "--termination-grace-s"), ("prestop_s", "--prestop-s")):
            value = getattr(self, name)
            if value is None:
                continue
            if not (value >= 0 and math.isfinite(value)):
                raise AutoscaleError(f"{flag} must be a number of seconds >= 0, got {value}")
            object.__setattr__(self, name, float(value))
        if self.shutdown_timeout_s is None and (self.termination_grace_s, self.prestop_s) != (30.0, 0.0):
            raise AutoscaleError("--termination-grace-s and --prestop-s bound a scale-down's drain: give "
                                 "--shutdown-timeout too (vLLM's; 0 aborts what is in flight at once)")

    @property
    def kill_after_s(self) -> float | None:
        """Seconds from a scale-down to its replica's end, whatever it still has in flight: the
        preStop hook, then vLLM's drain, within the grace period (None: it drains to its last
        request)."""
        if self.shutdown_timeout_s is None:
            return None
        return min(self.prestop_s + self.shutdown_timeout_s, self.termination_grace_s)

    def shutdown_dict(self) -> dict:
        if self.shutdown_timeout_s is None:
            return {}
        return {"shutdown_timeout_s": self.shutdown_timeout_s, "termination_grace_s": self.termination_grace_s,
                "prestop_s": self.prestop_s}

    def _check_nodes(self) -> None:
        for name in ("node_gpus", "min_nodes", "node_failure_seed"):
            value = getattr(self, name)
            if not (float(value).is_integer() and value >= 0):
                raise AutoscaleError(f"--{name.replace('_', '-')} must be a whole number >= 0, got {value}")
            object.__setattr__(self, name, int(value))
        for name in ("node_provision_s", "node_image_pull_s", "node_unneeded_s", "node_delay_after_add_s",
                     "node_reclaim_notice_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise AutoscaleError(f"--{name.replace('_', '-')} must be a number of seconds >= 0, got {value}")
            object.__setattr__(self, name, float(value))
        if self.node_mtbf_s is not None:
            if not (self.node_mtbf_s > 0 and math.isfinite(self.node_mtbf_s)):
                raise AutoscaleError(f"--node-mtbf-s must be a number of seconds > 0, got {self.node_mtbf_s}")
            object.__setattr__(self, "node_mtbf_s", float(self.node_mtbf_s))
        if self.node_reclaim_notice_s and self.node_mtbf_s is None:
            raise AutoscaleError("--node-reclaim-notice-s warns of a node's failure: give --node-mtbf-s too")
        placement = str(self.node_placement).strip().lower()
        if placement not in PLACEMENTS:
            raise AutoscaleError(f"--node-placement {self.node_placement!r}: expected one of {', '.join(PLACEMENTS)}")
        object.__setattr__(self, "node_placement", placement)
        defaults = {f.name: f.default for f in fields(self) if f.name in NODE_SETTINGS}
        if not self.node_gpus and self.nodes_dict(every=True) != defaults:
            raise AutoscaleError("--node-provision-s, --node-image-pull-s, --node-unneeded-s, --node-delay-after-add-s, "
                                 "--min-nodes, --node-placement, --node-mtbf-s and --node-failure-seed describe the "
                                 "nodes: give --node-gpus too")

    def nodes_dict(self, every: bool = False) -> dict:
        """The node settings (none without node_gpus, unless `every`)."""
        if not (self.node_gpus or every):
            return {}
        return {name: getattr(self, name) for name in NODE_SETTINGS
                if every or name != "node_reclaim_notice_s" or self.node_reclaim_notice_s}

    @property
    def latency_targets(self) -> tuple[tuple[str, float], ...]:
        """The latency metrics among the targets (ttft_p95, ...)."""
        return tuple((name, target) for name, target in self.targets if name not in METRICS)

    def _targets(self) -> tuple[tuple[str, float], ...]:
        """(metric, target per replica) of each metric, checked."""
        items = [item.strip() for item in self.metric.replace(";", ",").split(",") if item.strip()]
        known = f"{', '.join(METRICS)}, {LATENCY_METRICS}"
        if not items:
            raise AutoscaleError(f"--autoscale-metric {self.metric!r}: expected one of {known}")
        targets = []
        for item in items:
            name, eq, value = item.partition("=")
            name = name.strip().replace("-", "_")
            latency = latency_metric(name)
            if name not in METRICS and latency is None:
                raise AutoscaleError(f"--autoscale-metric {name!r}: expected one of {known} (Q a percentile "
                                     "in (0, 100), e.g. ttft_p95)")
            if any(name == seen for seen, _ in targets):
                raise AutoscaleError(f"--autoscale-metric {self.metric!r}: {name} twice")
            if eq:
                if self.target is not None:
                    raise AutoscaleError(f"--autoscale-metric {self.metric!r} gives its targets: drop "
                                         "--autoscale-target")
                try:
                    target = float(value)
                except ValueError:
                    raise AutoscaleError(f"--autoscale-metric {item!r}: {value!r} is not a number") from None
            elif len(items) > 1:
                raise AutoscaleError(f"--autoscale-metric {self.metric!r}: with several metrics give each its "
                                     "target, e.g. waiting=5,kv_usage=0.7")
            elif latency is not None and self.target is None:
                raise AutoscaleError(f"--autoscale-metric {name}: a latency aims at a number of seconds; give it, "
                                     f"e.g. {name}=2")
            else:
                target = self.target if self.target is not None else METRICS[name][0]
            where = f"--autoscale-metric {item}" if eq else "--autoscale-target"
            if not (target > 0 and math.isfinite(target)):
                raise AutoscaleError(f"{where} must be a number > 0, got {target} ({name})")
            if name in SHARES and target > 1:
                raise AutoscaleError(f"{where}: {target:g} is above 1; {name} aims at a share of {SHARES[name]}, "
                                     "in (0, 1]")
            targets.append((name, target))
        return tuple(targets)

    @classmethod
    def parse(cls, text: str, **options) -> "AutoscaleSpec":
        """'2-8' with the other settings by name."""
        low, dash, high = text.strip().partition("-")
        try:
            lo, hi = int(low), int(high)
        except ValueError:
            raise AutoscaleError(f"--autoscale {text!r}: expected MIN-MAX replicas, e.g. 2-8") from None
        return cls(lo, hi, **{k: v for k, v in options.items() if v is not None})

    @classmethod
    def of(cls, text, settings: dict) -> "AutoscaleSpec":
        """'MIN-MAX' with `settings` by their option names (SETTINGS; None: the default)."""
        fields = {}
        for name, value in settings.items():
            if value is None:
                continue
            if name in TEXT_SETTINGS:  # (a config file may list them: [waiting=5, kv_usage=0.7])
                fields[SETTINGS[name]] = (json.dumps(value) if isinstance(value, dict) else
                                          ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))
                continue
            try:
                fields[SETTINGS[name]] = float(value)
            except (TypeError, ValueError):
                raise AutoscaleError(f"--{name.replace('_', '-')}: {value!r} is not a number") from None
        return cls.parse(str(text), **fields)

    def to_dict(self) -> dict:
        out = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas, "metric": self.metric,
               "target": self.target, "tolerance": self.tolerance, "interval_s": self.interval_s,
               "cold_start_s": self.cold_start_s, "scale_down_window_s": self.scale_down_window_s,
               "scale_up_window_s": self.scale_up_window_s, "scale_up_policy": self.scale_up_policy,
               "scale_down_policy": self.scale_down_policy}
        if self.latency_targets:
            out["latency_window_s"] = self.latency_window_s
            out["latency_target_type"] = self.latency_target_type
        if self.histogram_buckets:
            out["histogram_buckets"] = self.histogram_buckets
        if self.metrics_delay_s:
            out["metrics_delay_s"] = self.metrics_delay_s
        return out | self.nodes_dict() | self.shutdown_dict()


def parse_pool(text: str, defaults: dict, flag: str) -> AutoscaleSpec:
    """A P/D pool's 'MIN-MAX[:KEY=VALUE,...]' over `defaults` (SETTINGS' names; None: unset).
    KEY: a setting's name, its `autoscale_` prefix optional; several metrics separated by ';'."""
    span, _, rest = str(text).partition(":")
    settings = {k: v for k, v in defaults.items() if k in SETTINGS}
    given = set()
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        name = key if key in SETTINGS else f"autoscale_{key}"
        if not eq or name not in SETTINGS or not value.strip():
            raise AutoscaleError(f"{flag} {text!r}: expected MIN-MAX[:KEY=VALUE,...] with KEY one of "
                                 f"{', '.join(k.removeprefix('autoscale_') for k in SETTINGS if k not in NODE_SETTINGS)}"
                                 f", got {item!r}")
        if name in NODE_SETTINGS:
            raise AutoscaleError(f"{flag} {text!r}: {key}: the nodes are the cluster's, under both pools: give "
                                 f"--{key.replace('_', '-')} for both")
        settings[name] = value.strip()
        given.add(name)
    if "autoscale_target" not in given and "=" in str(settings.get("autoscale_metric") or ""):
        settings.pop("autoscale_target", None)  # (a common default target gives way to the metrics' own)
    try:
        return AutoscaleSpec.of(span, settings)
    except AutoscaleError as exc:
        raise AutoscaleError(f"{flag} {text!r}: {exc}") from None


def _number(x: float) -> str:
    return str(int(x)) if x.is_integer() else repr(x)


class Autoscaler:
    """The slots' states over simulated time, advanced by FleetRouting before each routing."""

    def __init__(self, spec: AutoscaleSpec) -> None:
        self.spec = spec
        n = spec.max_replicas
        self.interval = max(1, to_ticks(spec.interval_s))
        self.cold_start = to_ticks(spec.cold_start_s)
        self.window = to_ticks(spec.scale_down_window_s)
        self.up_window = to_ticks(spec.scale_up_window_s)
        self.next_eval = self.interval
        self.ready_at: list[int | None] = [0 if r < spec.min_replicas else None for r in range(n)]  # None: down
        self.last_finish = [0] * n  # (each slot's last finish the router has seen: FleetRouting.loads_at's)
        self.draining_since: list[int | None] = [None] * n
        self.paid: list[list[tuple[int, int | None]]] = [[(0, None)] if r < spec.min_replicas else [] for r in range(n)]
        self.wishes: list[tuple[int, int]] = []  # (tick, replicas wanted) within the window
        self.events: list[dict] = []
        # every decision: its instant, the replicas it had, the wish of its metrics, their readings
        self.decisions: dict[str, list] = {"time_s": [], "replicas": [], "wanted": []} | {
            name: [] for name, _ in spec.targets}
        self.timeline: list[tuple[int, int, int]] = [(0, spec.min_replicas, 0)]  # (tick, ready, starting)
        self.held = 0  # (scale to zero: requests that waited for a slot to be ready, and how long in all)
        self.held_ticks = 0
        self.changes: list[tuple[int, int]] = []  # (tick, +1 started / -1 drained or called off), for the policies
        self.policy_period = to_ticks(max(spec.up_rules.longest_period_s, spec.down_rules.longest_period_s))
        self.gauges = None  # (watch: each slot's engine gauge reader, for the metrics other than in_flight)
        self.busy: list[BusyWindow] | None = None  # (watch: each slot's busy share, for gpu_util)
        self.latency: LatencyWatch | None = None  # (watch: the fleet's latency histograms, for ttft_pQ, e2e_pQ, itl_pQ)
        self.delay = to_ticks(spec.metrics_delay_s)
        # (with a delay: each slot's requests in flight at any earlier instant; FleetRouting feeds it)
        self.history = InFlightHistory(n) if self.delay else None
        self.engines: list = []
        self.router = None
        self.renew: set[int] = set()  # slots started anew whose engine still held blocks then (P/D pulls)
        self.num_renewed = 0
        # the GPU nodes under the slots (simkv/replay/autoscale_nodes.py), and the slots' keys there
        self.nodes = NodePool(spec) if spec.node_gpus else None
        self.pool = "fleet"
        self.failures: list[tuple[int, int]] = []  # (tick, slot) of the failures still to come (schedule_failures)
        # each slot's node failures so far: (the first tick a request sent to it escapes, the tick
        # those sent before are lost)
        self.node_failed: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self.not_before = [0] * n  # (an evicted pod's end: its slot's replacement is ready after it)
        self.restart = 0
        self.on_ready_moved = None  # (FleetRouting.hold_until: the requests waiting for a slot follow its ready instant)
        # a scale-down's end (--shutdown-timeout): ticks from the drain to the pod's end (None: none),
        # each slot's end while it drains, and the attempts it lost (of them, those not retried)
        self.kill_after = None if spec.kill_after_s is None else to_ticks(spec.kill_after_s)
        self.kill_at: list[int | None] = [None] * n
        self.shutdown_lost = self.shutdown_failed = 0
        self.slot_gpus: list[tuple[int, str]] = []  # (GPUs, their kind) of each slot

    @property
    def eager(self) -> bool:
        """It decides at its own instants (FleetRouting._next_decision): a scale-down ends its
        replica at a deadline, or replicas and nodes fail (the requests held for a slot follow
        its restarts as they happen)."""
        return self.kill_after is not None or bool(self.failures) or (
            self.nodes is not None and bool(self.nodes.mtbf_s))

    def next_event(self) -> int:
        """The tick of its next decision, failure or node failure (or notice)."""
        return self._next_due()[0]

    def _next_due(self) -> tuple[int, int, int]:
        """(tick, kind, node) of what is due next, in time order, at one instant a replica's failure
        (kind 0) before a node's failure or notice (1, `node` its index) before a decision (2)."""
        events = [(self.next_eval, 2, -1)]
        if self.failures:
            events.append((self.failures[0][0], 0, -1))
        upcoming = self.nodes.next_failure() if self.nodes is not None and self.nodes.mtbf_s else None
        if upcoming is not None:
            events.append((upcoming[0], 1, upcoming[1]))
        return min(events)

    def schedule_failures(self, plan) -> None:
        """The slots' own failures to come (simkv/replay/failures.py's FailurePlan): each pod up or
        starting then restarts in place, `plan.restart` ticks later (_fail)."""
        self.failures = [(start, r) for start, _, r in plan.windows]
        self.restart = plan.restart

    def share_nodes(self, nodes: "NodePool", pool: str) -> None:
        """Place this autoscaler's slots on `nodes`, shared with another pool's (P/D), as `pool`'s."""
        self.nodes, self.pool = nodes, pool

    def watch(self, engines, router=None, held: dict[int, int] | None = None) -> None:
        """The replicas' engines (whose step logs the engine-gauge metrics read, whose requests
        the latency metrics observe, and whose caches a slot started anew empties), their router
        (which forgets what such a slot cached), and the rows held for a slot to be ready (scale
        to zero: FleetRouting.hold)."""
        self.engines, self.router = engines, router
        if self.nodes is not None:  # (the MIN slots on the nodes up from the start)
            self.slot_gpus = [(engine.config.hardware.num_gpus, engine.config.hardware.gpu) for engine in engines]
            for r, (gpus, kind) in enumerate(self.slot_gpus):
                self.nodes.check((self.pool, r), gpus, kind)
            for r in range(self.spec.min_replicas):
                self.nodes.place((self.pool, r), *self.slot_gpus[r], 0, initial=True)
        if any(name in GAUGES for name, _ in self.spec.targets):
            self.gauges = [(engine.steps.gauges_before, engine.scheduler.kv_cache_manager.block_pool.num_usable_blocks)
                           for engine in engines]
        if any(name == "gpu_util" for name, _ in self.spec.targets):
            if any(engine.scheduler.pipeline_gaps is not None for engine in engines):
                raise ValueError("--autoscale-metric gpu_util is not modelled with pipeline parallelism (each "
                                 "stage's GPUs are busy in turn)")
            self.busy = [BusyWindow(engine.steps) for engine in engines]
        if self.spec.latency_targets:
            kinds = {latency_metric(name)[0] for name, _ in self.spec.latency_targets}
            self.latency = LatencyWatch(kinds, self.spec.latency_window_s, held, engines, self.spec.bounds)
            for engine in engines:
                engine.latency_watch = self.latency

    def readings(self, r: int, tick: int) -> dict[str, float]:
        """Slot `r`'s engine gauges as its engine last reported them before `tick`."""
        gauges_before, usable = self.gauges[r]
        running, waiting, used = gauges_before(tick)
        return {"running": running, "waiting": waiting, "kv_usage": used / max(usable, 1)}

    def up(self, tick: int) -> tuple[int, ...]:
        """The slots that take requests at `tick`: ready by then and not draining."""
        return tuple(r for r, at in enumerate(self.ready_at)
                     if at is not None and at <= tick and self.draining_since[r] is None)

    def hold_slots(self, tick: int, arrival: int, loads: list[int]) -> tuple[tuple[int, ...], int]:
        """No slot is up at `tick`: the slots that will be ready first, and when; a request that
        arrived at `arrival` waits for them. If none is starting, the lowest slot that is down
        (or drained and done) starts now (activation); with none, the lowest still draining
        keeps its place, warm, and takes it now, unless its pod is ending (--shutdown-timeout, a
        node's notice): if every one is, the slot whose pod ends first starts a new pod after
        that end. `loads`: each slot's requests in flight."""
        self._release_done(loads)
        starting = {r: at for r, at in enumerate(self.ready_at)
                    if at is not None and at > tick and self.draining_since[r] is None}
        if not starting:
            idle = [r for r, at in enumerate(self.ready_at) if at is None or loads[r] == 0]
            draining = [r for r, since in enumerate(self.draining_since) if since is not None]
            warm = [r for r in draining if not self._ending(r, loads[r], tick)]
            if idle or warm:
                r = (idle or warm)[0]
                self._start(r, tick, loads[r])
            else:  # (every pod is ending: a new one in the slot whose old one ends first, after it)
                r = min(draining, key=lambda q: (self._end_of(q, tick), q))
                end = self._end_of(r, tick)
                self.not_before[r] = max(self.not_before[r], end + 1)
                self._start(r, tick, 0, old_end=end)
            self.events.append({"time_s": tick / TICKS_PER_SECOND, "action": "activate", "replicas": 1,
                                "in_flight": 0, "values": {}})
            self._mark(tick)
            if self.ready_at[r] <= tick:  # (warm: no wait)
                return (r,), tick
            starting = {r: self.ready_at[r]}
        first = min(starting.values())
        self.held += 1
        self.held_ticks += first - arrival
        return tuple(r for r, at in starting.items() if at == first), first

    def advance(self, tick: int, loads_at) -> None:
        """Make every decision due at or before `tick`; `loads_at(t)`: each slot's requests in
        flight at t (the finishes strictly before t)."""
        while True:
            at, kind, node = self._next_due()
            if at > tick:
                break
            if kind == 0:
                self._fail(*self.failures.pop(0))
            elif kind == 1 and self.nodes.due_notice(node):
                self._node_notice(at, node)
            elif kind == 1:
                self._node_fails(at, node)
            else:
                self._evaluate(self.next_eval, loads_at(self.next_eval))
                self.next_eval += self.interval
        for r in [r for r in self.renew if self.ready_at[r] is not None and self.ready_at[r] <= tick]:
            if self.engines[r].start_anew():  # (started anew while its engine held blocks: ready now)
                self.renew.discard(r)
                self.num_renewed += 1

    def _node_fails(self, tick: int, i: int) -> None:
        """Node `i` fails at `tick` (simkv/replay/autoscale_nodes.py): its replicas' requests are
        lost (their feeds'), a draining one ends, the others start again as new pods, placed anew."""
        for pool, r in self.nodes.fail(i, tick):
            self.node_failed[r].append((tick + 1, tick))
            if self.draining_since[r] is not None:  # (gone with its node: paid until now)
                self.paid[r][-1] = (self.paid[r][-1][0], tick)
                self.ready_at[r] = self.draining_since[r] = None
            else:
                self._replace(pool, r, tick)
            self.events.append({"time_s": tick / TICKS_PER_SECOND, "action": "node_failure", "replica": r})
        self._mark(tick)

    def _node_notice(self, tick: int, i: int) -> None:
        """Node `i` is warned at `tick` of its failure (simkv/replay/autoscale_nodes.py): its
        replicas are evicted. Each ends when the node loses them (its feed loses what it still
        runs then); one that was draining just does, the others are replaced at once by a new
        pod placed elsewhere, ready after its cold start and not before the old one's end."""
        loses = self.nodes.nodes[i].loses_at
        for pool, r in self.nodes.cordon(i, tick):
            self.node_failed[r].append((tick, loses))  # (sent from now: to its replacement)
            self.not_before[r] = max(self.not_before[r], loses + 1)
            if self.draining_since[r] is None:
                self._replace(pool, r, tick)
            self.events.append({"time_s": tick / TICKS_PER_SECOND, "action": "node_notice", "replica": r,
                                "ends_s": loses / TICKS_PER_SECOND})
        self._mark(tick)

    def _replace(self, pool: str, r: int, tick: int) -> None:
        """Slot `r`'s pod, up or starting, gone with its node at `tick`: a new pod placed anew,
        ready after its cold start (and not before an evicted pod's end)."""
        placed = self.nodes.place((pool, r), *self.slot_gpus[r], tick)
        self._ready_at(r, max(placed + self.cold_start, self.not_before[r]))
        self._renew(r)

    def node_failure_after(self, r: int, tick: int) -> int | None:
        """The first failure, at or after `tick`, of a node under slot `r` (None: none known)."""
        past = next((lost for since, lost in self.node_failed[r] if tick < since), None)
        if past is not None or self.nodes is None:
            return past
        ahead = self.nodes.failure_of((self.pool, r))
        return ahead if ahead is not None and ahead >= tick else None

    def _fail(self, tick: int, r: int) -> None:
        """Slot `r`'s pod fails at `tick` (simkv/replay/failures.py; its requests are lost by its
        feed): a pod up or starting restarts in place, ready `restart` later, as a new pod; a
        drained one just ends; a slot that is down has nothing to lose."""
        if self.ready_at[r] is None or self.draining_since[r] is not None:
            return
        self._ready_at(r, max(self.ready_at[r], tick + self.restart))
        self._renew(r)
        self.events.append({"time_s": tick / TICKS_PER_SECOND, "action": "failure", "replica": r})
        self._mark(tick)

    def _evaluate(self, tick: int, loads: list[int]) -> None:
        spec = self.spec
        self._release_done(loads)
        live = [r for r, at in enumerate(self.ready_at) if at is not None and self.draining_since[r] is None]
        seen = max(0, tick - self.delay)  # (the instant its metrics describe)
        now = loads  # (what each slot has in flight now, whatever the metrics read)
        if self.history is not None:
            loads = self.history.loads_before(seen)
        in_flight = sum(loads[r] for r in live)
        values = {"in_flight": in_flight}
        if self.gauges is not None:  # (a replica still starting has reported nothing: 0)
            gauges = [self.readings(r, seen) for r in live if self.ready_at[r] <= seen]
            values |= {name: sum(g[name] for g in gauges) for name in GAUGES}
        if self.busy is not None:  # (DCGM's utilisation over its last sample period)
            values["gpu_util"] = sum(self.busy[r].share(seen) for r in live if self.ready_at[r] <= seen)
        for name, _ in spec.latency_targets:  # (None: no observation in the window)
            values[name] = self.latency.quantile(*latency_metric(name), seen)
        values = {name: values[name] for name, _ in spec.targets}
        have = len(live)
        average = spec.latency_target_type == "AverageValue"  # (a latency read as a sum, as KEDA's default)
        wishes = [self._recommend(values[name], target, have, per_replica=name in METRICS or average)
                  for name, target in spec.targets if values[name] is not None]
        wanted = max(wishes) if wishes else min(spec.max_replicas, max(spec.min_replicas, have))
        self._record(tick, have, wanted, values)
        self.wishes.append((tick, wanted))
        while self.wishes and self.wishes[0][0] < tick - max(self.window, self.up_window):
            self.wishes.pop(0)
        # (HPA's stabilisation: up to the least wish within the scale-up window, down to the most
        # within the scale-down window)
        wanted = min(w for t, w in self.wishes if t >= tick - self.up_window)
        keep = max(w for t, w in self.wishes if t >= tick - self.window)
        if wanted > have:  # (HPA's scaling policies: how many it may add, or remove, now)
            wanted = min(wanted, self._limit(tick, have, up=True))
        elif keep < have:
            keep = max(keep, self._limit(tick, have, up=False))
        if wanted > have:
            for r in [r for r in range(spec.max_replicas) if r not in live and not self._ending(r, now[r], tick)
                      ][:wanted - have]:
                self._start(r, tick, now[r])
            self.events.append({"time_s": tick / TICKS_PER_SECOND, "action": "up", "replicas": wanted,
                                "in_flight": in_flight, "values": values})
        elif keep < have:
            starting = [r for r in live if self.ready_at[r] > tick]
            ready = [r for r in live if self.ready_at[r] <= tick]
            for r in (sorted(starting, reverse=True) + sorted(ready, reverse=True))[:have - keep]:
                if self.ready_at[r] > tick:  # (called off: down at once, paid until now)
                    self.ready_at[r] = None
                    self.paid[r][-1] = (self.paid[r][-1][0], tick)
                    self._release(r, tick)
                else:
                    self.draining_since[r] = tick
                    if self.kill_after is not None:
                        self._shut_down(r, tick + self.kill_after)
                self.changes.append((tick, -1))
            self.events.append({"time_s": tick / TICKS_PER_SECOND, "action": "down", "replicas": keep,
                                "in_flight": in_flight, "values": values})
        self._mark(tick)

    def _record(self, tick: int, have: int, wanted: int, values: dict) -> None:
        decisions = self.decisions
        decisions["time_s"].append(tick / TICKS_PER_SECOND)
        decisions["replicas"].append(have)
        decisions["wanted"].append(wanted)
        for name, value in values.items():
            decisions[name].append(value)

    def _recommend(self, value: float, target: float, have: int, per_replica: bool = True) -> int:
        """The replicas `value` asks for, within [MIN, MAX]. A metric summed over the replicas
        (`per_replica`: an AverageValue target): ceil(value / target); a latency (a Value target):
        ceil(have * value / target). Either: `have` when the ratio to what `have` replicas aim at
        is within the tolerance."""
        spec = self.spec
        ratio = value / target
        if have > 0 and abs((ratio / have if per_replica else ratio) - 1.0) <= spec.tolerance:
            wanted = have
        else:  # (1.2 / 0.6 is 2, not 2.0000000000000004)
            wanted = math.ceil((ratio if per_replica else have * ratio) - 1e-9)
        return min(spec.max_replicas, max(spec.min_replicas, wanted))

    def _limit(self, tick: int, have: int, up: bool) -> int:
        """The most replicas (`up`) or the fewest the scaling policies let `have` go to at `tick`
        (simkv/replay/autoscale_policy.py), from the changes within each policy's period."""
        while self.changes and self.changes[0][0] <= tick - self.policy_period:
            self.changes.pop(0)

        def changes_within(period_s: float) -> tuple[int, int]:
            since = tick - to_ticks(period_s)
            recent = [delta for t, delta in self.changes if t > since]
            return sum(1 for d in recent if d > 0), sum(1 for d in recent if d < 0)

        return (self.spec.up_rules if up else self.spec.down_rules).limit(have, changes_within, up)

    def _ready_at(self, r: int, ready: int) -> None:
        """Slot `r`'s new pod is ready at `ready`: so are the requests held for it."""
        self.ready_at[r] = ready
        if self.on_ready_moved is not None:
            self.on_ready_moved(r, ready)

    def _shut_down(self, r: int, at: int) -> None:
        """Slot `r`, draining, ends at tick `at` whatever it still has in flight: its feed loses
        those attempts then (their clients retry them through the router, or they fail)."""
        self.kill_at[r] = at
        self.engines[r].feed.shutdown(at)

    def _ending(self, r: int, in_flight: int, tick: int) -> bool:
        """Slot `r`, draining, got its SIGTERM (a scale-down's end, or its node's notice) and still
        has requests in flight at `tick` (`in_flight`, those lost at its end included until then):
        that pod cannot take requests again, nor can the slot start a new one yet."""
        ends = self.kill_at[r] is not None or self.not_before[r] > tick
        return ends and self.draining_since[r] is not None and in_flight > 0

    def note_shutdown_abort(self, for_good: bool) -> None:
        """An attempt lost at a scale-down's end (for good: its client does not retry it)."""
        self.shutdown_lost += 1
        self.shutdown_failed += for_good

    def _start(self, r: int, tick: int, in_flight: int, old_end: int = 0) -> None:
        """Start slot `r` at `tick`: a draining pod with `in_flight` requests takes requests again
        (warm); else a new pod, the old one paid until its last request (or `old_end`, when it
        ends later), its cold start from then."""
        self.changes.append((tick, +1))  # (a replica more, for HPA's scaling policies, warm or not)
        drained = self.draining_since[r]
        self.draining_since[r] = None
        if self.kill_at[r] is not None:  # (that pod ended: this one is new)
            self.kill_at[r] = None
            if self.engines:
                self.engines[r].feed.reopen()
        if drained is not None and in_flight > 0:  # (still up, finishing its requests: warm)
            return
        if drained is not None:  # (its last request finished before now: paid until then; a new pod)
            self.paid[r][-1] = (self.paid[r][-1][0], max(drained, self.last_finish[r], old_end))
            self._release(r, self.paid[r][-1][1])
            self._renew(r)
        ready = tick if self.nodes is None else self.nodes.place((self.pool, r), *self.slot_gpus[r], tick)
        self.ready_at[r] = max(max(ready, old_end) + self.cold_start, self.not_before[r])  # (its GPUs once freed)
        self.paid[r].append((tick, None))

    def _end_of(self, r: int, tick: int) -> int:
        """When slot `r`'s pod, ending at `tick` (_ending), ends: its scale-down's deadline, or
        its node's loss."""
        lost = self.not_before[r] - 1 if self.not_before[r] > tick else None
        return min(t for t in (self.kill_at[r], lost) if t is not None)

    def _release(self, r: int, tick: int) -> None:
        """Slot `r`'s pod stopped at `tick`: its GPUs on its node are free from then."""
        if self.nodes is not None and self.nodes.holds((self.pool, r)):
            self.nodes.release((self.pool, r), tick)

    def _release_done(self, loads: list[int]) -> None:
        """The drained slots whose last request is done (`loads`: each slot's requests in flight
        now) free their nodes' GPUs from their last finish, before any placement now."""
        if self.nodes is None:
            return
        for r, drained in enumerate(self.draining_since):
            if drained is not None and loads[r] == 0:
                self._release(r, max(drained, self.last_finish[r]))

    def _renew(self, r: int) -> None:
        """Slot `r` starts as a new pod: its engine's caches empty
        (ReplayEngine.start_anew), and its router's record of what it cached. An engine still
        holding blocks or transfers (a P/D prefill replica whose last prompt's KV is being
        pulled, a store to the CPU tier) is emptied once ready, before its first request."""
        if self.router is not None:
            self.router.forget(r)
        if not self.engines:
            return
        if self.engines[r].start_anew():
            self.num_renewed += 1
        else:
            self.renew.add(r)

    def _mark(self, tick: int) -> None:
        """The timeline up to `tick`: each slot that became ready since, at its own instant."""
        last = self.timeline[-1][0]
        for at in sorted({at for at in self.ready_at if at is not None and last < at < tick}):
            self._mark_at(at)
        self._mark_at(tick)

    def _mark_at(self, tick: int) -> None:
        ready = len(self.up(tick))
        starting = sum(1 for r, at in enumerate(self.ready_at) if at is not None and at > tick)
        if (ready, starting) != self.timeline[-1][1:]:
            self.timeline.append((tick, ready, starting))

    def settle(self, end: int, loads_at) -> None:
        """After the replay (its last step ends at `end`): the decisions up to then, and the
        paid time of each slot still up closed then, of a drained one at its last finish."""
        self.advance(end, loads_at)
        self._mark(end)
        loads_at(end + 1)  # (every finish seen)
        for r, spans in enumerate(self.paid):
            if spans and spans[-1][1] is None:
                drained = self.draining_since[r]
                stop = max(drained, self.last_finish[r]) if drained is not None else end
                spans[-1] = (spans[-1][0], min(max(stop, spans[-1][0]), end))
                if drained is not None:
                    self._release(r, spans[-1][1])

    def summary(self, end: int, gpus_per_slot: list[int], gpu_of_slot: list[str]) -> dict:
        spec = self.spec
        seconds = [sum(e - s for s, e in spans) / TICKS_PER_SECOND for spans in self.paid]
        by_gpu: dict[str, float] = {}
        for sec, gpus, gpu in zip(seconds, gpus_per_slot, gpu_of_slot):
            by_gpu[gpu] = by_gpu.get(gpu, 0.0) + sec * gpus / 3600.0
        duration = end / TICKS_PER_SECOND
        ready_seconds = 0.0
        for (t, ready, _), nxt in zip(self.timeline, self.timeline[1:] + [(end, 0, 0)]):
            ready_seconds += ready * max(0, min(nxt[0], end) - t) / TICKS_PER_SECOND
        return spec.to_dict() | {
            "scale_ups": sum(1 for e in self.events if e["action"] in ("up", "activate")),
            "scale_downs": sum(1 for e in self.events if e["action"] == "down"),
            "peak_ready": max(ready for _, ready, _ in self.timeline),
            "mean_ready": ready_seconds / duration if duration > 0 else float(spec.min_replicas),
            "replica_seconds": sum(seconds),
            "paid_s_by_replica": seconds,
            "gpu_hours": sum(s * g for s, g in zip(seconds, gpus_per_slot)) / 3600.0,
            "gpu_hours_by_gpu": by_gpu,
            "fixed_fleet_gpu_hours": duration * sum(gpus_per_slot) / 3600.0,
            **({"shutdown_requests_lost": self.shutdown_lost, "shutdown_requests_failed": self.shutdown_failed}
               if self.kill_after is not None else {}),
            "new_pods": self.num_renewed,  # (slots started again after a drain: their prefix caches emptied)
            "held_requests": self.held,
            "mean_hold_s": self.held_ticks / self.held / TICKS_PER_SECOND if self.held else 0.0,
            "events": self.events,
            "decisions": self.decisions,
            "timeline": [{"time_s": t / TICKS_PER_SECOND, "ready": ready, "starting": starting}
                         for t, ready, starting in self.timeline]}


class InFlightHistory:
    """Each slot's requests in flight at any instant so far (a metric read with a delay): the
    ticks it was sent requests and the ticks they finished (or were aborted) at, in order; read at
    instants that never decrease."""

    def __init__(self, n: int) -> None:
        self.sent: list[list[int]] = [[] for _ in range(n)]
        self.done: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self.read = [[0, 0, 0] for _ in range(n)]  # sent read (so counted), done read, and done counted

    def routed(self, r: int, tick: int) -> None:
        self.sent[r].append(tick)

    def finished(self, r: int, tick: int, count: int) -> None:
        self.done[r].append((tick, count))

    def loads_before(self, tick: int) -> list[int]:
        """Each slot's requests sent strictly before `tick`, less those finished strictly before."""
        out = []
        for sent, done, read in zip(self.sent, self.done, self.read):
            while read[0] < len(sent) and sent[read[0]] < tick:
                read[0] += 1
            while read[1] < len(done) and done[read[1]][0] < tick:
                read[2] += done[read[1]][1]
                read[1] += 1
            out.append(read[0] - read[2])
        return out


def autoscaling_section(autoscaler: Autoscaler, duration_s: float, loads_at, configs, replica_rows: list[dict],
                        nodes: bool = True) -> dict:
    """After the replay (`duration_s`: its end): the autoscaler's summary section, each
    replica's paid seconds written into its row of the summary's replica table (`paid_s`).
    `configs`: each slot's engine config (its GPUs, and which). With nodes under the replicas
    (and `nodes`: not shared with another pool's), their section, and the GPU-hours they paid
    as the section's `gpu_hours` (the replicas' own as `replica_gpu_hours`)."""
    from simkv.studies.serving_cost import engine_gpus

    end = to_ticks(duration_s)
    autoscaler.settle(end, loads_at)
    section = autoscaler.summary(end, [engine_gpus(c) for c in configs], [c.hardware.gpu for c in configs])
    for row, paid in zip(replica_rows, section["paid_s_by_replica"]):
        row["paid_s"] = paid  # (each replica's time up or starting, paid for)
    if autoscaler.nodes is not None and nodes:  # (what is paid is the nodes: the replicas' GPU-hours beside)
        section["nodes"] = autoscaler.nodes.section(end)
        section["replica_gpu_hours"] = section["gpu_hours"]
        section["gpu_hours"] = section["nodes"]["gpu_hours"]
        section["gpu_hours_by_gpu"] = section["nodes"]["gpu_hours_by_gpu"]
    return section


def section_targets(section: dict) -> tuple[tuple[str, float], ...]:
    """(metric, target) of each metric of an autoscaler's to_dict or summary section."""
    return AutoscaleSpec(1, 2, target=section["target"], metric=section.get("metric", "in_flight")).targets


def aims(section: dict) -> str:
    """What an autoscaler (its to_dict or summary section) aims at, e.g. '5 waiting or 30%
    KV-cache usage each', or 'p95 time to first token 2 s'."""
    targets = section_targets(section)
    each = [f"{target:.0%} {METRICS[name][1]}" if name in SHARES else f"{target:g} {METRICS[name][1]}"
            for name, target in targets if name in METRICS]
    latencies = []
    summed = " each (AverageValue)" if section.get("latency_target_type") == "AverageValue" else ""
    for name, target in targets:
        if name not in METRICS:
            histogram, q = latency_metric(name)
            latencies.append(f"p{q * 100:g} {HISTOGRAMS[histogram]} {target:g} s{summed}")
    return " or ".join(([" or ".join(each) + " each"] if each else []) + latencies)


def describe(section: dict) -> str:
    """One line for the terminal and report.html."""
    paid = (f"{section['replica_gpu_hours']:.3f} GPU-h held by replicas, {section['gpu_hours']:.3f} paid for nodes"
            if "replica_gpu_hours" in section else f"{section['gpu_hours']:.3f} GPU-h paid")
    return (f"{section['min_replicas']}-{section['max_replicas']} replicas ({aims(section)}, "
            f"cold start {section['cold_start_s']:g} s): {section['scale_ups']} up / {section['scale_downs']} down, "
            f"{section['mean_ready']:.2f} up on average (peak {section['peak_ready']}); "
            f"{paid}, {section['fixed_fleet_gpu_hours']:.3f} for {section['max_replicas']} always up{_ends(section)}")


def _ends(section: dict) -> str:
    """What scale-downs' ends lost (--shutdown-timeout), as a clause of `describe`."""
    if "shutdown_requests_lost" not in section:
        return ""
    drain = min(section["prestop_s"] + section["shutdown_timeout_s"], section["termination_grace_s"])
    return (f"; each scale-down ends its replica {drain:g} s on (--shutdown-timeout "
            f"{section['shutdown_timeout_s']:g}), {section['shutdown_requests_lost']:,} requests lost so "
            f"({section['shutdown_requests_failed']:,} for good)")
