"""The expert layers' token exchange between lockstep ranks (data-parallel or prefill-context-
parallel copies of a TP group) of a mixture of experts, as vLLM 0.33's MoE runs it. The roofline
(simkv/backends/roofline.py) adds it to every lockstep step; each function gives (seconds per
token of the whole step, over all ranks; fixed seconds per step).

- Gathered (`gather_exchange`: vLLM's default allgather_reducescatter backend, and its MoE
  without expert parallelism): every expert layer all-gathers every rank's tokens' hidden states
  (bf16) on every GPU and reduce-scatters the outputs: each GPU receives (g - 1) / g of the
  step's tokens twice, over the slowest link of the group.
- All-to-all (`all_to_all_exchange`: --enable-expert-parallel with DeepEP and the other
  all-to-all backends, priced alike): each GPU holds whole experts and sends each of its tokens
  (its 1 / g share of the step's: the TP ranks split their rank's tokens, vLLM's sequence-parallel
  MoE) to the GPUs holding the token's k experts, once per GPU, and gets the outputs back.
  Routing taken as uniform over the experts a token may reach (`token_gpus`): a token's k experts
  lie on c x (1 - (1 - 1 / c)^k) of the c GPUs holding them, all but 1 / g of them remote; of
  those, a node's share over NVLink and the rest over the network, both links at once. Without
  group-limited routing c = g; with it (DeepSeek-V3: its 256 experts in 8 groups, a token's 8
  from its best 4 groups, vLLM's grouped_topk) c is the GPUs holding the chosen groups' experts,
  laid out in order over the GPUs (16 GPUs: 8 of them, so 5.25 GPUs a token instead of 6.45),
  or all of them under --expert-placement-strategy round_robin, which spreads every group.
  Dispatch in fp8 with its block scales (1 + 4 / 128 bytes a value) for an FP8 checkpoint's
  experts (DeepEP quantizes before sending), else bf16; combine bf16. Not modelled: load
  imbalance, and the kernels' own efficiency (every byte at the link's rate).
"""

from __future__ import annotations

import math

from simkv.specs import ModelSpec

_BF16 = 2
_FP8_WITH_SCALES = 1 + 4 / 128


def gather_exchange(model: ModelSpec, num_gpus: int, link_gbs: float, latency_s: float) -> tuple[float, float]:
    """All-gather and reduce-scatter of every token over `num_gpus` GPUs, each expert layer."""
    per_token = 2 * model.num_moe_layers * (num_gpus - 1) / num_gpus * model.hidden_size * _BF16 / (link_gbs * 1e9)
    return per_token, 2 * model.num_moe_layers * latency_s


def all_to_all_exchange(model: ModelSpec, num_gpus: int, gpus_per_node: int, nvlink_gbs: float,
                        network_gbs: float, latency_s: float, round_robin: bool = False) -> tuple[float, float]:
    """Dispatch to and combine from the GPUs holding each token's experts, each expert layer, over
    an expert-parallel group of `num_gpus` GPUs laid out `gpus_per_node` to a node (the experts
    in order over the GPUs, or `round_robin`)."""
    g = num_gpus
    remote = token_gpus(model, g, round_robin) * (g - 1) / g  # GPUs a token goes to, other than its own
    dispatch = _FP8_WITH_SCALES if model.expert_weight_bytes == 1.0 else _BF16
    bytes_per_copy = model.hidden_size * (dispatch + _BF16)
    node = min(gpus_per_node, g)
    near, far = (node - 1) / (g - 1), (g - node) / (g - 1)  # shares of the remote GPUs in the node and beyond
    seconds_per_byte = max(near / (nvlink_gbs * 1e9), far / (network_gbs * 1e9))
    per_token = model.num_moe_layers * remote / g * bytes_per_copy * seconds_per_byte
    return per_token, 2 * model.num_moe_layers * latency_s


def token_gpus(model: ModelSpec, num_gpus: int, round_robin: bool = False) -> float:
    """The GPUs a token's k experts lie on, on average: k draws over the c GPUs holding the
    experts it may reach. All g of them; under group-limited routing with the experts laid out in
    order (vLLM's linear placement), those holding its topk_group groups: topk_group x g /
    n_group when a group spans whole GPUs, else the expected GPUs holding any of the chosen
    groups. Laid out round robin (expert e on GPU e mod g) every group spans every GPU, so c = g."""
    g, k = num_gpus, model.num_experts_per_tok
    c = float(g)
    if model.topk_group < model.n_group and not round_robin:
        if g % model.n_group == 0:  # (each group on g / n_group GPUs of its own)
            c = model.topk_group * g / model.n_group
        elif model.n_group % g == 0:  # (n_group / g groups on each GPU: it holds a chosen one unless all miss it)
            per_gpu = model.n_group // g
            c = g * (1 - math.comb(model.n_group - per_gpu, model.topk_group) / math.comb(model.n_group, model.topk_group))
    return c * (1 - (1 - 1 / c) ** k)
