"""Measured tile choices (kernels/tuning.py): the file's checks, where a tuning applies, what it
changes in the tile choice, and a model forward on tuned tiles against the reference runner."""
import json

import pytest
import torch
from kernel_cases import device_params

from kernels import tuning as kt
from kernels.layer_ops import layer_ops
from kernels.triton_attention import choose_config


def record(**classes) -> dict:
    return {"format": kt.FORMAT, "format_version": kt.FORMAT_VERSION, "device": "NVIDIA H200", **classes}


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(kt, "_cache", {})
    monkeypatch.delenv(kt.ENV_VAR, raising=False)


@pytest.mark.parametrize("classes, message", [
    ({"decode": {"block_m": 32}}, "'decode.block_m' is not a tunable field"),
    ({"prefill": {"tile_n": 48}}, "'prefill.tile_n' must be a power of two"),
    ({"prefill": {"num_warps": 32}}, r"'prefill.num_warps' must be an integer in \[1, 16\]"),
    ({"decode": {"num_stages": True}}, "'decode.num_stages' must be an integer"),
    ({"prefill": {"new_kv": 1}}, "'prefill.new_kv' must be true or false"),
    ({"decode": [64]}, "'decode' must be an object"),
    ({"prefill": {"tma_new_kv": True}}, "'prefill.tma_new_kv' reads the new_kv tiles: it needs 'prefill.new_kv' true"),
    ({"decode": {"tma_new_kv": True}}, "'decode.tma_new_kv' is not a tunable field"),
])
def test_a_bad_field_is_named_with_the_file(tmp_path, classes, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(record(**classes)))
    with pytest.raises(kt.TuningError, match=message) as err:
        kt.load_tuning(path)
    assert str(path) in str(err.value)


def test_a_file_of_another_format_or_not_json_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**record(), "format_version": 2}))
    with pytest.raises(kt.TuningError, match="'format_version' 2 is not supported"):
        kt.load_tuning(path)
    path.write_text(json.dumps({**record(), "format": "calib"}))
    with pytest.raises(kt.TuningError, match="'format' must be"):
        kt.load_tuning(path)
    path.write_text("{")
    with pytest.raises(kt.TuningError, match="not valid JSON"):
        kt.load_tuning(path)
    with pytest.raises(kt.TuningError, match="cannot read"):
        kt.load_tuning(tmp_path / "missing.json")


def test_write_is_checked_first_and_leaves_nothing_half_written(tmp_path):
    path = tmp_path / "t.json"
    with pytest.raises(kt.TuningError):
        kt.write_tuning(path, record(decode={"tile_n": 3}))
    assert list(tmp_path.iterdir()) == []
    kt.write_tuning(path, record(decode={"tile_n": 32, "prefetch_ids": True}, evidence={"x": 1}))
    assert kt.load_tuning(path).decode == {"tile_n": 32, "prefetch_ids": True}
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_where_a_tuning_applies(tmp_path, monkeypatch):
    shipped = tmp_path / "tuned"
    shipped.mkdir()
    (shipped / "nvidia-h200.json").write_text(json.dumps(record(decode={"num_warps": 8})))
    monkeypatch.setattr(kt, "TUNED_DIR", shipped)
    assert kt.device_slug("NVIDIA H200") == "nvidia-h200"
    assert kt.active_tuning("NVIDIA H200").decode == {"num_warps": 8}  # the committed file of the device
    assert kt.active_tuning("NVIDIA H100 80GB HBM3") is None  # none committed: the heuristic
    own = tmp_path / "mine.json"
    own.write_text(json.dumps(record(prefill={"tile_n": 32})))
    monkeypatch.setenv(kt.ENV_VAR, str(own))
    assert kt.active_tuning("cpu").prefill == {"tile_n": 32}  # an explicit file applies on any device
    monkeypatch.setenv(kt.ENV_VAR, "off")
    assert kt.active_tuning("NVIDIA H200") is None
    nothing = tmp_path / "nothing.json"  # a sweep that adopted nothing: the heuristic, no fingerprint
    nothing.write_text(json.dumps(record(evidence={"decode": {"adopted": False}})))
    monkeypatch.setenv(kt.ENV_VAR, str(nothing))
    assert kt.load_tuning(nothing).decode == {} and kt.active_tuning("NVIDIA H200") is None
    monkeypatch.setenv(kt.ENV_VAR, str(tmp_path / "nope.json"))
    with pytest.raises(kt.TuningError, match="SIMKV_KERNEL_TUNING=.*nope.json: no such file"):
        kt.active_tuning("NVIDIA H200")


