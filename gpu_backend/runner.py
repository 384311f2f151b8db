"""The model runner: turn one `SchedulerOutput` into a forward pass over the paged KV pool.

Each scheduled request contributes a contiguous run of query tokens: a prefill chunk computes
positions [num_computed_tokens, num_computed_tokens + num_new_tokens), a decode computes the
one position num_computed_tokens. Every request attends to all its earlier positions through
its block table, which is the scheduler's list of physical block ids, used unchanged as
indices into the pool (one K and one V tensor per layer, `kernels/layout.py`).

Token ids: traces carry lengths, not text. A prompt position gets a deterministic id derived
from its content key (the shared prefix hash block and offset when the trace has block
hashes, else the request and position), so prefix-cache hits reuse K/V that really is the
same. Output positions hold the tokens this runner sampled (greedy argmax); output length
comes from the trace, EOS is ignored.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from gpu_backend.input_batch import BlockTableRows, StepBatch, filler_token_id, prepare_step
from gpu_backend.model import AttentionInputs, LeanLlama
from kernels.layer_ops import layer_ops
from simkv.core.outputs import SchedulerOutput
from simkv.specs import get_model_spec

_M64 = (1 << 64) - 1


def _mix(a: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays."""
    with np.errstate(over="ignore"):
        z = a.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def dtype_from_name(name: str) -> torch.dtype:
    table = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
             "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"unknown dtype '{name}'; use one of fp32, fp16, bf16")
    return table[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def default_dtype(device: str) -> str:
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


class ModelRunner:
    """Owns the model weights and the KV pool; executes scheduler outputs."""

    def __init__(self, model: str, num_gpu_blocks: int, block_size: int = 16, device: str = "cpu",
                 dtype: str | None = None, seed: int = 0, max_model_len: int | None = None,
                 kernel_backend: str | None = None, fused_ops: bool | None = None) -> None:
        self.spec = get_model_spec(model)
        if self.spec.simulated_only:
            raise ValueError(f"{model} has {self.spec.simulated_only}: simulated only (the GPU backend runs dense "
                             "Llama-architecture decoders that attend the whole context)")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
        self.dtype = dtype_from_name(dtype or default_dtype(device))
        if self.device.type == "cpu":
            # One intra-op thread: tiny-model steps are too small to gain from more, and on a
            # shared 2-core host extra threads turn every contention into a long stall.
            import os

            torch.set_num_threads(int(os.environ.get("SIMKV_CPU_THREADS", "1")))
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        max_positions = max(max_model_len or 0, self.spec.max_position_embeddings)
        self.max_positions = max_positions
        self.model = LeanLlama(self.spec, self.dtype, self.device, seed=seed, max_positions=max_positions + 1)
        self.kernel_backend = kernel_backend or ("triton" if self.device.type == "cuda" else "torch")
        # measured tiles for this device, if any (kernels/tuning.py: SIMKV_KERNEL_TUNING, kernels/tuned/)
        self.kernel_tuning = None
        if self.kernel_backend == "triton":
            from kernels.tuning import active_tuning

            name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
            self.kernel_tuning = active_tuning(name)
        self.ops = layer_ops(self.kernel_backend, fused_ops, self.kernel_tuning)
        self.kv_caches: list = []
        if num_gpu_blocks:
            self.allocate_pool(num_gpu_blocks)
        # request index -> sampled token ids (output positions), while the request runs
        self.outputs: dict[int, list[int]] = {}
        self.last_host_times = (0.0, 0.0)  # last step: (input preparation, forward call) host seconds
        self.decode_graphs = None  # DecodeGraphs once enable_decode_graphs ran (CUDA)
        self.decode_graphs_status = "off"
        # batch sizes of the captured graphs (empty: every step eager; the cost model's E term)
        self.graph_sizes: list[int] = []
        self.last_graph_batch = 0  # last step: the graph size it ran as (0: eager)
        self.piecewise_graphs = None  # PiecewiseGraphs once enable_piecewise_graphs ran
        self.piecewise_status = "off"
        self.piecewise_sizes: list[int] = []  # token counts of the captured piecewise graphs
        self.last_piecewise_tokens = 0  # last step: the token count it was padded to (0: not piecewise)
        self.vocab = self.spec.vocab_size
        self.block_rows = BlockTableRows()  # each running request's block table, kept across steps
        self._last_output = None  # its `finished` list (filled after the step) releases rows

    def _capture_graphs(self, build, capture: bool | None, unit: str):
        """`build(capture)` makes a graph set (decode or piecewise); returns (the set or None, the
        captured sizes, a status). Without CUDA, or if capture fails, those steps stay eager and
        the status says why."""
        if capture is None:
            capture = self.device.type == "cuda"
        if capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        t0 = time.perf_counter()
        try:
            graphs = build(capture)
        except Exception as exc:  # noqa: BLE001 - a capture failure leaves the eager path working
            import traceback

            traceback.print_exc(file=sys.stderr)  # the status keeps 200 characters; the log keeps where
            if self.device.type == "cuda":
                try:
                    torch.cuda.synchronize(self.device)
                    torch.cuda.empty_cache()
                except Exception:  # noqa: BLE001 - the status already says what failed
                    pass
            return None, [], f"off: capture failed ({type(exc).__name__}: {str(exc)[:200]})"
        sizes = graphs.sizes
        status = (f"{'captured' if capture else 'static buffers, eager'}: {len(sizes)} {unit} {sizes[0]}..{sizes[-1]}"
                  + (f" in {time.perf_counter() - t0:.1f} s" if capture else "")
                  + (" (capture budget spent: other sizes pad up to these)" if getattr(graphs, "cut_short", False) else ""))
        return graphs, (list(sizes) if capture else []), status

    def enable_decode_graphs(self, max_batch: int, capture: bool | None = None) -> str:
        """Capture CUDA graphs of decode-only steps up to `max_batch` sequences (vLLM's default;
        `--enforce-eager` skips this); returns the status."""
        from gpu_backend.decode_graphs import DecodeGraphs

        self.decode_graphs, self.graph_sizes, self.decode_graphs_status = self._capture_graphs(
            lambda c: DecodeGraphs(self, max_batch, capture=c), capture, "sizes")
        return self.decode_graphs_status

    def enable_piecewise_graphs(self, max_tokens: int, capture: bool | None = None,
                                sizes: list[int] | None = None) -> str:
        """Capture piecewise CUDA graphs for steps of up to `max_tokens` tokens that no decode
        graph serves (vLLM's FULL_AND_PIECEWISE mode; `gpu_backend/piecewise_graphs.py`);
        returns the status."""
        from gpu_backend.piecewise_graphs import PiecewiseGraphs

        self.piecewise_graphs, self.piecewise_sizes, self.piecewise_status = self._capture_graphs(
            lambda c: PiecewiseGraphs(self, max_tokens, capture=c, sizes=sizes), capture, "token counts")
        return self.piecewise_status

    def graph_fields(self) -> dict:
        """What summary.json and calib.json record of the CUDA graphs steps run from."""
        return {"cuda_graphs": self.decode_graphs_status, "cuda_graph_sizes": list(self.graph_sizes),
                "cuda_piecewise_graphs": self.piecewise_status, "cuda_piecewise_sizes": list(self.piecewise_sizes)}

    def sibling(self, num_gpu_blocks: int) -> "ModelRunner":
        """Another runner on the same weights and kernels with a KV pool of its own and no decode
        graphs (capture them with `enable_decode_graphs`): calibration steps timed alongside a
        replay write only into this pool, never into the replay's requests' blocks."""
        import copy

        other = copy.copy(self)
        other.outputs = {}
        other.block_rows, other._last_output = BlockTableRows(), None
        other.decode_graphs, other.graph_sizes, other.decode_graphs_status = None, [], "off"
        other.piecewise_graphs, other.piecewise_sizes, other.piecewise_status = None, [], "off"
        other.last_piecewise_tokens = 0
        other.last_host_times, other.last_graph_batch = (0.0, 0.0), 0
        other.kv_caches = []
        other.allocate_pool(num_gpu_blocks)
        return other

    def allocate_pool(self, num_gpu_blocks: int) -> None:
        """One K and one V tensor per layer, `num_gpu_blocks` blocks each (block ids index them)."""
        from kernels import allocate_kv_cache

        if getattr(self, "decode_graphs", None) is not None:  # graphs hold the old pool's addresses
            self.decode_graphs = None
            self.graph_sizes = []
            self.decode_graphs_status = "off: KV pool reallocated after capture"
        # piecewise graphs hold no KV addresses (attention runs between them): they stay valid
        self.kv_caches = []
        self.num_gpu_blocks = num_gpu_blocks
        self.kv_caches = [allocate_kv_cache(num_gpu_blocks, self.block_size, self.spec.num_kv_heads,
                                            self.spec.head_dim, dtype=self.dtype, device=self.device)
                          for _ in range(self.spec.num_layers)]

    def bytes_per_block(self) -> int:
        s = self.spec
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    # ---- token content ------------------------------------------------------------------------
    def prompt_token_ids(self, request, start: int, stop: int) -> np.ndarray:
        """A prompt's token ids: from the trace's hash ids where they cover it, else unique to the
        request (to its first member, fanned out: the members share one prompt)."""
        pos = np.arange(start, stop, dtype=np.uint64)
        ids = _mix(pos ^ (np.uint64(request.prompt_owner + 1) << np.uint64(32)))
        covered = len(request.shared_hash_ids) * request.hash_block_tokens if request.shared_hash_ids is not None else 0
        shared = min(covered, request.num_prompt_tokens, stop)
        if request.shared_hash_ids is not None and shared > start:
            k = shared - start
            hb = request.hash_block_tokens
            p = np.arange(start, shared, dtype=np.int64)
            keys = np.asarray(request.shared_hash_ids, dtype=np.int64)[p // hb].astype(np.uint64)
            ids[:k] = _mix(_mix(keys) ^ (p % hb).astype(np.uint64))
        return (ids % np.uint64(self.vocab)).astype(np.int64)

    def token_ids(self, request, start: int, stop: int) -> np.ndarray:
        """Ids of positions [start, stop) of a request: prompt content, then sampled outputs."""
        prompt = request.num_prompt_tokens
        if stop <= prompt:
            return self.prompt_token_ids(request, start, stop)
        head = self.prompt_token_ids(request, start, prompt) if start < prompt else np.zeros(0, np.int64)
        outs = self.outputs.get(request.index, [])
        tail = []
        for p in range(max(start, prompt), stop):
            j = p - prompt
            # A missing output (never sampled here) gets a deterministic filler id.
            tail.append(outs[j] if j < len(outs) else filler_token_id(request, p, self.vocab))
        return np.concatenate([head, np.asarray(tail, dtype=np.int64)])

    def _record_sample(self, request, position: int, token: int) -> None:
        j = position - request.num_prompt_tokens
        if j < 0:
            return
        outs = self.outputs.setdefault(request.index, [])
        if j < len(outs):
            outs[j] = token
        else:
            outs.extend([0] * (j - len(outs)))
            outs.append(token)

    def forget(self, request) -> None:
        self.outputs.pop(request.index, None)

    # ---- one step -----------------------------------------------------------------------------
    def prepare(self, output: SchedulerOutput) -> StepBatch:
        """The step's host arrays (`gpu_backend/input_batch.py`). Block tables are kept from
        step to step; the requests that finished in the previous step give theirs (and their
        sampled ids) up here, as vLLM's runner removes finished requests from its persistent
        batch at the next step."""
        last = self._last_output
        if last is not None:
            for request in last.finished:  # their sampled ids are no longer read either
                self.block_rows.drop(request)
                self.forget(request)
        for request in output.aborted or ():  # (clients that gave up; a retry samples its outputs anew)
            self.block_rows.drop(request)
            self.forget(request)
        self._last_output = output
        return prepare_step(self, self.block_rows, output)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def run(self, output: SchedulerOutput) -> list[int]:
        """Prepare, forward, sample greedily; returns the sampled ids (host ints)."""
        return self._step(output)[0]

    def forward_logits(self, output: SchedulerOutput) -> torch.Tensor:
        """Logits of the sampling rows (tests); samples like `run`. A copy: a decode graph's
        output buffer is overwritten by its next replay."""
        logits = self._step(output)[1]
        return None if logits is None else logits.clone()

    def _step(self, output: SchedulerOutput):
        t0 = time.perf_counter()
        self.last_graph_batch = self.last_piecewise_tokens = 0
        batch = self.prepare(output)
        if batch.input_ids.size == 0:
            self.last_host_times = (time.perf_counter() - t0, 0.0)
            return [], None
        if batch.max_seq_len > self.max_positions + 1:  # past the rotary tables: a device-side assert on CUDA
            raise ValueError(f"step {output.step} reaches position {batch.max_seq_len - 1}, past the model's "
                             f"{self.max_positions + 1} positions; raise --max-model-len")
        graphs = self.decode_graphs
        if graphs is not None and not output.chunks and graphs.fits(batch):
            t1 = time.perf_counter()
            logits = graphs.run(batch)  # decode-only: copied into static buffers, graph replayed
            self.last_graph_batch = graphs.bucket(len(batch.seq_lens))
        else:
            dev = self._to_device
            attn = AttentionInputs(dev(batch.slot_mapping), dev(batch.block_tables), dev(batch.seq_lens),
                                   dev(batch.query_start_loc), batch.max_query_len, batch.max_seq_len)
            logits_indices = dev(batch.logits_indices)
            pieces = self.piecewise_graphs
            if pieces is not None and pieces.fits(batch):
                t1 = time.perf_counter()
                logits = pieces.run(batch, attn, logits_indices)  # pieces replayed, attention eager between
                self.last_piecewise_tokens = pieces.bucket(len(batch.input_ids))
            else:
                input_ids, positions = dev(batch.input_ids), dev(batch.positions)
                t1 = time.perf_counter()
                logits = self.model.forward(input_ids, positions, attn, self.kv_caches, logits_indices, self.ops)
        self.last_host_times = (t1 - t0, time.perf_counter() - t1)
        sampled = torch.argmax(logits, dim=-1).tolist()  # the host copy synchronises the device
        for (request, position), token in zip(batch.samplers, sampled):
            self._record_sample(request, position, token)
        return sampled, logits

    def kv_pool_bytes(self) -> int:
        per = self.kv_caches[0][0].element_size() * self.kv_caches[0][0].numel() * 2
        return per * len(self.kv_caches)
