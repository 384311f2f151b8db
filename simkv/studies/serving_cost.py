"""What a setup costs to run at the highest rate it sustains within the SLOs (`simkv goodput
--gpu-price GPU=USD`).

Prices are the user's (per GPU-hour: cloud list prices, reserved rates, or an amortised purchase
price; simkv ships none, they differ too much). A setup's GPUs are its engines' GPUs: tensor
parallel x data parallel per engine (decode context parallelism runs on the TP GPUs), times the
replicas of a fleet, or summed over a P/D setup's two pools with their own options, or over a
fleet's replicas where replica sets give some of them other engines; a setup of several GPU
kinds is priced kind by kind. At the
highest rate R (req/s) that met the SLOs, with the trace's mean output length L:

    USD per hour                = GPUs x price
    USD per 1,000 requests      = USD per hour / (3600 R) x 1,000
    USD per 1M output tokens    = USD per hour / (3600 R L) x 1,000,000
"""
from __future__ import annotations

from dataclasses import dataclass


class PriceError(ValueError):
    """A --gpu-price that cannot be read, or a setup whose GPU has no price."""


def parse_prices(items: tuple[str, ...] | list[str]) -> dict[str, float]:
    """``["H100-SXM=2.49", ...]`` -> {gpu: USD per GPU-hour}; GPU names from the catalogue, or the
    paths of GPU files as --gpu takes them."""
    from simkv.specs import get_gpu_spec, gpu_names
    from simkv.specs.gpu_file import is_gpu_file

    known = gpu_names()
    prices: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise PriceError(f"--gpu-price {item!r}: expected GPU=USD_PER_GPU_HOUR, e.g. H100-SXM=2.49")
        if is_gpu_file(name):
            try:
                get_gpu_spec(name)
            except ValueError as exc:
                raise PriceError(f"--gpu-price {item!r}: {exc}") from None
        elif name not in known:
            raise PriceError(f"--gpu-price {item!r}: unknown GPU '{name}' (known: {', '.join(known)}, or a GPU "
                             "file's path)")
        try:
            price = float(value)
        except ValueError:
            raise PriceError(f"--gpu-price {item!r}: '{value}' is not a number of USD per GPU-hour") from None
        if not price > 0:
            raise PriceError(f"--gpu-price {item!r}: the price must be > 0")
        if name in prices:
            raise PriceError(f"--gpu-price: {name} is priced twice")
        prices[name] = price
    return prices


def engine_gpus(config) -> int:
    return config.hardware.num_gpus


@dataclass(frozen=True)
class SetupGPUs:
    """A setup's GPUs: `count` of `gpu`; a setup of several kinds (a fleet with replica sets, P/D
    pools on different GPUs) has `mixed`, (gpu, count) per kind, `gpu` their names joined by '+'
    and `count` their sum."""

    gpu: str
    count: int
    mixed: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, config, fleet=None, disaggregation=None) -> "SetupGPUs":
        """The GPUs of one engine, a fleet of it (each replica's own config where replica sets
        differ), or a P/D setup (each pool's own config)."""
        if disaggregation is not None:
            prefill, decode = disaggregation.pool_configs(config)
            return cls.summed([(prefill, disaggregation.num_prefill), (decode, disaggregation.num_decode)])
        configs = fleet.replica_configs(config) if fleet is not None else None
        if configs is not None:
            return cls.summed([(replica, 1) for replica in configs])
        replicas = fleet.num_replicas if fleet is not None else 1
        return cls(config.hardware.gpu, replicas * engine_gpus(config))

    @classmethod
    def summed(cls, engines: list) -> "SetupGPUs":
        """The GPUs of (engine config, how many) pairs, kinds in the order first seen."""
        counts: dict[str, int] = {}
        for config, n in engines:
            counts[config.hardware.gpu] = counts.get(config.hardware.gpu, 0) + n * engine_gpus(config)
        if len(counts) == 1:
            (gpu, count), = counts.items()
            return cls(gpu, count)
        return cls("+".join(counts), sum(counts.values()), tuple(counts.items()))

    def kinds(self) -> tuple[tuple[str, int], ...]:
        return self.mixed or ((self.gpu, self.count),)

    def unpriced(self, prices: dict[str, float]) -> list[str]:
        """The setup's GPUs that `prices` lacks."""
        return [gpu for gpu, _ in self.kinds() if gpu not in prices]


