"""scripts/file_gpu_results.py: a GPU check's bundle filed into reports/ and kernels/tuned/."""

import importlib.util
import json
import tarfile
from pathlib import Path

from kernels.tuning import FORMAT, FORMAT_VERSION, load_tuning

_spec = importlib.util.spec_from_file_location("file_gpu_results", Path(__file__).parents[2] / "scripts" / "file_gpu_results.py")
filing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(filing)


def fake_bundle(tmp: Path, adopted: bool = True) -> Path:
    run = tmp / "gc"
    (run / "bench").mkdir(parents=True)
    (run / "gpu_loop").mkdir()
    (run / "env.log").write_text("Tue Dec  1 10:00:00 UTC 2026\ntorch 2.11.0+cu130 cuda 13.0 triton 3.6.0\nNVIDIA H200\n")
    (run / "summary.md").write_text("# simkv kernel GPU check (2026-12-01 10:07 UTC)\n\n## Targets\n\n"
                                    "- decode: MET\n- prefill: NOT MET\n\nTotal time: 200s\n"
                                    "# simkv GPU backend loop\n\n## Comparison\n\n## Targets (gpu): NOT all pass\n\n"
                                    "- ttft_s.p50: -3.00 % (limit 5 %) pass\n")
    (run / "gpu_loop" / "loop_summary.md").write_text("loop\n")
    (run / "vision_encoder.json").write_text(json.dumps({  # (bench/vision_encoder.py's)
        "model": "qwen2.5-vl-7b", "device": "NVIDIA H200", "gpu_spec": "H200", "dtype": "torch.bfloat16", "tiny": False,
        "rows": [{"embeds": 1024, "patches": 4096, "measured_s": 0.0121, "roofline_s": 0.0095, "ratio": 1.27}]}))
    (run / "host_link.json").write_text(json.dumps({  # (bench/host_link.py's)
        "device": "NVIDIA H200", "smoke": False, "default_gbs": 63.0,
        "rows": [{"direction": "pinned host to GPU", "bytes": 64 << 20, "seconds": 0.0013, "gbs": 51.6},
                 {"direction": "pinned host to GPU", "bytes": 1 << 30, "seconds": 0.0196, "gbs": 54.8}]}))
    record = {"format": FORMAT, "format_version": FORMAT_VERSION, "device": "NVIDIA H200", "evidence": {}}
    if adopted:
        record["decode"] = {"tile_n": 16, "num_warps": 4, "num_stages": 4, "prefetch_ids": False, "tma_paged": True}
    (run / "bench" / "kernel_tuning.json").write_text(json.dumps(record))
    bundle = tmp / "bundle"
    bundle.mkdir()
    (bundle / "summary.md").write_text((run / "summary.md").read_text())
    with tarfile.open(bundle / "gpu_check.tgz", "w:gz") as tar:
        tar.add(run, arcname="gc")
    return bundle


def test_a_bundle_is_filed_under_its_date_and_gpu_with_its_tuning(tmp_path, capsys):
    repo = tmp_path / "repo"
    bundle = fake_bundle(tmp_path)
    assert filing.main([str(bundle), "--repo", str(repo), "--dry-run"]) == 0
    assert not (repo / "reports").exists() and not (repo / "kernels").exists()  # a dry run writes nothing
    assert filing.main([str(bundle), "--repo", str(repo)]) == 0
    filed = repo / "reports" / "gpu" / "2026-12-01_H200"
    assert (filed / "summary.md").is_file() and (filed / "gpu_loop" / "loop_summary.md").is_file()
    tuned = load_tuning(repo / "kernels" / "tuned" / "nvidia-h200.json")
    assert tuned.decode["tma_paged"] is True and tuned.prefill == {}
    out = capsys.readouterr().out
    assert "- decode: MET" in out and "Comparison / Targets (gpu): NOT all pass" in out and "ttft_s.p50" in out
    assert "1,024 embeddings: measured 12.10 ms, roofline 9.50 ms (1.27x)" in out
    assert "host link (NVIDIA H200), pinned host to GPU, 1,024 MiB: 54.8 GB/s (simkv's --pcie-bandwidth-gbs default 63)" in out
    # a second filing of a run that day gets its own folder and keeps the committed tuning
    assert filing.main([str(bundle / "gpu_check.tgz"), "--repo", str(repo)]) == 0
    assert (repo / "reports" / "gpu" / "2026-12-01_H200_2" / "summary.md").is_file()
    assert "exists (--replace-tuning overwrites it)" in capsys.readouterr().out


def test_nothing_adopted_commits_no_tuning_and_bad_sources_are_refused(tmp_path, capsys):
    repo = tmp_path / "repo"
    assert filing.main([str(fake_bundle(tmp_path, adopted=False)), "--repo", str(repo)]) == 0
    assert not (repo / "kernels" / "tuned").exists()
    assert filing.main([str(tmp_path / "missing"), "--repo", str(repo)]) == 2
    assert "neither a GPU check's OUTDIR" in capsys.readouterr().err
