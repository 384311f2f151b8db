"""Simple cost models: `unit` (every step lasts 1 s) and `linear` (base + per-token)."""

from __future__ import annotations

import numpy as np

from simkv.core.outputs import SchedulerOutput
from simkv.clock import TICKS_PER_SECOND, to_ticks


class UnitCostModel:
    """Every step lasts exactly 1 s: simulated time counts steps (the reference model)."""

    name = "unit"
    supports_decode_runs = True
    needs_request_detail = False

    def execute(self, output: SchedulerOutput) -> float:
        return 1.0

    def decode_step_line(self, num_decodes: int) -> tuple[int, int, int, int]:
        return TICKS_PER_SECOND, 0, TICKS_PER_SECOND, 0

    def predict_features(self, features: np.ndarray) -> np.ndarray:
        """`execute` for an [N, 5] array of step features (T, S, Pp, Kp, Kd): measured steps."""
        return np.ones(len(features))

    def describe(self) -> dict:
        return {"cost_model": "unit"}


class LinearCostModel:
    """step = step_base_s + step_per_token_s * tokens scheduled (the oracle's time mode)."""

    name = "linear"
    supports_decode_runs = True
    needs_request_detail = False

    def __init__(self, step_base_s: float, step_per_token_s: float) -> None:
        if step_base_s < 0 or step_per_token_s < 0 or step_base_s + step_per_token_s <= 0:
            raise ValueError("--step-base-s and --step-per-token-s must be >= 0 and not both 0")
        self.step_base_s = step_base_s
        self.step_per_token_s = step_per_token_s

    def execute(self, output: SchedulerOutput) -> float:
        return self.step_base_s + self.step_per_token_s * output.total_num_scheduled_tokens

    def decode_step_line(self, num_decodes: int) -> tuple[int, int, int, int]:
        step = to_ticks(self.step_base_s + self.step_per_token_s * num_decodes)
        return step, 0, step, 0

    def predict_features(self, features: np.ndarray) -> np.ndarray:
        """`execute` for an [N, 5] array of step features (T, S, Pp, Kp, Kd): measured steps."""
        return self.step_base_s + self.step_per_token_s * np.asarray(features, dtype=np.int64)[:, 0]

    def describe(self) -> dict:
        return {"cost_model": "linear", "step_base_s": self.step_base_s, "step_per_token_s": self.step_per_token_s}