def test_the_fingerprint_tells_tiles_apart_and_the_op_set_name_carries_it():
    a = kt.tuning_from_dict(record(decode={"tile_n": 32}), "a")
    b = kt.tuning_from_dict(record(decode={"tile_n": 32}, evidence={"other": "numbers"}), "b")
    c = kt.tuning_from_dict(record(decode={"tile_n": 64}), "c")
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert a.label.startswith(f"tuned tiles {a.fingerprint} (decode tile_n=32")
    assert a.fingerprint in layer_ops("triton", tuning=a).name
    assert layer_ops("triton").name == "triton attention, fused Triton element-wise ops"  # as older files recorded
    assert layer_ops("torch", tuning=a).name == layer_ops("torch").name  # tiles are the Triton launcher's


def _choose(tuning, *, elem_size=2, max_query_len=1, head_pad=128, num_seqs=8, max_seq_len=32768):
    return choose_config(qpk=4, head_pad=head_pad, elem_size=elem_size, num_seqs=num_seqs, num_kv_heads=8,
                         max_query_len=max_query_len, max_seq_len=max_seq_len, num_sms=132, tuning=tuning)


def test_overrides_apply_to_their_class_of_half_precision_launches_only():
    t = kt.tuning_from_dict(record(decode={"tile_n": 32, "num_stages": 3, "prefetch_ids": True},
                                   prefill={"block_m": 16, "tile_n": 32, "num_warps": 4, "new_kv": True}))
    plain_decode, decode = _choose(None), _choose(t)
    assert (decode.tile_n, decode.num_stages, decode.prefetch_ids, decode.num_warps) == (32, 3, True, 4)
    assert decode.block_m == plain_decode.block_m == 16 and decode.num_segments == plain_decode.num_segments
    # the split follows the tuned tile: fewer keys per tile, more tiles to split
    few = _choose(t, num_seqs=128, max_seq_len=512)
    assert few.num_segments >= _choose(None, num_seqs=128, max_seq_len=512).num_segments
    prefill = _choose(t, max_query_len=4096)
    # block_m never below the query heads of a KV head (a tile holds whole GQA groups): 16 >= qpk 4 here
    assert (prefill.block_m, prefill.tile_n, prefill.num_warps, prefill.num_stages, prefill.new_kv) == (16, 32, 4, 3, True)
    assert _choose(t, elem_size=4) == _choose(None, elem_size=4)  # fp32 decode: the heuristic
    assert _choose(t, elem_size=4, max_query_len=4096) == _choose(None, elem_size=4, max_query_len=4096)
    assert _choose(t, max_query_len=8) == _choose(None, max_query_len=8)  # short chunks: the heuristic
    assert _choose(t, max_query_len=4096, head_pad=256) == _choose(None, max_query_len=4096, head_pad=256)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_a_forward_on_tuned_tiles_matches_the_reference_runner(device, tma, monkeypatch, tmp_path):
    """tiny-llama steps (long chunks, prefix hits, decodes) on tuned tiles, new_kv (read by
    pointers or by TMA copies from the fused QKV output) and prefetched block ids included,
    against the torch-reference runner; every launch took the tuned tiles. With TMA, decode-only
    steps also run from the decode graphs (captured on CUDA: the descriptors' scratch memory is
    allocated inside the capture) with each cache block a TMA copy (tma_paged)."""
    import kernels.triton_attention as ta
    from gpu_backend.runner import ModelRunner
    from simkv.config import EngineConfig
    from simkv.core.request import Request
    from simkv.core.scheduler import Scheduler
    from tests.gpu_backend.lockstep import lockstep

    path = tmp_path / "kernel_tuning.json"
    decode_tiles = {"tile_n": 16, "num_stages": 3} | ({"tma_paged": True} if tma else {"prefetch_ids": True})
    kt.write_tuning(path, record(decode=decode_tiles,
                                 prefill={"block_m": 64, "tile_n": 16, "num_warps": 4, "num_stages": 3,
                                          "new_kv": True, "prefetch_ids": True, "tma_new_kv": tma}))
    monkeypatch.setenv(kt.ENV_VAR, str(path))
    configs = []

    class Recording(ta.PagedAttentionLaunch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            configs.append(self.config)

    monkeypatch.setattr(ta, "PagedAttentionLaunch", Recording)
    config = EngineConfig.from_flat({"model": "tiny-llama", "num_gpu_blocks": 48, "block_size": 16,
                                     "max_num_batched_tokens": 96, "max_num_seqs": 6})
    sched = Scheduler(config, 48, detail=True)
    ref = ModelRunner("tiny-llama", 48, 16, device, "fp16", seed=5, kernel_backend="torch")
    tri = ModelRunner("tiny-llama", 48, 16, device, "fp16", seed=5, kernel_backend="triton")
    assert tri.kernel_tuning is not None and tri.kernel_tuning.fingerprint in tri.ops.name
    graphed = []
    if tma:
        tri.enable_decode_graphs(6, capture=device == "cuda")
        assert tri.decode_graphs is not None, tri.decode_graphs_status
        run = tri.decode_graphs.run
        tri.decode_graphs.run = lambda batch: graphed.append(len(batch.seq_lens)) or run(batch)
    for k, v in tri.kv_caches:  # never-written slots are NaN: a read outside a table shows
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    shared = [11, 12, 13]  # three blocks of prompt content shared by b and c
    requests = [Request("a", 0, 0.0, 70, 3), Request("b", 1, 0.0, 60, 3, shared_hash_ids=shared, hash_block_tokens=16),
                Request("c", 2, 0.0, 52, 2, shared_hash_ids=shared, hash_block_tokens=16)]
    steps = 0
    for _, a, b in lockstep(sched, requests, ref, tri, share_tokens=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b.float(), a.float(), rtol=3e-2, atol=3e-2)
        steps += 1
    prefill = [c for c in configs if c.block_m == 64]
    decode = [c for c in configs if c.block_m == 16]
    assert prefill and all(c.new_kv and c.prefetch_ids and c.tma_new_kv == tma and c.tile_n == 16 and c.num_warps == 4
                           for c in prefill)
    assert decode and all(c.tile_n == 16 and c.num_stages == 3 and (c.tma_paged if tma else c.prefetch_ids)
                          for c in decode)
    assert bool(graphed) == tma  # decode-only steps went through the decode graphs
    assert requests[2].num_prefix_hit_tokens > 0  # c attended over cached context it did not compute


def test_tuned_tma_cache_tiles_fall_back_where_a_tile_is_not_one_block():
    """A device's tuning may choose one-block TMA tiles (measured on block size 16); on a pool of
    32-slot blocks that launch reads by pointers instead, while an explicit config is refused."""
    from dataclasses import replace

    from kernel_cases import make_batch

    from kernels.triton_attention import plan_paged_attention

    t = kt.tuning_from_dict(record(decode={"tile_n": 16, "num_stages": 4, "tma_paged": True}))
    for block_size, expect in ((16, True), (32, False)):
        batch = make_batch([(40, 1), (70, 1)], num_heads=8, num_kv_heads=2, head_size=64, block_size=block_size,
                           dtype=torch.float16, device="cpu")
        launch = plan_paged_attention(*batch.args(), max_query_len=1, max_seq_len=71, tuning=t)
        assert launch.config.tma_paged is expect and launch.config.tile_n == 16
        if not expect:
            with pytest.raises(ValueError, match="a tile must be one cache block"):
                plan_paged_attention(*batch.args(), max_query_len=1, config=replace(launch.config, tma_paged=True))
