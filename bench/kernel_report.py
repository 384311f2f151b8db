"""The markdown report and target verdicts of `bench/kernels.py` (pure formatting: no torch)."""
from __future__ import annotations


def fmt(x, nd=1) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def fmt_e(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def markdown(result: dict) -> str:
    env, roofs = result["env"], result["roofs"]
    out = [f"# Paged-attention kernel benchmark ({env['date']})", "",
           f"GPU: {env['gpu']} ({env['sms']} SMs, L2 {env['l2_mib']} MiB); torch {env['torch']}, triton {env['triton']}, "
           f"CUDA {env['cuda']}; model: {env['model']}.", "",
           f"Measured roofs: device-to-device copy {roofs['copy_bytes_per_s'] / 1e9:.0f} GB/s (read + write; "
           f"the fastest of: " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in roofs.get("copy_rates", {}).items())
           + f"), {env['model_dtype']} matmul {roofs['matmul_flops'] / 1e12:.0f} TFLOP/s.", ""]
    out += ["## Decode (1 new token per sequence)", "",
            "ids ahead: the same launch with `prefetch_ids` (block ids loaded a tile ahead, >= 3 stages); "
            "its speed-up is default time / its time; its diff is the largest |difference| from the default's output. "
            "searched: the grid over query tiles whose programs search for their sequence (the launch before "
            "session 7); gain: its time / the default's (decode-only grid).", "",
            "| batch | context | config | paged us | KV GB/s | % copy BW | SDPA us | SDPA/paged | flash-attn/paged | max diff "
            "| ids ahead us | speed-up | SDPA/ids ahead | ids ahead diff | searched us | gain |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["decode"]:
        out.append(f"| {r['num_seqs']} | {r['context'] + r['q_len']} | {r['config']} | {fmt(r['paged_ms'] * 1e3)} | {fmt(r['kv_gbps'], 0)} | "
                   f"{fmt(r['pct_copy_bw'])} | {fmt(r.get('sdpa_ms') and r['sdpa_ms'] * 1e3)} | {fmt(r.get('sdpa_over_paged'), 2)} | "
                   f"{fmt(r.get('flash_attn_over_paged'), 2)} | {r['max_abs_diff_vs_sdpa']:.1e} | "
                   f"{fmt(r.get('prefetch_ms') and r['prefetch_ms'] * 1e3)} | {fmt(r.get('prefetch_speedup'), 2)} | "
                   f"{fmt(r.get('sdpa_over_prefetch'), 2)} | {fmt_e(r.get('prefetch_max_diff'))} | "
                   f"{fmt(r.get('search_ms') and r['search_ms'] * 1e3)} | {fmt(r.get('decode_only_speedup'), 2)} |")
    out += ["", "## Prefill (chunks, causal; with and without cached context)", "",
            "+ new K/V: `prefetch_ids` and `new_kv` together (key tiles of the new tokens read from the step's K/V).", "",
            "| seqs x chunk | cached | config | paged ms | TFLOP/s | % matmul | SDPA ms | SDPA/paged | flash-attn/paged | max diff "
            "| ids ahead ms | speed-up | ids ahead diff | + new K/V ms | speed-up | diff |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["prefill"]:
        out.append(f"| {r['num_seqs']} x {r['q_len']} | {r['context']} | {r['config']} | {fmt(r['paged_ms'], 3)} | {fmt(r['tflops'])} | "
                   f"{fmt(r['pct_matmul'])} | {fmt(r.get('sdpa_ms'), 3)} | {fmt(r.get('sdpa_over_paged'), 2)} | "
                   f"{fmt(r.get('flash_attn_over_paged'), 2)} | {r['max_abs_diff_vs_sdpa']:.1e} | "
                   f"{fmt(r.get('prefetch_ms'), 3)} | {fmt(r.get('prefetch_speedup'), 2)} | {fmt_e(r.get('prefetch_max_diff'))} | "
                   f"{fmt(r.get('newkv_prefetch_ms'), 3)} | {fmt(r.get('newkv_prefetch_speedup'), 2)} | "
                   f"{fmt_e(r.get('newkv_prefetch_max_diff'))} |")
    if result.get("cache_write"):
        cw = result["cache_write"]
        out += ["", f"reshape_and_cache: {cw['num_tokens']} tokens in {cw['ms'] * 1e3:.1f} us ({cw['gbps']:.0f} GB/s moved)."]
    if result.get("layer_ops"):
        out += ["", "## Layer ops (fused element-wise kernels of the GPU backend)", "",
                "bytes that must move / time, against the copy roof; torch/fused: the torch operators they replace "
                "(kernels/layer_ops.py) over the fused kernel's time.", "",
                "| op | tokens | fused us | GB/s | % copy BW | torch us | torch/fused |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in result["layer_ops"]:
            if "error" in r:
                out.append(f"| {r['kind']} | {r['num_tokens']} | error: {r['error'][:80]} | | | | |")
            else:
                out.append(f"| {r['kind']} | {r['num_tokens']} | {fmt(r['fused_us'])} | {fmt(r['gbps'], 0)} | "
                           f"{fmt(r['pct_copy_bw'])} | {fmt(r['torch_us'])} | {fmt(r['torch_over_fused'], 2)} |")
    if result.get("sweep"):
        out += ["", "## Config sweep", "", "new K/V: key tiles of new tokens read from the step's K/V, not the cache. "
                "ids ahead: each tile's block ids loaded while the previous tile is attended. "
                "TMA: the new K/V tiles copied by tensor descriptors; TMA cache: each cache block copied so.", "",
                "| case | block_m | tile_n | segments | warps | stages | new K/V | ids ahead | TMA | TMA cache | ms "
                "| % copy BW | % matmul | max diff vs first |",
                "|---|---:|---:|---:|---:|---:|---|---|---|---|---:|---:|---:|---:|"]
        for r in result["sweep"]:
            if "config" not in r:  # the case's inputs could not be built
                out.append(f"| {r['kind']} {r['num_seqs']}x({r['context']}+{r['q_len']}) | {r['error'][:80]} "
                           "| | | | | | | | | | | | |")
                continue
            c = r["config"]
            flags = " | ".join("yes" if c.get(k) else "no" for k in ("new_kv", "prefetch_ids", "tma_new_kv", "tma_paged"))
            head = f"{c['block_m']} | {c['tile_n']} | {c['num_segments']} | {c['num_warps']} | {c['num_stages']} | {flags}"
            if "error" in r:
                out.append(f"| {r['kind']} | {head} | error: {r['error'][:60]} | | | |")
            else:
                out.append(f"| {r['kind']} {r['num_seqs']}x({r['context']}+{r['q_len']}) | {head} | {r['ms']:.3f} | "
                           f"{r['pct_copy_bw']:.1f} | {r['pct_matmul']:.1f} | {r.get('max_diff_vs_first', float('nan')):.1e} |")
    out += ["", "## Targets", ""] + [f"- {t}" for t in result["targets"]]
    if result.get("skipped"):
        out += ["", "Skipped (time budget): " + ", ".join(result["skipped"])]
    return "\n".join(out) + "\n"


def check_targets(result: dict) -> list[str]:
    lines = []
    long_dec = [r for r in result["decode"] if r["context"] + r["q_len"] >= 32768]
    if long_dec:
        worst = min(r["pct_copy_bw"] for r in long_dec)
        lines.append(f"decode, context >= 32k: worst {worst:.1f}% of copy bandwidth (target >= 80%): {'MET' if worst >= 80 else 'NOT MET'}")
        ratios = [r["sdpa_over_paged"] for r in long_dec if "sdpa_over_paged" in r]
        if ratios:
            lines.append(f"decode, context >= 32k: worst SDPA/paged time ratio {min(ratios):.2f} (target >= 1): {'MET' if min(ratios) >= 1 else 'NOT MET'}")
        alt = [r for r in long_dec if "prefetch_ms" in r]
        if alt and len(alt) == len(long_dec):  # the option judged on the same cases
            bw = min(r["pct_copy_bw"] * r["prefetch_speedup"] for r in alt)  # as the prefill lines below
            line = f"decode, context >= 32k, with prefetch_ids: worst {bw:.1f}% of copy bandwidth"
            ratios = [r["sdpa_over_prefetch"] for r in alt if "sdpa_over_prefetch" in r]
            if ratios:
                line += f", worst SDPA/paged {min(ratios):.2f}"
            lines.append(line + f" ({'both targets MET' if bw >= 80 and ratios and min(ratios) >= 1 else 'not both met'}; not the default)")
    long_pre = [r for r in result["prefill"] if r["q_len"] >= 4096]
    if long_pre:
        worst = min(r["pct_matmul"] for r in long_pre)
        lines.append(f"prefill, chunks >= 4k: worst {worst:.1f}% of the matmul rate (target >= 50%): {'MET' if worst >= 50 else 'NOT MET'}")
        for name, label in (("prefetch", "prefetch_ids"), ("newkv_prefetch", "new_kv + prefetch_ids")):
            alt = [r for r in long_pre if f"{name}_ms" in r]
            if alt and len(alt) == len(long_pre):
                worst = min(r["pct_matmul"] * r[f"{name}_speedup"] for r in alt)
                lines.append(f"prefill, chunks >= 4k, with {label}: worst {worst:.1f}% of the matmul rate "
                             f"({'MET' if worst >= 50 else 'NOT MET'}; not the default)")
    return lines or ["no case large enough to judge the targets was run"]
