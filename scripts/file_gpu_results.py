"""File what one `scripts/gpu_check.sh` run brought back into the repository.

    .venv/bin/python scripts/file_gpu_results.py SOURCE [--date YYYY-MM-DD] [--replace-tuning] [--dry-run]

SOURCE is the run's `gpu_check.tgz`, a folder holding it (the device tool's files_at), or the
run's OUTDIR itself. The script
- copies the run's folder (summary, logs, benchmark tables, the loop's calibration, replays and
  comparisons) to `reports/gpu/<date>_<GPU>/` (`_2`, `_3` ... when that exists), leaving out files
  over 20 MB;
- if the benchmark's sweep adopted tiles for a class (`bench/kernel_tuning.json`), commits them as
  `kernels/tuned/<device>.json`, which the GPU backend then uses on that GPU (kernels/tuning.py);
  an existing one is kept unless `--replace-tuning`; a CPU dry run's never;
- prints the tables to carry into reports/kernels.md and reports/gpu/README.md: the benchmark's
  targets, the loop's target verdicts and the vision encoder's times against its roofline.
Nothing is written with `--dry-run`; a destination is written under a temporary name, then renamed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_BYTES = 20 << 20


class FilingError(RuntimeError):
    """The source is not a GPU check's output (the message says what is missing)."""