def serving_cost(gpus: SetupGPUs, prices: dict[str, float], max_rate_req_s: float | None,
                 mean_output_tokens: float) -> dict | None:
    """The cost record of a setup (None when one of its GPUs has no price)."""
    if gpus.unpriced(prices):
        return None
    per_hour = sum(count * prices[gpu] for gpu, count in gpus.kinds())
    out = {"gpu": gpus.gpu, "gpus": gpus.count, "usd_per_gpu_hour": None if gpus.mixed else prices[gpus.gpu],
           "usd_per_hour": per_hour, "usd_per_1k_requests": None, "usd_per_1m_output_tokens": None}
    if gpus.mixed:
        out["kinds"] = [{"gpu": gpu, "gpus": count, "usd_per_gpu_hour": prices[gpu]} for gpu, count in gpus.mixed]
    if max_rate_req_s:
        out["usd_per_1k_requests"] = per_hour / (3600.0 * max_rate_req_s) * 1e3
        out["usd_per_1m_output_tokens"] = per_hour / (3600.0 * max_rate_req_s * mean_output_tokens) * 1e6
    return out


def paid_cost(gpu_hours_by_gpu: dict[str, float], duration_s: float, prices: dict[str, float],
              max_rate_req_s: float, mean_output_tokens: float) -> dict | None:
    """The cost record of an autoscaled fleet at its highest rate within the SLOs: the GPU-hours it
    paid for over that replay, priced per kind, as a mean spend per hour (None when a kind has
    no price)."""
    if any(gpu not in prices for gpu in gpu_hours_by_gpu) or not duration_s > 0:
        return None
    spent, kinds = _spent(gpu_hours_by_gpu, prices)
    per_hour = spent / (duration_s / 3600.0)
    return {"gpu": "+".join(gpu_hours_by_gpu), "gpu_hours_paid": sum(gpu_hours_by_gpu.values()),
            "replay_hours": duration_s / 3600.0, "usd_spent": spent, "usd_per_hour": per_hour, "kinds": kinds,
            "usd_per_1k_requests": per_hour / (3600.0 * max_rate_req_s) * 1e3,
            "usd_per_1m_output_tokens": per_hour / (3600.0 * max_rate_req_s * mean_output_tokens) * 1e6}


def _spent(gpu_hours_by_gpu: dict[str, float], prices: dict[str, float]) -> tuple[float, list[dict]]:
    """GPU-hours priced (every kind has a price): the USD spent, and each kind's record."""
    kinds = [{"gpu": gpu, "gpu_hours": hours, "usd_per_gpu_hour": prices[gpu]}
             for gpu, hours in gpu_hours_by_gpu.items()]
    return sum(k["gpu_hours"] * k["usd_per_gpu_hour"] for k in kinds), kinds


def gpus_text(cost: dict) -> str:
    """'4 x H200', or '2 x H100-SXM + 2 x H200' for a setup of several kinds."""
    return " + ".join(f"{k['gpus']} x {k['gpu']}" for k in cost.get("kinds") or [cost])


