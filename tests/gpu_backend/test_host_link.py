"""bench/host_link.py (the host link's copy rates, run by scripts/gpu_check.sh on a GPU): its
smoke mode runs anywhere and writes the rows the filing script reads."""

import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location("host_link", Path(__file__).parents[2] / "bench" / "host_link.py")
host_link = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_link)


def test_smoke_run_writes_its_rows(tmp_path, capsys):
    out = tmp_path / "host_link.json"
    assert host_link.main(["--smoke", "--repeats", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["smoke"] and record["default_gbs"] == 63.0 and len(record["rows"]) == 2
    assert all(row["gbs"] > 0 and row["bytes"] in (1 << 20, 4 << 20) for row in record["rows"])
    assert "| host to host (smoke) | 4 |" in capsys.readouterr().out