def find_run(source: Path, scratch: Path) -> Path:
    """The run's OUTDIR (the folder with summary.md), extracting a tarball into `scratch` if needed."""
    if source.is_dir() and (source / "summary.md").is_file() and not (source / "gpu_check.tgz").is_file():
        return source
    tgz = source / "gpu_check.tgz" if source.is_dir() else source
    if not tgz.is_file():
        raise FilingError(f"{source}: neither a GPU check's OUTDIR (no summary.md) nor gpu_check.tgz")
    try:
        with tarfile.open(tgz) as tar:
            tar.extractall(scratch, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise FilingError(f"{tgz}: cannot unpack ({exc})") from None
    runs = [p.parent for p in scratch.glob("*/summary.md")]
    if len(runs) != 1:
        raise FilingError(f"{tgz}: expected one run folder with summary.md inside, found {len(runs)}")
    return runs[0]


def device_name(run: Path) -> str:
    """The GPU's name as torch reported it (env.log's last line), or the benchmark's."""
    env = run / "env.log"
    lines = env.read_text().splitlines() if env.is_file() else []
    for line in reversed(lines):
        if line.startswith("NVIDIA") or line.startswith("AMD") or line == "NO CUDA DEVICE":
            return line.strip()
    bench = run / "bench" / "bench.json"
    if bench.is_file():
        return str(json.loads(bench.read_text()).get("env", {}).get("gpu", "unknown"))
    return "unknown"


def short_name(device: str) -> str:
    """'NVIDIA H200' -> 'H200'; 'NVIDIA H100 80GB HBM3' -> 'H100'; otherwise the name's slug."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device)
    return m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-") or "unknown"


def run_date(run: Path) -> str | None:
    m = re.search(r"\((\d{4}-\d{2}-\d{2}) ", (run / "summary.md").read_text())
    return m.group(1) if m else None


def adopted_tuning(run: Path) -> dict | None:
    """The benchmark's tuning record if it adopted tiles for any class on a GPU, else None."""
    path = run / "bench" / "kernel_tuning.json"
    if not path.is_file():
        return None
    from kernels.tuning import load_tuning

    record = load_tuning(path).record
    dry = "dry run" in str(record.get("device", "")).lower()
    return record if not dry and (record.get("decode") or record.get("prefill")) else None


def copy_run(run: Path, dest: Path) -> list[str]:
    """Copy the run to `dest` (via a temporary sibling, then a rename); returns the files left out."""
    left_out = []
    tmp = dest.with_name(f".{dest.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)

    def ignore(folder, names):
        big = [n for n in names if (Path(folder) / n).is_file() and (Path(folder) / n).stat().st_size > MAX_FILE_BYTES]
        left_out.extend(str(Path(folder, n).relative_to(run)) for n in big)
        return big

    shutil.copytree(run, tmp, ignore=ignore)
    tmp.rename(dest)
    return left_out


def target_lines(run: Path) -> list[str]:
    """Every target verdict of summary.md (the benchmark's, then each comparison's of the loop),
    under the title of the section it belongs to."""
    out, keep, section = [], False, ""
    for line in (run / "summary.md").read_text().splitlines():
        if line.startswith("#"):
            keep = "Targets" in line
            if keep:
                out.append(f"{section} / {line.lstrip('# ')}" if section else line.lstrip("# "))
            elif line.startswith("## "):
                section = line[3:].strip()
            continue
        if keep and line.startswith("- "):
            out.append(line)
        elif keep and line.strip():
            keep = False
    return out


def vision_lines(run: Path) -> list[str]:
    """The vision encoder's times against the roofline (bench/vision_encoder.py), if it ran."""
    path = run / "vision_encoder.json"
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    return [f"- vision encoder ({record['model']}, {record['device']}), {row['embeds']:,} embeddings: measured "
            f"{1e3 * row['measured_s']:.2f} ms, roofline {1e3 * row['roofline_s']:.2f} ms ({row['ratio']:.2f}x)"
            + (f", activation peak {row['activation_peak_bytes'] / 2**30:.2f} GiB"
               if row.get("activation_peak_bytes") else "")
            + (f" (simkv's estimate {row['estimated_activation_bytes'] / 2**30:.2f} GiB)"
               if row.get("activation_peak_bytes") and row.get("estimated_activation_bytes") else "")
            for row in record["rows"]]


def host_link_lines(run: Path) -> list[str]:
    """The host link's measured copy rates (bench/host_link.py), if it ran, beside simkv's default."""
    path = run / "host_link.json"
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    largest = max(row["bytes"] for row in record["rows"])
    return [f"- host link ({record['device']}), {row['direction']}, {largest >> 20:,} MiB: {row['gbs']:.1f} GB/s "
            f"(simkv's --pcie-bandwidth-gbs default {record['default_gbs']:g})"
            for row in record["rows"] if row["bytes"] == largest]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("--date", default=None, help="YYYY-MM-DD of the folder name [default: the run's]")
    ap.add_argument("--repo", type=Path, default=ROOT, help="repository root [default: this one]")
    ap.add_argument("--replace-tuning", action="store_true", help="overwrite a committed kernels/tuned/<device>.json")
    ap.add_argument("--dry-run", action="store_true", help="say what would be written, write nothing")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from kernels.tuning import device_slug, write_tuning

    with tempfile.TemporaryDirectory() as scratch:
        try:
            run = find_run(args.source, Path(scratch))
        except FilingError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        device = device_name(run)
        date = args.date or run_date(run) or "undated"
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}|undated", date):
            print(f"error: --date must be YYYY-MM-DD, got {date!r}", file=sys.stderr)
            return 2
        reports = args.repo / "reports" / "gpu"
        dest = reports / f"{date}_{short_name(device)}"
        k = 2
        while dest.exists():
            dest = reports / f"{date}_{short_name(device)}_{k}"
            k += 1
        tuning = adopted_tuning(run)
        tuned_path = args.repo / "kernels" / "tuned" / f"{device_slug(device)}.json"
        print(f"run: {run.name} on {device} ({date})")
        if args.dry_run:
            print(f"would copy it to {dest.relative_to(args.repo)}")
        else:
            reports.mkdir(parents=True, exist_ok=True)
            left_out = copy_run(run, dest)
            print(f"copied to {dest.relative_to(args.repo)}" + (f"; left out (over 20 MB): {', '.join(left_out)}"
                                                                if left_out else ""))
        if tuning is None:
            print("kernel tuning: nothing adopted (or a CPU dry run): no kernels/tuned/ file")
        elif tuned_path.exists() and not args.replace_tuning:
            print(f"kernel tuning: adopted tiles, but {tuned_path.relative_to(args.repo)} exists (--replace-tuning "
                  "overwrites it)")
        elif args.dry_run:
            print(f"kernel tuning: would write {tuned_path.relative_to(args.repo)}")
        else:
            tuned_path.parent.mkdir(parents=True, exist_ok=True)
            write_tuning(tuned_path, tuning)
            print(f"kernel tuning: wrote {tuned_path.relative_to(args.repo)} "
                  f"(decode {tuning.get('decode') or 'heuristic'}; prefill {tuning.get('prefill') or 'heuristic'})")
        lines = target_lines(run) + vision_lines(run) + host_link_lines(run)
        if lines:
            print("\nfor reports/kernels.md and reports/gpu/README.md:\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
