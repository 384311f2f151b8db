"""Every way to lay a model out over N GPUs (`simkv capacity --layouts N`, `simkv goodput
--layouts N`): engines of TP GPUs (N / TP of them, independent replicas), engines of PP pipeline
stages of TP GPUs each, for a mixture of experts one engine of data-parallel ranks of TP (and of
ranks of PP stages), and for latent attention engines of PCP copies of TP GPUs (vLLM's prefill
context parallelism). With decode context parallelism D, the layouts whose TP D divides."""

from __future__ import annotations

from dataclasses import dataclass

# the engine options a layout sets
LAYOUT_KEYS = ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size")


@dataclass(frozen=True)
class Layout:
    tensor_parallel_size: int
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    copies: int = 1  # independent engines of this layout (replicas behind a router)
    decode_context_parallel_size: int = 1

    @property
    def name(self) -> str:
        tp, dp, pp, pcp = (self.tensor_parallel_size, self.data_parallel_size, self.pipeline_parallel_size,
                           self.prefill_context_parallel_size)
        return ((f"DP {dp} x TP {tp}" if dp > 1 else f"{self.copies} x TP {tp}") + (f" x PP {pp}" if pp > 1 else "")
                + (f" x PCP {pcp}" if pcp > 1 else "")
                + (f" DCP {self.decode_context_parallel_size}" if self.decode_context_parallel_size > 1 else ""))

    @property
    def num_kv_caches(self) -> int:
        """KV caches in all: each engine's, each of its data-parallel ranks' its own."""
        return self.copies * self.data_parallel_size

    def options(self) -> dict:
        """The engine options of one engine of this layout (those off left out, TP's aside)."""
        out = {"tensor_parallel_size": self.tensor_parallel_size}
        for key in ("data_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size",
                    "decode_context_parallel_size"):
            if getattr(self, key) > 1:
                out[key] = getattr(self, key)
        return out


def layouts_of(num_gpus: int, spec, decode_context_parallel_size: int = 1) -> list[Layout]:
    """The layouts of `num_gpus` GPUs for a model of `spec` (ModelSpec), TP ascending; for each TP:
    engines, data-parallel ranks, pipelines, data-parallel ranks of pipelines, PCP copies."""
    dcp = decode_context_parallel_size
    out = []
    for tp in (t for t in range(1, num_gpus + 1) if num_gpus % t == 0 and t % dcp == 0):
        rest = num_gpus // tp
        kinds = [(1, 1, 1)]  # (dp, pp, pcp)
        if spec.is_moe and tp < num_gpus:
            kinds.append((rest, 1, 1))
        stage_counts = [pp for pp in range(2, rest + 1) if rest % pp == 0]
        kinds += [(1, pp, 1) for pp in stage_counts]
        if spec.is_moe:
            kinds += [(rest // pp, pp, 1) for pp in stage_counts if rest // pp > 1]
        if spec.is_mla and dcp == 1:  # (vLLM's V2 runner runs PCP for latent attention)
            kinds += [(1, 1, pcp) for pcp in stage_counts]
        for dp, pp, pcp in kinds:
            copies = num_gpus // (tp * pp * pcp) if dp == 1 else 1
            out.append(Layout(tp, dp, pp, pcp, copies, dcp))
    return out
