"""The sweep folder: DIR/cells/<cell-id>/summary.json (finished) or error.txt (failed), written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename it into place: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def cell_dir(out_dir: Path, cell_id: str) -> Path:
    return out_dir / "cells" / cell_id


def load_finished(out_dir: Path, cell_id: str) -> dict | None:
    """The summary of a cell finished by an earlier run, or None (absent or unreadable: run it again)."""
    path = cell_dir(out_dir, cell_id) / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def record(out_dir: Path, outcome: dict, cell_spec: dict) -> None:
    """Store one worker outcome: summary.json for a finished cell, error.txt for a failed one."""
    folder = cell_dir(out_dir, outcome["cell_id"])
    if outcome["status"] == "ok":
        atomic_write_text(folder / "summary.json", json.dumps(outcome["summary"], indent=2) + "\n")
        (folder / "error.txt").unlink(missing_ok=True)
    else:
        text = (outcome["error"] + "\n\ncell: " + json.dumps(cell_spec, sort_keys=True) + "\n"
                + (("\n" + outcome["detail"]) if outcome.get("detail") else ""))
        atomic_write_text(folder / "error.txt", text)
