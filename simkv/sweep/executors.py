"""Where cells run: a local process pool (spawn-safe) or tasks on a Ray cluster.
Each executor yields the worker's outcome dict as each cell finishes, in completion order."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from simkv.sweep.grid import SweepError
from simkv.sweep.worker import run_cell


def _crashed(task: dict, exc: BaseException) -> dict:
    """The outcome of a cell whose worker process died (the worker itself never raises)."""
    lines = str(exc).strip().splitlines()
    return {"cell_id": task["cell_id"], "status": "failed",
            "error": f"worker died: {type(exc).__name__}" + (f": {lines[0]}" if lines else ""), "detail": ""}


def run_local(tasks: list[dict], workers: int, work=run_cell) -> Iterator[dict]:
    """Run `work` (a module-level function: it is pickled) on every task, on `workers` spawned
    processes; a task whose process died comes back as a failed outcome with its `cell_id`."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    if not tasks:
        return
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(tasks))), mp_context=ctx) as pool:
        futures = {pool.submit(work, task): task for task in tasks}
        for fut in as_completed(futures):
            try:
                yield fut.result()
            except Exception as exc:  # noqa: BLE001 - e.g. BrokenProcessPool: that cell fails, not the sweep
                yield _crashed(futures[fut], exc)


def run_ray(tasks: list[dict], address: str | None) -> Iterator[dict]:
    """Run every task as a Ray task. Joins the running Ray instance if this process has one,
    else connects to `address` (or RAY_ADDRESS, or starts a local instance)."""
    try:
        import ray
    except ImportError:
        raise SweepError("--executor ray needs the ray package: pip install 'simkv[ray]'") from None
    if not tasks:
        return
    if not ray.is_initialized():
        import os

        joining = bool(address or os.environ.get("RAY_ADDRESS"))
        kwargs = {} if joining else {"include_dashboard": False}  # a new local instance: no dashboard
        try:
            ray.init(address=address, log_to_driver=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - ConnectionError and friends: one line for the user
            raise SweepError(f"--ray-address {address}: cannot connect to Ray ({exc})") from None
    remote = ray.remote(num_cpus=1, max_retries=0)(run_cell)
    # Ship each trace's bytes once through the object store: workers on other machines need no shared disk.
    blobs = {t["trace"]: ray.put(Path(t["trace"]).read_bytes()) for t in tasks if Path(t["trace"]).is_file()}
    pending = {remote.remote(task, blobs.get(task["trace"])): task for task in tasks}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            task = pending.pop(ref)
            try:
                yield ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - a task whose worker died
                yield _crashed(task, exc)
