"""Engine core: block pool, KV-cache manager and scheduler.

The core is synchronous and knows no clock: it imports neither SimPy nor torch. A driver
(the SimPy replay, or the GPU backend's runner) calls `Scheduler.schedule()`, executes the
returned step somewhere, then calls `Scheduler.update_from_output()`.
"""
