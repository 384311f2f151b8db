"""Checks every test makes on the way: a step (or decode run) that leaves requests waiting names
the limit that held them (simkv/core/admission_limits.py), one that leaves none names none. The
recorded vLLM cases and every replay in the suite drive their schedules through this."""

import pytest

from simkv.core.admission_limits import ADMISSION_LIMITS, NONE
from simkv.core.scheduler import Scheduler


def _check(step: int, num_waiting: int, limit: int) -> None:
    assert (limit != NONE) == (num_waiting > 0), (
        f"step {step}: {num_waiting} waiting, admission limit {ADMISSION_LIMITS[limit]}")


@pytest.fixture(autouse=True)
def _waiting_steps_name_their_limit(monkeypatch):
    schedule, advance = Scheduler.schedule, Scheduler.advance_decode_run

    def checked_schedule(self):
        out = schedule(self)
        _check(out.step, out.num_waiting, out.admission_limit)
        return out

    def checked_advance(self, *args, **kwargs):
        run = advance(self, *args, **kwargs)
        if run is not None:
            _check(run.start_step, run.num_waiting, run.admission_limit)
        return run

    monkeypatch.setattr(Scheduler, "schedule", checked_schedule)
    monkeypatch.setattr(Scheduler, "advance_decode_run", checked_advance)
