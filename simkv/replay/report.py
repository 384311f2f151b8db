"""The terminal summary table of a replay."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from simkv.replay.results import kv_cache_groups_rows
from simkv.terminal import console as terminal_console


def _fmt_dist(d: dict, scale: float = 1000.0) -> str:
    if d["mean"] is None:
        return "-"
    return f"{d['mean'] * scale:,.1f} / {d['p50'] * scale:,.1f} / {d['p99'] * scale:,.1f}"


def _beyond_range(cost: dict) -> str:
    """A calibrated cost model's steps beyond its calibrated range, as a suffix ('' if none)."""
    cover = cost.get("calibrated_range") or {}
    if not cover.get("steps_beyond"):
        return ""
    return (f" ({cover['steps_beyond']:,} steps, {100 * cover['share_of_time_beyond']:.1f} % of the time, "
            "beyond the calibrated range)")


def admission_limit_rows(limits: dict | None) -> list[tuple[str, str]]:
    """The limits that held the waiting queue back, by their share of the waiting time (those
    of 1 % or more; summary.json's `admission_limits` has them all)."""
    if not limits or not limits["waiting_request_s"]:
        return []
    shares = [f"{name} {100 * v['share']:.0f} %" for name, v in limits["by_limit"].items() if v["share"] >= 0.01]
    return [("waiting held by (time share)" if i == 0 else "", share) for i, share in enumerate(shares)]


def _expert_exchange_rows(cfg: dict, cost: dict) -> list[tuple[str, str]]:
    """How lockstep ranks exchange their tokens in the expert layers, where it is not vLLM's
    default gather, and how many steps dual batch overlap split."""
    from simkv.config import exchanges_all_to_all

    rows = []
    if exchanges_all_to_all(cfg.get("enable_expert_parallel", False), cfg.get("all2all_backend", ""),
                            cfg.get("data_parallel_size", 1) * cfg.get("prefill_context_parallel_size", 1)):
        rows.append(("expert exchange", f"all-to-all ({cfg['all2all_backend']}, expert parallelism)"))
    dbo = cost.get("dual_batch_overlap")
    if dbo:
        n = dbo.get("microbatches", 2)
        rows.append(("dual batch overlap" if n == 2 else "microbatching",
                     f"{dbo['microbatched_steps']:,} of {dbo['lockstep_steps']:,} lockstep steps as "
                     f"{'two' if n == 2 else n} microbatches"))
    return rows


