"""Trace replay: SimPy processes around the engine core, and the files a replay writes."""
