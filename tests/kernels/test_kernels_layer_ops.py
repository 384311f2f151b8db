"""The fused element-wise kernels (RMSNorm with the residual add, rotary embedding, SiLU-and-mul)
against their torch references (`kernels/layer_ops.py`): interpreter on CPU, compiled on CUDA."""
import pytest
import torch
from kernel_cases import assert_close_to_reference, device_params, make_batch

from kernels.layer_ops import (layer_ops, ref_fused_add_rms_norm, ref_rms_norm, ref_rotary_embedding,
                               ref_silu_and_mul)

# element-wise results are O(1); the kernels round once where torch rounds two or three times
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ops():
    from kernels import triton_layer_ops

    return triton_layer_ops


def _rand(*shape, dtype, device, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 80), (3, 1000)])
def test_rms_norm_and_fused_add_match_reference(device, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = _rand(rows, hidden, dtype=dtype, device=device, gen=gen, scale=3.0)
    res = _rand(rows, hidden, dtype=dtype, device=device, gen=gen)
    w = _rand(hidden, dtype=dtype, device=device, gen=gen) + 1
    eps = 1e-5
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(_ops().triton_rms_norm(x, w, eps), ref_rms_norm(x, w, eps), atol=atol, rtol=rtol)

    want_out, want_res = ref_fused_add_rms_norm(x.clone(), res.clone(), w, eps)
    x_in, res_in = x.clone(), res.clone()
    out, new_res = _ops().triton_fused_add_rms_norm(x_in, res_in, w, eps)
    # the residual sum is rounded exactly as torch's add rounds it (compiled; the interpreter's
    # casts to bf16 truncate, one unit in the last place); the norm within tolerance
    exact = 2.0 ** -7 if (dtype == torch.bfloat16 and device == "cpu") else 0.0
    torch.testing.assert_close(new_res, want_res, atol=0, rtol=exact)
    torch.testing.assert_close(out, want_out, atol=atol, rtol=rtol)
    # written in place, as vLLM's fused_add_rms_norm: the inputs are consumed
    assert out.data_ptr() == x_in.data_ptr() and new_res.data_ptr() == res_in.data_ptr()


@pytest.mark.parametrize("device", device_params())
def test_rms_norm_reads_strided_rows_and_takes_empty_batches(device):
    gen = torch.Generator().manual_seed(1)
    wide = _rand(4, 96, dtype=torch.float16, device=device, gen=gen)
    x = wide[:, 16:80]  # row stride 96, rows of 64
    w = _rand(64, dtype=torch.float16, device=device, gen=gen)
    torch.testing.assert_close(_ops().triton_rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6), atol=2e-3, rtol=2e-3)
    empty = torch.zeros(0, 64, dtype=torch.float16, device=device)
    assert _ops().triton_rms_norm(empty, w, 1e-6).shape == (0, 64)
    out, res = _ops().triton_fused_add_rms_norm(empty.clone(), empty.clone(), w, 1e-6)
    assert out.shape == res.shape == (0, 64)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,rotated,head_size", [(6, 4, 64), (12, 10, 80), (3, 2, 128), (24, 20, 16)])