def print_summary(summary: dict, out_dir: Path | None = None, console: Console | None = None,
                  with_report: bool = False) -> None:
    console = console or terminal_console()
    cfg = summary["config"]
    table = Table(title=f"simkv replay: {summary['trace']}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    cost = summary["cost_model"]
    if summary.get("backend") == "gpu":  # every step ran for real: say where, not which GPU spec
        dev = cost.get("device") or {}
        where = dev.get("name") or dev.get("type") or summary.get("device", "?")
        if dev.get("type") == "cpu" and dev.get("threads"):
            where = f"CPU {where}, {dev['threads']} thread{'s' if dev['threads'] != 1 else ''}"
        head = [("model / device", f"{cfg['model']} ({cost.get('dtype', '?')}) / {where}"),
                ("step times", f"measured, {cost.get('kernel_backend', '?')} kernels")]
    else:
        head = [("model / GPU / TP", f"{cfg['model']} / {cfg['gpu']} / {cfg['tensor_parallel_size']}"
                 + (f" x PP {cfg['pipeline_parallel_size']}" if cfg.get("pipeline_parallel_size", 1) > 1 else "")),
                ("cost model", cost["cost_model"] + _beyond_range(cost))]
        if cfg.get("data_parallel_size", 1) > 1:
            head.insert(1, ("data-parallel ranks", f"{cfg['data_parallel_size']} in lockstep, experts over all "
                                                   f"{cfg['data_parallel_size'] * cfg['tensor_parallel_size']} GPUs"))
        if cfg.get("prefill_context_parallel_size", 1) > 1:
            pcp = cfg["prefill_context_parallel_size"]
            head.insert(1, ("prefill-context-parallel ranks", f"{pcp} TP groups, each with the whole KV cache, "
                                                              "splitting every prefill"))
        head += _expert_exchange_rows(cfg, cost)
    if cfg.get("async_scheduling"):
        head.append(("scheduling", "async (step N+1 scheduled while N runs)"))
    groups = summary.get("kv_cache_groups")
    if groups:
        head += kv_cache_groups_rows(groups)
    spec = summary.get("speculative_decoding")
    if spec:
        head.append(("speculative decoding", f"{spec['method']}, K={spec['num_speculative_tokens']}: "
                                             f"{spec['mean_acceptance_length']:.2f} tokens per verify "
                                             f"(draft acceptance {100 * spec['draft_acceptance_rate']:.1f} %), "
                                             f"drafter {100 * spec['drafter_time_share']:.1f} % of the time"))
    fleet = summary.get("fleet")
    pd = summary.get("disaggregation")
    per = ", per replica" if fleet else ""
    if pd:
        per = ", decode pool, per replica"
        head.append(("P/D disaggregation", f"{pd['prefill_replicas']} prefill ({pd['prefill_router']}) + "
                                           f"{pd['decode_replicas']} decode ({pd['decode_router']}), "
                                           f"KV link {pd['kv_link_gbps']:g} GB/s"))
        for pool in ("prefill", "decode"):
            if pd[pool].get("autoscaling"):
                from simkv.replay.autoscale import describe

                head.append((f"{pool} pool autoscaling", describe(pd[pool]["autoscaling"])))
        if (pd.get("autoscaling") or {}).get("nodes"):
            from simkv.replay.autoscale_nodes import describe_nodes

            head.append(("nodes", describe_nodes(pd["autoscaling"]["nodes"])))
    if fleet:
        decisions = ", ".join(f"{k} {v:,}" for k, v in fleet["router"]["decisions"].items())
        head.append(("replicas / router", f"{fleet['num_replicas']} / {fleet['router']['policy']} ({decisions})"))
        if fleet.get("failures"):
            from simkv.replay.failures import describe_failures

            head.append(("replica failures", describe_failures(fleet["failures"])))
        if fleet.get("autoscaling"):
            from simkv.replay.autoscale import describe

            head.append(("autoscaling", describe(fleet["autoscaling"])))
            if fleet["autoscaling"].get("nodes"):
                from simkv.replay.autoscale_nodes import describe_nodes

                head.append(("nodes", describe_nodes(fleet["autoscaling"]["nodes"])))
    client = summary.get("client")
    outcomes = {"finished": summary["num_finished"], "rejected": summary["num_rejected"]}
    if client:
        outcomes["timed out"] = client["timed_out_requests"]
        if "failed_requests" in client:  # (lost with a replica that failed or ended, and not retried)
            outcomes["failed"] = client["failed_requests"]
        if "abandoned_turns" in client:
            outcomes["abandoned"] = client["abandoned_turns"]
    if "turns_not_sent" in summary.get("session_pacing", {}):  # (the client stopped early)
        outcomes["not sent"] = summary["session_pacing"]["turns_not_sent"]
    rows = head + [
        (f"requests ({' / '.join(outcomes)})",
         f"{summary['num_requests']:,} ({' / '.join(f'{c:,}' for c in outcomes.values())})"),
        ("simulated duration", f"{summary['duration_s']:,.2f} s in {summary['num_steps']:,} "
                               f"{'decode-pool ' if pd else ''}steps"),
        ("throughput", f"{summary['request_throughput_req_s']:,.2f} req/s, {summary['output_throughput_tok_s']:,.0f} output tok/s"),
        ("running (peak / mean)" + per, f"{summary['peak_running']:,} / {summary['mean_running']:,.1f}"),
        ("waiting (peak)" + per, f"{summary['peak_waiting']:,}"),
        *admission_limit_rows(summary.get("admission_limits")),
        ("KV blocks (peak used / total)" + per, f"{summary['peak_blocks_used']:,} / {summary['num_gpu_blocks']:,} of {cfg['block_size'] * cfg.get('decode_context_parallel_size', 1)} tokens"),
        ("internal fragmentation", f"{summary['internal_fragmentation_pct']:.2f} %"),
        ("preemptions (events / requests)", f"{summary['num_preemptions']:,} / {summary['num_preempted_requests']:,}"),
        ("prefix cache hit rate", f"{100 * summary['prefix_cache_hit_rate']:.2f} % ({summary['prefix_cache_hits_tokens']:,} of {summary['prefix_cache_queries_tokens']:,} tokens)"),
        ("TTFT ms (mean / p50 / p99)", _fmt_dist(summary["ttft_s"])),
        ("ITL ms (mean / p50 / p99)", _fmt_dist(summary["itl_s"])),
        *([("TPOT ms (mean / p50 / p99)", _fmt_dist(summary["tpot_s"]))] if spec else []),
        ("E2E s (mean / p50 / p99)", _fmt_dist(summary["e2e_s"], 1.0)),
        ("queue ms (mean / p50 / p99)", _fmt_dist(summary["queue_s"])),
    ]
    if summary.get("kv_offloading"):
        off = summary["kv_offloading"]
        rows.insert(next(i for i, row in enumerate(rows) if row[0] == "prefix cache hit rate") + 1,
                    ("CPU tier hit rate (KV offloading)",
                     f"{100 * off['hit_rate']:.2f} % ({off['loaded_tokens']:,} tokens in {off['loads']:,} loads, "
                     f"{off['mean_load_s'] * 1e3:,.1f} ms each); {off['stored_blocks']:,} blocks stored, "
                     f"{off['evicted_blocks']:,} evicted, {off['cpu_chunks']:,} chunks"))
    from simkv.replay.sessions import pacing_rows

    rows += pacing_rows(summary)
    if client:
        from simkv.replay.client_timeouts import client_row

        rows += filter(None, [client_row(client)])
    if summary.get("parallel_sampling"):
        from simkv.replay.results import parallel_sampling_row

        rows.append(parallel_sampling_row(summary["parallel_sampling"]))
    if summary.get("pipeline"):
        from simkv.replay.pipeline import pipeline_row

        rows.append(pipeline_row(summary["pipeline"]))
    if summary.get("admission_control"):
        a = summary["admission_control"]
        limits = [f"{k} {a[k]:,}" for k in ("max_num_queued_reqs", "max_num_queued_tokens") if a[k] is not None]
        rows.append(("admission control (HTTP 503)", f"{sum(a['rejected'].values()):,} refused ("
                     + ", ".join(f"{n:,} by {k}" for k, n in a["rejected"].items() if n) + "); " + ", ".join(limits)
                     if sum(a["rejected"].values()) else "none refused; " + ", ".join(limits)))
    if summary.get("lora"):
        lora = summary["lora"]
        loads = (f"; {lora['disk_loads']:,} adapter reads from disk, {lora['slot_loads']:,} copies into a GPU slot "
                 f"({lora['load_seconds']:.2f} s)" if "disk_loads" in lora else "")  # (summaries before session 37)
        rows.append(("LoRA adapters (max_loras)", f"{lora['adapters']:,} ({lora['max_loras']}); {lora['deferrals']:,} "
                                                  f"request-steps waited for a slot" + loads
                                                  + {True: "; kernels and loads priced", False: "; not priced"}.get(
                                                      lora.get("compute_modelled"), "")))
    if summary.get("multimodal"):
        mm = summary["multimodal"]
        priced = (f"encoder {mm['encoder_seconds']:,.2f} s" if isinstance(mm["encoder_cost"], dict)
                  else "encoder not priced")
        rows.append(("images (encoded / in trace)", f"{mm['items_encoded']:,} / {mm['items']:,}; {priced}; "
                                                    f"{mm['chunks_stopped_before_item']:,} chunks stopped before an "
                                                    f"image; encoder cache {mm['encoder_cache_size']:,} embeddings, "
                                                    f"{mm['encoder_cache_evictions']:,} evictions"
                                                    + (f"; {mm['items_loaded_from_store']:,} loaded from the store "
                                                       f"({mm['store_read_seconds']:,.2f} s)"
                                                       if "items_loaded_from_store" in mm else "")))
    if summary.get("encode_pool"):
        e = summary["encode_pool"]
        rows.append(("encode pool (encoder disaggregation)",
                     f"{e['encode_replicas']} replica(s): {e['requests']:,} requests, {e['items_encoded']:,} images "
                     f"encoded ({e['items_found_in_store']:,} found in the store), encoder busy "
                     f"{100 * e['encoder_busy_fraction']:.1f} %; time there ms (p50 / p99) "
                     f"{1e3 * e['encode_s']['p50']:,.1f} / {1e3 * e['encode_s']['p99']:,.1f}"))
    if summary.get("goodput"):
        from simkv.replay.goodput import describe_slo

        g = summary["goodput"]
        rows.append(("goodput", f"{g['request_goodput_req_s']:,.2f} req/s: {100 * g['slo_attainment']:.1f} % of "
                                f"requests met {describe_slo(g['slo_ms'])}"))
    if summary.get("cost"):
        from simkv.studies.serving_cost import describe_replay_cost

        rows.append(("cost", describe_replay_cost(summary["cost"])))
    rows += [
        ("wall time", f"{summary['wall_time_s']:.2f} s ({summary['num_requests'] / max(summary['wall_time_s'], 1e-9):,.0f} req/s)"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    if fleet:
        console.print(replica_table(fleet))
    if pd:
        console.print(pool_table(pd))
    if summary.get("classes"):
        console.print(class_table(summary["classes"]))
    if out_dir is not None:
        console.print(f"wrote {out_dir}/summary.json, requests.parquet, steps.parquet, token_gaps.parquet"
                      + (", report.html" if with_report else ""))


def pool_table(pd: dict) -> Table:
    """P/D: one row per pool (peaks per replica, counts over the pool), and the KV pulls."""
    table = Table(title="P/D pools")
    tiers = any("kv_offloading" in pd[name] for name in ("prefill", "decode"))
    for name in ("pool", "replicas", "steps", "running peak / mean", "KV blocks peak / total", "preemptions",
                 "prefix hit %", *(["CPU tier hit % (GiB)"] if tiers else [])):
        table.add_column(name, justify="right")
    for name in ("prefill", "decode"):
        p = pd[name]
        off = p.get("kv_offloading")
        tier = [f"{100 * off['hit_rate']:.1f} ({off['cpu_tier_gib']:,.0f})" if off else "-"] if tiers else []
        table.add_row(name, str(len(p["replicas"])), f"{p['num_steps']:,}",
                      f"{p['peak_running']:,} / {p['mean_running']:,.1f}",
                      f"{p['peak_blocks_used']:,} / {p['num_gpu_blocks']:,}", f"{p['num_preemptions']:,}",
                      f"{100 * p['prefix_cache_hit_rate']:.1f}", *tier)
    kv = pd["kv_transfer"]
    table.caption = (f"KV pulls: {kv['num_pulls']:,}, {kv['pulled_bytes'] / 1e9:,.2f} GB; pull ms (mean / p50 / p99) "
                     f"{_fmt_dist(kv['pull_s'])}; handoff to pull start ms {_fmt_dist(kv['handoff_to_pull_s'])}; "
                     f"link use {100 * kv['mean_link_utilization']:.2f} %")
    for name in ("prefill", "decode"):  # (pipeline stages: each pool's, a stage busy on average)
        stages = pd[name].get("pipeline")
        if stages:
            table.caption += (f"; {name} pool: {stages['pipeline_parallel_size']} stages busy "
                              f"{100 * stages['stage_busy_fraction']:.1f} % of the time")
    return table


def class_table(section: dict) -> Table:
    """One row per request class (simkv/replay/classes.py): what each kind of traffic got
    (TTFT and TPOT in ms; summary.json has the rest)."""
    from rich import box

    classes = section["classes"]
    slo = any("slo_attainment" in c for c in classes.values())
    by_priority = section["by"] == "priority"
    table = Table(title="per priority" if by_priority else "per request class", box=box.SIMPLE_HEAD,
                  caption="TTFT, TPOT and ITL in ms", pad_edge=False)
    for name in ("priority" if by_priority else "class", "done", "hit %", "preempt", "TTFT\np50", "TTFT\np99",
                 "TPOT\np50", "TPOT\np99", "ITL\np99", *(["SLO %"] if slo else [])):
        table.add_column(name, justify="right")

    def ms(d: dict | None, key: str) -> str:
        if d is None or d[key] is None:
            return "-"
        x = 1e3 * d[key]
        return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"

    for name, c in classes.items():
        done = f"{c['num_finished']:,}" + ("" if c["num_finished"] == c["num_requests"] else f"/{c['num_requests']:,}")
        table.add_row(name.split("=", 1)[1] if by_priority else name, done, f"{100 * c['prefix_hit_share']:.1f}",
                      f"{c['num_preemptions']:,}", ms(c["ttft_s"], "p50"), ms(c["ttft_s"], "p99"), ms(c["tpot_s"], "p50"),
                      ms(c["tpot_s"], "p99"), ms(c.get("itl_s"), "p99"),
                      *([f"{100 * c['slo_attainment']:.1f}"] if slo else []))
    return table


def replica_table(fleet: dict) -> Table:
    """One row per replica of a fleet (peaks are per replica; the table above takes the largest)."""
    table = Table(title="per replica")
    mixed = "gpu" in fleet["replicas"][0]  # (replica sets: the replicas' engines differ)
    scaled = "paid_s" in fleet["replicas"][0]  # (an autoscaled fleet: each replica's paid time)
    for name in ("replica", *(["GPU x TP", "KV blocks"] if mixed else []), "requests", "running peak / mean",
                 "preemptions", "prefix hit %", "TTFT ms p50 / p99", "ITL ms p50 / p99", "busy until s",
                 *(["paid s"] if scaled else [])):
        table.add_column(name, justify="right")
    for row in fleet["replicas"]:
        def pair(d):
            return "-" if d["p50"] is None else f"{1e3 * d['p50']:,.1f} / {1e3 * d['p99']:,.1f}"
        engine = [f"{row['gpu']} x {row['tensor_parallel_size']}", f"{row['num_gpu_blocks']:,}"] if mixed else []
        table.add_row(str(row["replica"]), *engine, f"{row['num_requests']:,}",
                      f"{row['peak_running']:,} / {row['mean_running']:,.1f}", f"{row['num_preemptions']:,}",
                      f"{100 * row['prefix_cache_hit_rate']:.1f}", pair(row["ttft_s"]), pair(row["itl_s"]),
                      f"{row['duration_s']:,.1f}", *([f"{row['paid_s']:,.1f}"] if scaled else []))
    return table
