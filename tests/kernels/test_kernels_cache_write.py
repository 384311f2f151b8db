"""reshape_and_cache: Triton kernel vs the torch reference (bit-exact copies)."""
import pytest
import torch
from kernel_cases import device_params

from kernels import ref_reshape_and_cache
from kernels.layout import allocate_kv_cache


def _run(device, dtype, num_kv_heads, head_size, block_size, num_tokens, num_blocks=6, seed=0):
    from kernels.triton_cache import triton_reshape_and_cache

    gen = torch.Generator().manual_seed(seed)
    key = torch.randn((num_tokens, num_kv_heads, head_size), generator=gen).to(device=device, dtype=dtype)
    value = torch.randn((num_tokens, num_kv_heads, head_size), generator=gen).to(device=device, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding tokens
    slots = slots.to(device=device, dtype=torch.int64)
    kc, vc = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, device, fill=float("nan"))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    triton_reshape_and_cache(key, value, kc, vc, slots)
    ref_reshape_and_cache(key, value, kc_ref, vc_ref, slots)
    # equal_nan: slots never written must still hold NaN in both
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(vc.isnan(), vc_ref.isnan())
    torch.testing.assert_close(kc, kc_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, equal_nan=True)
    written = int((slots >= 0).sum())
    assert int((~kc[..., 0].isnan()).sum()) == written * num_kv_heads


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_size,block_size", [(1, 64, 16), (2, 80, 32), (4, 96, 16), (2, 128, 8)])
def test_reshape_and_cache_matches_reference(device, dtype, num_kv_heads, head_size, block_size):
    _run(device, dtype, num_kv_heads, head_size, block_size, num_tokens=7)


@pytest.mark.parametrize("device", device_params())
def test_reshape_and_cache_wide_rows_and_strided_input(device):
    """A row wider than one program's chunk, and K/V taken as views of a fused QKV tensor."""
    from kernels.triton_cache import triton_reshape_and_cache

    n, hkv, d, bs = 5, 24, 128, 16  # row = 3072 > 2048 elements -> 2 programs per token
    qkv = torch.randn((n, 3 * hkv, d)).to(device=device, dtype=torch.float16)
    key, value = qkv[:, hkv:2 * hkv], qkv[:, 2 * hkv:]
    slots = torch.tensor([3, -1, 17, 40, 0], dtype=torch.int64, device=device)
    kc, vc = allocate_kv_cache(4, bs, hkv, d, torch.float16, device, fill=float("nan"))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    triton_reshape_and_cache(key, value, kc, vc, slots)
    ref_reshape_and_cache(key, value, kc_ref, vc_ref, slots)
    torch.testing.assert_close(kc, kc_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("device", device_params())
def test_reshape_and_cache_all_padding_and_empty(device):
    from kernels.triton_cache import triton_reshape_and_cache

    kc, vc = allocate_kv_cache(2, 16, 1, 64, torch.float16, device, fill=float("nan"))
    key = torch.ones((3, 1, 64), dtype=torch.float16, device=device)
    triton_reshape_and_cache(key, key, kc, vc, torch.full((3,), -1, dtype=torch.int64, device=device))
    assert kc.isnan().all() and vc.isnan().all()
    empty = key[:0]
    triton_reshape_and_cache(empty, empty, kc, vc, torch.empty((0,), dtype=torch.int64, device=device))
    assert kc.isnan().all()


def test_reshape_and_cache_rejects_bad_arguments():
    from kernels.triton_cache import _check_cache_args

    kc, vc = allocate_kv_cache(2, 16, 2, 64, torch.float16)
    key = torch.zeros((3, 2, 64), dtype=torch.float16)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="slot_mapping"):
        _check_cache_args(key, key, kc, vc, slots[:2])
    with pytest.raises(ValueError, match="int64"):
        _check_cache_args(key, key, kc, vc, slots.float())
    with pytest.raises(ValueError, match="heads/head_size"):
        _check_cache_args(key[:, :1], key[:, :1], kc, vc, slots)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        _check_cache_args(key.transpose(1, 2).contiguous().transpose(1, 2), key, kc, vc, slots)
    with pytest.raises(ValueError, match="differ"):
        _check_cache_args(key, key[:2], kc, vc, slots)
