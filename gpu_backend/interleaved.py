"""Calibration grid points timed between the steps of a measured replay (`--calibrate-alongside`).

A host whose speed drifts (this project's 2-core CPU machine runs in two regimes about 1.6x
apart that switch within seconds; docs/gpu_backend.md) makes a calibration taken before a replay
miss it by the drift, whatever the cost model. Timing the grid between the replay's steps puts
both in the same regimes in the same proportions. Nothing else is shared: the grid is the
usual designed set of synthetic shapes, run on a sibling runner (same weights, a KV pool of its
own, decode graphs of its own), never the replay's steps, and the replay's step durations are
measured exactly as without it (the grid runs outside their timing). The replay takes about
twice as long in wall time. On a GPU, whose clocks hold steady, the separate `simkv calibrate`
is the normal path.
"""

from __future__ import annotations

from pathlib import Path

from gpu_backend.runner import dtype_name

#: grid points timed after each replay step
POINTS_PER_STEP = 2
#: samples every point has before the fit (topped up after the replay if the replay was short)
MIN_SAMPLES = 3


class InterleavedGrid:
    def __init__(self, runner, config, preset: str | None = None, seed: int = 0, enforce_eager: bool = False,
                 points_per_step: int = POINTS_PER_STEP, cudagraph_mode: str = "full_decode_only") -> None:
        from gpu_backend.backend import StepTimer, prepare_for_timing
        from gpu_backend.synthetic import synthetic_output
        from simkv.calibration.grid import build_grid
        from simkv.calibration.profile import activation_reserve, plan_pool_blocks

        sched = config.scheduler
        self.preset = preset or ("default" if runner.device.type == "cuda" else "tiny")
        self.seed = seed
        args = (self.preset, sched.max_num_batched_tokens, sched.max_num_seqs, runner.spec.max_position_embeddings)
        points, _ = build_grid(*args, None, runner.block_size, seed)
        # the largest point's blocks, capped by what the device has left beside the replay's pool;
        # points that do not fit are dropped (and listed), as `simkv calibrate` does
        cuda = runner.device.type == "cuda"
        num_blocks = plan_pool_blocks(points, runner.block_size, runner.bytes_per_block(), runner.device.type,
                                      activation_reserve(runner.spec, sched.max_num_batched_tokens) if cuda else 0)
        self.points, self.dropped = build_grid(*args, num_blocks, runner.block_size, seed)
        if not self.points:
            raise ValueError(f"no calibration grid point fits the {num_blocks} KV blocks left beside the replay's pool")
        self.runner = runner.sibling(num_blocks)
        self.num_blocks = num_blocks
        prepare_for_timing(self.runner, 2, sched.max_num_seqs, enforce_eager, cudagraph_mode)
        self.outputs = [synthetic_output(p.prefills, p.decodes, runner.block_size, num_blocks) for p in self.points]
        self.samples: list[list[float]] = [[] for _ in self.points]
        self.timer = StepTimer(self.runner.device)
        self.points_per_step = points_per_step
        self.next = 0
        self.steps = 0
        for out in self.outputs:  # warm-up: every shape once, untimed
            self._run(out)

    def _run(self, out) -> None:
        from gpu_backend.synthetic import run_synthetic

        run_synthetic(self.runner, out)

    def _time_next(self) -> None:
        i = self.next % len(self.points)
        self.next += 1
        self.samples[i].append(self.timer.time(self._run, self.outputs[i])[1])

    def after_step(self) -> None:
        """Called by the backend after each replay step (outside the step's timing)."""
        self.steps += 1
        for _ in range(self.points_per_step):
            self._time_next()

    def record(self, model: str, statistic: str = "median", holdout_fraction: float = 0.2) -> dict:
        """The calib.json record: every point's samples (topped up to MIN_SAMPLES), and the fit."""
        from simkv.calibration.fit import fit_rows
        from simkv.calibration.profile import grid_row, new_record

        while min(len(s) for s in self.samples) < MIN_SAMPLES:
            self._time_next()
        r = self.runner
        rec = new_record(model, r, dtype_name(r.dtype), self.preset, self.points, self.dropped, self.num_blocks,
                         {"preset": self.preset, "statistic": statistic, "seed": self.seed,
                          "protocol": f"interleaved: {self.points_per_step} grid points timed after each of the "
                                      f"{self.steps} steps of a measured replay, in turn"})
        rec.update(r.graph_fields())
        rec["grid"]["measured"] = [grid_row(p, samples, statistic) for p, samples in zip(self.points, self.samples)]
        rec["rounds"] = min(len(s) for s in self.samples)
        rec["fit"] = fit_rows(rec["grid"]["measured"], holdout_fraction, self.seed, graph_sizes=r.graph_sizes,
                              piecewise_sizes=r.piecewise_sizes)
        rec["complete"] = True
        return rec

    def write(self, path: str | Path, model: str, statistic: str = "median") -> dict:
        from simkv.calibration.profile import write_json_atomic

        rec = self.record(model, statistic)
        write_json_atomic(Path(path), rec)
        return rec
