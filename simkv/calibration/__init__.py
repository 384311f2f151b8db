"""Calibration: measure step shapes on the real backend, fit a cost model, use it in replays.

`costmodel` (formula, calib.json loading/validation) needs numpy only; `profile` needs torch
and `gpu_backend`, imported when a calibration actually runs.
"""

from simkv.calibration.costmodel import (CalibratedCostModel, CalibrationError, check_calibration,
                                         cost_model_from_file, load_calibration)

__all__ = ["CalibratedCostModel", "CalibrationError", "check_calibration", "cost_model_from_file",
           "load_calibration"]
