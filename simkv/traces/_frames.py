"""pandas -> Arrow conversion that never raises Arrow's own errors for bad cells.

Columns Arrow cannot type (mixed ints and strings, stray objects) are turned into text so that
the column validators report the first offending row in the project's error format.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa

from simkv.traces.errors import TraceError


def frame_to_table(df: pd.DataFrame, source: str) -> pa.Table:
    """Convert a frame column by column (the index is dropped)."""
    if not isinstance(df, pd.DataFrame):
        raise TraceError(f"{source}: expected a pandas DataFrame, got {type(df).__name__}")
    names = [str(name) for name in df.columns]
    arrays = [_column(df.iloc[:, i], names[i]) for i in range(df.shape[1])]
    return pa.Table.from_arrays(arrays, names=names)


def _column(series: pd.Series, name: str) -> pa.Array:
    try:
        return pa.array(series, from_pandas=True)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return pa.array([_as_text(value) for value in series.tolist()], pa.string())


def _as_text(value: object) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, (list, tuple, np.ndarray)):
        return "[" + ", ".join(_json_item(item) for item in value) + "]"
    return str(value)


def _json_item(item: object) -> str:
    if isinstance(item, (bool, np.bool_)):
        return "true" if item else "false"
    if isinstance(item, (int, np.integer)):
        return str(int(item))
    return '"' + str(item).replace('"', "'") + '"'
