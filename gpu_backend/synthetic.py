"""Synthetic steps of a given shape (calibration grid points, warm-up), built from the engine's
own `Request` / `SchedulerOutput` types so the runner executes them exactly like replay steps."""

from __future__ import annotations

from simkv.core.outputs import ScheduledChunk, ScheduledDecode, SchedulerOutput
from simkv.core.request import Request

SYNTHETIC_INDEX = -1


class BlockCursor:
    """Hands out distinct physical blocks 1.. of the pool, wrapping around when exhausted."""

    def __init__(self, num_blocks: int) -> None:
        self.num_usable = max(num_blocks - 1, 1)
        self.next = 0
        self.wrapped = False

    def take(self, n: int) -> list[int]:
        if n > self.num_usable:
            self.wrapped = True
        out = []
        for _ in range(n):
            out.append(1 + self.next)
            self.next += 1
            if self.next >= self.num_usable:
                self.next = 0
                self.wrapped = True
        return out


def blocks_needed(prefills: list[tuple[int, int]], decodes: list[int], block_size: int) -> int:
    total = sum(-(-(c + n) // block_size) for c, n in prefills)
    return total + sum(-(-(ctx + 1) // block_size) for ctx in decodes)


def synthetic_output(prefills: list[tuple[int, int]], decodes: list[int], block_size: int,
                     num_blocks: int, step: int = 0) -> SchedulerOutput:
    """One step: prefill chunks of (cached, new) tokens and decodes at the given contexts."""
    cursor = BlockCursor(num_blocks)
    chunks, decs = [], []
    for cached, new in prefills:
        req = Request("synthetic", SYNTHETIC_INDEX, 0.0, cached + new, 1)
        chunks.append(ScheduledChunk(req, cached, new, False, cursor.take(-(-(cached + new) // block_size))))
    for ctx in decodes:
        req = Request("synthetic", SYNTHETIC_INDEX, 0.0, max(ctx, 1), 2)
        decs.append(ScheduledDecode(req, ctx, cursor.take(-(-(ctx + 1) // block_size))))
    ctx_tokens = sum(c + 1 for c in decodes)
    return SchedulerOutput(step=step, chunks=chunks, num_decode_reqs=len(decodes), decode_context_tokens=ctx_tokens,
                           decodes=decs, preempted=[], num_running=len(prefills) + len(decodes), num_waiting=0,
                           num_blocks_used=0, prefix_query_tokens=0, prefix_hit_tokens=0)


def run_synthetic(runner, output: SchedulerOutput) -> None:
    runner.run(output)
    runner.outputs.pop(SYNTHETIC_INDEX, None)


def attention_variant_shapes(runner, max_seqs: int = 256) -> list[tuple[list, list]]:
    """On Triton, one decode step per distinct attention-kernel configuration (tile sizes and
    KV split count depend on batch size and context), so no compilation happens mid-replay."""
    if runner.kernel_backend != "triton":
        return []
    from kernels.layout import next_power_of_two
    from kernels.triton_attention import _num_sms, choose_config

    spec = runner.spec
    qpk = spec.num_heads // spec.num_kv_heads
    elem = runner.kv_caches[0][0].element_size()
    max_ctx = runner.model.cos_table.shape[0] - 2
    seen, shapes = set(), []
    b = 1
    contexts = []
    ctx = 16
    while ctx < max_ctx:
        contexts.append(ctx)
        ctx *= 2
    contexts.append(max_ctx)  # the longest context a replay can meet splits the keys the most
    while b <= max_seqs:
        for ctx in contexts:
            cfg = choose_config(qpk=qpk, head_pad=max(16, next_power_of_two(spec.head_dim)), elem_size=elem,
                                num_seqs=b, num_kv_heads=spec.num_kv_heads, max_query_len=1, max_seq_len=ctx + 1,
                                num_sms=_num_sms(runner.device), tuning=runner.kernel_tuning)
            if cfg not in seen:
                seen.add(cfg)
                shapes.append(([], [ctx] * b))
        b *= 2
    for n in (2, 8, 64):  # prefill tile variants: tiny chunks, mid, large
        shapes.append(([(0, n)], [32]))
    return shapes


def warm_up(runner, steps: int = 3) -> None:
    """Compile/JIT every kernel variant a replay meets (decode-only, prefill, mixed) before timing."""
    bs, nb = runner.block_size, runner.num_gpu_blocks
    shapes = [([], [bs]), ([(0, 2 * bs)], []), ([(bs, bs)], [bs, 2 * bs]), ([(0, 300)], [64] * 8),
              ([], [200] * 16)]
    try:
        shapes += attention_variant_shapes(runner)
    except (ImportError, AttributeError, TypeError):  # kernels changed: fall back to the basic shapes
        pass
    from gpu_backend.backend import is_oom

    for _ in range(max(steps, 1)):
        for prefills, decodes in shapes:
            try:
                run_synthetic(runner, synthetic_output(prefills, decodes, bs, nb))
            except Exception as exc:  # a warm-up shape too big for the device is skipped, not fatal
                if not is_oom(exc):
                    raise