def describe(cost: dict) -> str:
    """One line for goodput.md."""
    if "gpu_hours_paid" in cost:  # (an autoscaled fleet: paid_cost's)
        kinds = " + ".join(f"{k['gpu_hours']:.3f} {k['gpu']} GPU-h at ${k['usd_per_gpu_hour']:g}/h" for k in cost["kinds"])
        return (f"autoscaled, {kinds} over the {cost['replay_hours']:.3f} h replay at the highest rate within the "
                f"SLOs = ${cost['usd_spent']:,.2f}, ${cost['usd_per_hour']:,.2f}/h on average: "
                f"${cost['usd_per_1k_requests']:,.4f} per 1,000 requests, ${cost['usd_per_1m_output_tokens']:,.3f} "
                "per 1M output tokens")
    kinds = cost.get("kinds") or [cost]
    text = " + ".join(f"{k['gpus']} x {k['gpu']} at ${k['usd_per_gpu_hour']:g}/h" for k in kinds)
    text += f" = ${cost['usd_per_hour']:,.2f}/h"
    if cost["usd_per_1m_output_tokens"] is not None:
        text += (f"; at the highest rate within the SLOs: ${cost['usd_per_1k_requests']:,.4f} per 1,000 requests, "
                 f"${cost['usd_per_1m_output_tokens']:,.3f} per 1M output tokens")
    return text


def replay_gpu_hours(summary: dict, config, fleet=None, disaggregation=None, encode=None) -> dict[str, float]:
    """The GPU-hours a replay's setup paid, per GPU kind: an autoscaled fleet's or P/D pools'
    (their replicas', or their nodes'), else every GPU of the setup from the start to the end;
    and an encode pool's (`encode`, an EncodeSpec: its replicas up from the start to the end)."""
    hours = summary["duration_s"] / 3600.0
    scaled = (summary.get("fleet") or {}).get("autoscaling") or (summary.get("disaggregation") or {}).get("autoscaling")
    paid = dict(scaled["gpu_hours_by_gpu"]) if scaled else {
        gpu: count * hours for gpu, count in SetupGPUs.of(config, fleet, disaggregation).kinds()}
    if encode is not None:
        encoder = encode.encode_config(config)
        gpu = encoder.hardware.gpu
        paid[gpu] = paid.get(gpu, 0.0) + encode.num_encode * engine_gpus(encoder) * hours
    return paid


def replay_cost(summary: dict, gpu_hours_by_gpu: dict[str, float], prices: dict[str, float]) -> dict:
    """What a replay's traffic cost on its setup (`simkv replay --gpu-price`): the GPU-hours paid,
    priced per kind, over the work done: the finished requests, their output tokens, and with
    SLOs the requests that met them. PriceError names a GPU without a price."""
    missing = [gpu for gpu in gpu_hours_by_gpu if gpu not in prices]
    if missing:
        raise PriceError(f"--gpu-price: no price for {', '.join(missing)}, which this setup runs on (give "
                         f"{missing[0]}=USD_PER_GPU_HOUR)")
    spent, kinds = _spent(gpu_hours_by_gpu, prices)
    duration = summary["duration_s"]
    tokens = summary["output_throughput_tok_s"] * duration
    finished = summary["num_finished"]
    good = (summary.get("goodput") or {}).get("num_good")
    return {"gpu_hours": sum(gpu_hours_by_gpu.values()), "kinds": kinds, "usd_spent": spent,
            "usd_per_hour": spent / (duration / 3600.0) if duration > 0 else None,
            "usd_per_1k_requests": spent / finished * 1e3 if finished else None,
            "usd_per_1m_output_tokens": spent / tokens * 1e6 if tokens > 0 else None,
            "usd_per_1k_good_requests": spent / good * 1e3 if good else None}


def describe_replay_cost(cost: dict) -> str:
    """One line for the terminal."""
    kinds = " + ".join(f"{k['gpu_hours']:.3f} {k['gpu']} GPU-h at ${k['usd_per_gpu_hour']:g}" for k in cost["kinds"])
    parts = [f"${cost['usd_spent']:,.2f} ({kinds})"]
    for key, what, digits in (("usd_per_1m_output_tokens", "per 1M output tokens", 3),
                              ("usd_per_1k_requests", "per 1,000 requests", 4),
                              ("usd_per_1k_good_requests", "per 1,000 within the SLOs", 4)):
        if cost.get(key) is not None:
            parts.append(f"${cost[key]:,.{digits}f} {what}")
    return "; ".join(parts)
