"""`simkv replay`'s P/D disaggregation flags, the --config file's `disaggregation` mapping, and
the encode pool's flags (encoder disaggregation)."""

from __future__ import annotations

import click

from simkv.config import ConfigError

_PD_FLAGS = ("prefill_replicas", "decode_replicas", "prefill_router", "decode_router", "kv_link_gbps",
             "kv_link_latency_ms", "handoff_ms", "kv_abort_timeout_s", "prefill_autoscale", "decode_autoscale")
_FILE_KEYS = set(_PD_FLAGS) | {"prefill", "decode"}


def disaggregation_options(command):
    from simkv.replay.router import ROUTERS

    for option in reversed([
        click.option("--prefill-replicas", type=int, default=None,
                     help="P/D disaggregation: prefill engines (each runs prompts and hands their KV over) "
                          "[default: 1 when --decode-replicas is given]."),
        click.option("--decode-replicas", type=int, default=None,
                     help="P/D disaggregation: decode engines (each pulls a prompt's KV, then decodes) "
                          "[default: 1 when --prefill-replicas is given]."),
        click.option("--prefill-set", "prefill_sets", multiple=True, metavar="KEY=VALUE",
                     help="An engine option for the prefill pool only (e.g. max_num_batched_tokens=16384); repeatable."),
        click.option("--decode-set", "decode_sets", multiple=True, metavar="KEY=VALUE",
                     help="An engine option for the decode pool only (e.g. max_num_seqs=512); repeatable."),
        click.option("--prefill-router", type=click.Choice(ROUTERS), default=None,
                     help="P/D: how a prefill replica is picked [default: least_outstanding]."),
        click.option("--decode-router", type=click.Choice(ROUTERS), default=None,
                     help="P/D: how a decode replica is picked [default: least_outstanding]."),
        click.option("--kv-link-gbps", type=float, default=None,
                     help="P/D: GB/s of each GPU's link; a pull occupies both ends' links, first come first "
                          "served [default: 50]."),
        click.option("--kv-link-latency-ms", type=float, default=None,
                     help="P/D: from a pull's last byte sent to the decode side knowing it [default: 0.1]."),
        click.option("--handoff-ms", type=float, default=None,
                     help="P/D: from the prefill's answer to the decode replica getting the request [default: 1]."),
        click.option("--prefill-autoscale", default=None, metavar="MIN-MAX[:KEY=VALUE,...]",
                     help="P/D: the prefill pool scales with its load (simkv/replay/autoscale.py), e.g. "
                          "1-4:metric=waiting,target=2; KEY: metric, target, tolerance, interval_s, cold_start_s, "
                          "scale_down_window_s, scale_up_policy, ... (several metrics: metric=waiting=2;kv_usage=0.7; "
                          "or the prefill replicas' own TTFT: metric=ttft_p95=0.5); the --autoscale-*, --cold-start-s "
                          "and --scale-*-policy flags set both pools' defaults, the --node-* flags the nodes both "
                          "pools share."),
        click.option("--decode-autoscale", default=None, metavar="MIN-MAX[:KEY=VALUE,...]",
                     help="P/D: the decode pool scales with its load, as --prefill-autoscale "
                          "(e.g. 2-8:metric=kv_usage,target=0.7)."),
        click.option("--kv-abort-timeout-s", type=float, default=None,
                     help="P/D with --client-*timeout: how long a prefill replica holds the blocks of a request "
                          "the proxy dropped after its prefill (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT) "
                          "[default: 480]."),
    ]):
        command = option(command)
    return command


