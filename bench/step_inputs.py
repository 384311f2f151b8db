"""Host time to turn one scheduler step into the model runner's input arrays.

    python bench/step_inputs.py [--steps 64] [--rounds 5]

The GPU backend times a step from before its input preparation to the end of its sampling
(`gpu_backend/backend.py`), so the host work of building token ids, positions, the slot mapping
and the block tables is part of every measured step, as it is part of every vLLM step. This
script replays a run of consecutive decode steps (each request one token further, a new block
every `block_size` tokens, fresh block-id lists each step as the scheduler hands them over) and
times `ModelRunner.prepare`, and for decode-only steps also the copy into the decode graphs'
static buffers (`DecodeGraphs.stage`, CPU tensors here). No forward runs; figures are host
CPU time and depend on the host.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BLOCK_SIZE = 16


def decode_steps(num_seqs: int, context: int, num_steps: int, chunks: list[tuple[int, int]]):
    """`num_steps` consecutive SchedulerOutputs: `num_seqs` decodes from `context` tokens on,
    plus the same prefill chunks (cached, new) in every step."""
    from simkv.core.outputs import ScheduledChunk, ScheduledDecode, SchedulerOutput
    from simkv.core.request import Request

    longest = context + num_steps + 1 + max((c + n for c, n in chunks), default=0)
    per_seq = -(-longest // BLOCK_SIZE)
    requests = [Request(f"r{i}", i, 0.0, context, num_steps + 2) for i in range(num_seqs)]
    prefills = [Request(f"p{j}", num_seqs + j, 0.0, c + n, 1) for j, (c, n) in enumerate(chunks)]
    tables = {r.index: list(range(1 + r.index * per_seq, 1 + (r.index + 1) * per_seq)) for r in requests + prefills}
    outs = []
    for s in range(num_steps):
        decs = [ScheduledDecode(r, context + s, tables[r.index][:(context + s) // BLOCK_SIZE + 1]) for r in requests]
        chs = [ScheduledChunk(p, c, n, False, tables[p.index][:-(-(c + n) // BLOCK_SIZE)])
               for p, (c, n) in zip(prefills, chunks)]
        outs.append(SchedulerOutput(step=s, chunks=chs, num_decode_reqs=num_seqs,
                                    decode_context_tokens=num_seqs * (context + s + 1), decodes=decs, preempted=[],
                                    num_running=num_seqs + len(chunks), num_waiting=0, num_blocks_used=0,
                                    prefix_query_tokens=0, prefix_hit_tokens=0))
    return outs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=64, help="consecutive steps per round")
    p.add_argument("--rounds", type=int, default=5, help="median over this many rounds")
    args = p.parse_args(argv)

    from gpu_backend.decode_graphs import DecodeGraphs
    from gpu_backend.runner import ModelRunner

    cases = [(32, 1024, []), (128, 2048, []), (256, 1024, []), (256, 4096, []),
             (64, 2048, [(1024, 256), (0, 512)])]
    print("| decodes | context | prefill chunks | prepare us/step | + graph staging us/step | us per sequence |")
    print("|---:|---:|---|---:|---:|---:|")
    for num_seqs, context, chunks in cases:
        runner = ModelRunner("tiny-llama", num_gpu_blocks=0, block_size=BLOCK_SIZE, max_model_len=8192)
        graphs = DecodeGraphs(runner, 256, capture=False) if not chunks else None
        stage = getattr(graphs, "stage", None)
        prep, staged = [], []
        for _ in range(args.rounds):
            outs = decode_steps(num_seqs, context, args.steps, chunks)
            t0 = time.perf_counter()
            batches = [runner.prepare(o) for o in outs]
            t1 = time.perf_counter()
            if stage is not None:
                for b in batches:
                    stage(b)
            t2 = time.perf_counter()
            prep.append((t1 - t0) / args.steps)
            staged.append((t2 - t1) / args.steps)
        med_p = statistics.median(prep) * 1e6
        med_s = statistics.median(staged) * 1e6 if stage is not None else float("nan")
        total = med_p + (med_s if stage is not None else 0.0)
        label = ", ".join(f"{n}@{c}" for c, n in chunks) or "-"
        print(f"| {num_seqs} | {context} | {label} | {med_p:.0f} | "
              f"{'-' if stage is None else f'{med_s:.0f}'} | {total / (num_seqs + len(chunks)):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