def test_rotary_embedding_rotates_q_and_k_in_place(device, dtype, heads, rotated, head_size):
    gen = torch.Generator().manual_seed(heads * head_size)
    t = 7
    qkv = _rand(t, heads, head_size, dtype=dtype, device=device, gen=gen)
    angles = torch.rand(t, head_size // 2, generator=gen) * 50
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype=dtype, device=device)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype=dtype, device=device)
    original = qkv.clone()
    want = qkv.clone()
    ref_rotary_embedding(want, cos, sin, rotated)  # in place, as the kernel
    assert not torch.equal(want[:, :rotated], original[:, :rotated])
    _ops().triton_rotary_embedding(qkv, cos, sin, rotated)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(qkv[:, :rotated], want[:, :rotated], atol=atol, rtol=rtol)
    torch.testing.assert_close(qkv[:, rotated:], original[:, rotated:], atol=0, rtol=0)  # v untouched


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (4, 88), (2, 1500)])
def test_silu_and_mul_matches_reference(device, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = _rand(rows, 2 * inter, dtype=dtype, device=device, gen=gen, scale=4.0)
    atol, rtol = TOL[dtype]
    got = _ops().triton_silu_and_mul(gate_up)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, ref_silu_and_mul(gate_up), atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", device_params())
def test_layer_op_arguments_are_checked(device):
    ops = _ops()
    x = torch.zeros(2, 64, device=device)
    with pytest.raises(ValueError, match="weight must be"):
        ops.triton_rms_norm(x, torch.zeros(32, device=device), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        ops.triton_fused_add_rms_norm(x, torch.zeros(3, 64, device=device), torch.zeros(64, device=device), 1e-5)
    with pytest.raises(ValueError, match="even number of columns"):
        ops.triton_silu_and_mul(torch.zeros(2, 65, device=device))
    with pytest.raises(ValueError, match="num_rotated_heads"):
        ops.triton_rotary_embedding(torch.zeros(2, 4, 8, device=device), torch.zeros(2, 8, device=device),
                                    torch.zeros(2, 8, device=device), 5)
    with pytest.raises(ValueError, match="cos must be"):
        ops.triton_rotary_embedding(torch.zeros(2, 4, 8, device=device), torch.zeros(3, 8, device=device),
                                    torch.zeros(2, 8, device=device), 2)


def test_layer_op_sets():
    assert layer_ops("torch").rms_norm is ref_rms_norm
    fused = layer_ops("triton")
    assert fused.silu_and_mul.__name__ == "triton_silu_and_mul" and "fused Triton" in fused.name
    plain = layer_ops("triton", fused=False)
    assert plain.silu_and_mul is ref_silu_and_mul and plain.plan_attention.__name__ == "plan_paged_attention"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        layer_ops("cuda")


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("seqs", [[(0, 5), (17, 1), (30, 3)], [(40, 1), (9, 1)]], ids=["mixed", "split-KV decode"])
def test_one_plan_serves_every_layer_of_a_step(device, seqs):
    """A step's attention and KV write are planned at the first layer and launched for each
    layer's own query and caches (the split-KV scratch reused): every layer's output equals
    the reference's, and a layer whose shapes or strides differ from the plan is refused."""
    from kernels.reference import ref_paged_attention, ref_reshape_and_cache
    from kernels.triton_attention import plan_paged_attention
    from kernels.triton_cache import plan_reshape_and_cache

    import dataclasses

    b0 = make_batch(seqs, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32, device=device)
    gen = torch.Generator().manual_seed(7)

    def other(t):  # another layer's contents: unowned slots stay NaN
        return t + torch.randn(t.shape, generator=gen).to(device)

    layers = [b0] + [dataclasses.replace(b0, query=other(b0.query), key_cache=other(b0.key_cache),
                                         value_cache=other(b0.value_cache)) for _ in range(2)]
    segments = 2 if len(seqs) == 2 else None
    launch = plan_paged_attention(*b0.args(), max_query_len=b0.max_query_len, max_seq_len=b0.max_seq_len,
                                  num_segments=segments)
    assert launch.config.num_segments == (segments or launch.config.num_segments)
    for b in layers:
        # a layer's new K/V go into the slots of its last new tokens before it attends
        n = b.query.shape[0]
        gen = torch.Generator().manual_seed(n)
        k = torch.randn(n, 2, 64, generator=gen).to(device)
        v = torch.randn(n, 2, 64, generator=gen).to(device)
        slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        last = int(b.query_start_loc[1]) - 1  # the first sequence's last new token
        pos = int(b.seq_lens[0]) - 1
        slots[last] = int(b.block_tables[0, pos // 16]) * 16 + pos % 16
        ref_k, ref_v = b.key_cache.clone(), b.value_cache.clone()
        ref_reshape_and_cache(k, v, ref_k, ref_v, slots)
        write = plan_reshape_and_cache(k, v, b0.key_cache, b0.value_cache, slots)
        write(k, v, b.key_cache, b.value_cache)
        torch.testing.assert_close(b.key_cache, ref_k, equal_nan=True, atol=0, rtol=0)
        ref = ref_paged_attention(*b.args())
        assert_close_to_reference(launch(b.query, b.key_cache, b.value_cache), ref, torch.float32)
    with pytest.raises(ValueError, match="planned for query"):
        launch(b0.query[:-1], b0.key_cache, b0.value_cache)
    with pytest.raises(ValueError, match="planned for query"):
        launch(b0.query, b0.key_cache[:-1], b0.value_cache[:-1])