def check_pools(spec, config) -> None:
    """The pools' configs can be built on the command's engine options; a one-line click error naming
    the pool and the option otherwise (before any replay runs)."""
    try:
        spec.pool_configs(config)
    except (ConfigError, TypeError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None


def _file_mapping(config_file: str | None, name: str, known: set) -> dict | None:
    """The --config file's mapping `name` (keys with underscores), None if it has none; a click
    error naming the file for anything but a mapping of `known` keys."""
    from simkv.cli.replay_cmd import load_config_file

    raw = (load_config_file(config_file) if config_file else {}).get(name)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise click.BadParameter(f"{config_file}: {name} must be a mapping", param_hint="--config")
    file = {k.replace("-", "_"): v for k, v in raw.items()}
    unknown = set(file) - known
    if unknown:
        raise click.BadParameter(f"{config_file}: {name}: unknown key(s) {', '.join(sorted(unknown))}; "
                                 f"known: {', '.join(sorted(known))}", param_hint="--config")
    return file


def _set_pairs(texts, flag: str) -> list[tuple[str, object]]:
    """A pool's KEY=VALUE flags (--prefill-set, --decode-set, --encode-set) as (option, value) pairs."""
    from simkv.sweep.grid import parse_value

    pairs = []
    for text in texts:
        key, sep, value = text.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got '{text}'", param_hint=flag)
        pairs.append((key.strip().replace("-", "_"), parse_value(value)))
    return pairs


def _pool_options(pairs: list[tuple[str, object]]) -> tuple:
    return tuple(sorted(dict(pairs).items()))


def read_disaggregation(flags: dict, config_file: str | None, router_options: tuple[str, ...]):
    """The DisaggregationSpec of the flags over the --config file's `disaggregation` mapping, or None
    (no P/D flag and no such mapping); a click error naming the flag or the file otherwise. Takes
    the P/D flags out of `flags`. `router_options`: --router-option, for prefix_aware pools."""
    from simkv.replay.disaggregated import DisaggregationSpec
    from simkv.replay.router import RouterError, RouterOptions

    file = _file_mapping(config_file, "disaggregation", _FILE_KEYS)
    pd_flags = {k: flags.pop(k) for k in _PD_FLAGS}
    sets = {"prefill": flags.pop("prefill_sets"), "decode": flags.pop("decode_sets")}
    if file is None and all(v is None for v in pd_flags.values()) and not any(sets.values()):
        return None
    file = file or {}
    values = {k: (pd_flags[k] if pd_flags[k] is not None else file.get(k)) for k in _PD_FLAGS}
    scaling, defaults = {}, None
    for pool in ("prefill", "decode"):
        if values[f"{pool}_autoscale"] is not None:
            if defaults is None:  # (the common --autoscale-* settings, flags over the --config file's)
                from simkv.cli.replay_cmd import autoscale_settings

                defaults = autoscale_settings(flags, config_file)
            scaling[f"{pool}_autoscale"] = _pool_autoscale(values[f"{pool}_autoscale"], pool, defaults)
            if values[f"{pool}_replicas"] is None:  # (the pool's slots: MAX)
                values[f"{pool}_replicas"] = scaling[f"{pool}_autoscale"].max_replicas
    if router_options and "prefix_aware" not in (values["prefill_router"], values["decode_router"]):
        raise click.UsageError("--router-option sets prefix_aware's thresholds; add --prefill-router prefix_aware "
                               "or --decode-router prefix_aware")
    try:
        parsed_router_options = RouterOptions.parse(list(router_options))
    except RouterError as exc:
        raise click.BadParameter(str(exc), param_hint="--router-option") from None
    pools = {}
    for pool in ("prefill", "decode"):
        options = file.get(pool) or {}
        if not isinstance(options, dict):
            raise click.BadParameter(f"{config_file}: disaggregation.{pool} must be a mapping of engine options",
                                     param_hint="--config")
        pairs = [(k.replace("-", "_"), v) for k, v in options.items()]
        pools[pool] = _pool_options(pairs + _set_pairs(sets[pool], f"--{pool}-set"))
    link = {}
    for key in ("kv_link_gbps", "kv_link_latency_ms", "handoff_ms", "kv_abort_timeout_s"):
        if values[key] is not None:
            try:
                link[key] = float(values[key])
            except (TypeError, ValueError):
                raise click.BadParameter(f"{config_file}: disaggregation.{key} must be a number, got {values[key]!r}",
                                         param_hint="--config") from None
    try:
        return DisaggregationSpec(
            num_prefill=values["prefill_replicas"] if values["prefill_replicas"] is not None else 1,
            num_decode=values["decode_replicas"] if values["decode_replicas"] is not None else 1,
            prefill_options=pools["prefill"], decode_options=pools["decode"],
            prefill_router=values["prefill_router"] or "least_outstanding",
            decode_router=values["decode_router"] or "least_outstanding",
            router_options=parsed_router_options, **link, **scaling)
    except (ConfigError, TypeError, ValueError) as exc:
        raise click.UsageError(f"P/D disaggregation: {exc}") from None


def _pool_autoscale(text, pool: str, defaults: dict):
    """--prefill-autoscale / --decode-autoscale as an AutoscaleSpec over `defaults`, the common
    --autoscale-* settings."""
    from simkv.replay.autoscale import AutoscaleError, parse_pool

    try:
        return parse_pool(str(text), defaults, f"--{pool}-autoscale")
    except AutoscaleError as exc:
        raise click.BadParameter(str(exc), param_hint=f"--{pool}-autoscale") from None


_ENCODE_FLAGS = ("encode_replicas", "encode_router", "encode_sets", "ec_store_gbs", "encode_hop_ms")


def encode_options(command):
    from simkv.replay.router import ROUTERS

    for option in reversed([
        click.option("--encode-replicas", type=int, default=None,
                     help="Encoder disaggregation: encode instances in front of the engines (vLLM's EPD: a request "
                          "with images is encoded there first; the engines load its embeddings)."),
        click.option("--encode-router", type=click.Choice(ROUTERS), default=None,
                     help="How an encode instance is picked [default: least_outstanding]."),
        click.option("--encode-set", "encode_sets", multiple=True, metavar="KEY=VALUE",
                     help="An engine option for the encode instances only (e.g. max_num_batched_tokens=16384); "
                          "repeatable."),
        click.option("--ec-store-gbs", type=float, default=None,
                     help="GB/s the embedding store is written and read at (an assumption) [default: 10]."),
        click.option("--encode-hop-ms", type=float, default=None,
                     help="From an encode instance's answer to the engines getting the request [default: 1]."),
    ]):
        command = option(command)
    return command


_ENCODE_FILE_KEYS = {"encode_replicas", "encode_router", "encode", "ec_store_gbs", "encode_hop_ms"}


def read_encode(flags: dict, config_file: str | None = None):
    """The EncodeSpec of the encode flags over the --config file's `encode_pool` mapping (its
    keys: the flags' names, and `encode`, the pool's engine options), or None without
    encode replicas (the other encode flags then refused); takes the flags out of `flags`."""
    from simkv.replay.encode_pool import EncodeSpec

    values = {k: flags.pop(k) for k in _ENCODE_FLAGS}
    file = _file_mapping(config_file, "encode_pool", _ENCODE_FILE_KEYS)
    if file is not None:
        options = file.pop("encode", None) or {}
        if not isinstance(options, dict):
            raise click.BadParameter(f"{config_file}: encode_pool.encode must be a mapping of engine options",
                                     param_hint="--config")
        for key, value in file.items():  # (a flag given wins over the file)
            if values[key] is None:
                values[key] = value
        values["encode_sets"] = tuple(f"{k}={v}" for k, v in options.items()) + tuple(values["encode_sets"])
    if values["encode_replicas"] is None:
        given = [f"--{k.replace('_', '-').removesuffix('s') if k == 'encode_sets' else k.replace('_', '-')}"
                 for k, v in values.items() if v not in (None, ())]
        if given:
            raise click.UsageError(f"{', '.join(given)} sets the encode pool: give --encode-replicas too")
        return None
    given = {"num_encode": values["encode_replicas"],
             "encode_options": _pool_options(_set_pairs(values["encode_sets"], "--encode-set"))}
    try:
        for key, name, kind in (("encode_router", "router", str), ("ec_store_gbs", "ec_store_gbs", float),
                                ("encode_hop_ms", "hop_ms", float)):
            if values[key] is not None:
                given[name] = kind(values[key])
        return EncodeSpec(**given)
    except (ConfigError, TypeError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
