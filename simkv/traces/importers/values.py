"""Small helpers shared by the record-by-record importers."""
from __future__ import annotations

from simkv.traces._columns import MAX_TOKENS
from simkv.traces.errors import TraceError


def whole_number(value: object, where: str) -> int:
    """A JSON token count: an int (or integral float) in [0, MAX_TOKENS]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(f"{where}: expected a whole number >= 0, got {str(value)[:30]!r}")
    if isinstance(value, float) and not value.is_integer():
        raise TraceError(f"{where}: expected a whole number >= 0, got {value!r}")
    if not 0 <= value <= MAX_TOKENS:
        raise TraceError(f"{where}: value {value!r} is out of range (0 .. {MAX_TOKENS})")
    return int(value)


class BatchBuffer:
    """Column lists filled row by row: arrival, prompt, output, hash list."""

    def __init__(self) -> None:
        self._columns: tuple[list, list, list, list] = ([], [], [], [])

    def add(self, arrival: float, prompt: int, output: int, hashes: list[int]) -> None:
        for column, value in zip(self._columns, (arrival, prompt, output, hashes)):
            column.append(value)

    def __len__(self) -> int:
        return len(self._columns[0])

    def take(self) -> tuple[list, list, list, list]:
        columns, self._columns = self._columns, ([], [], [], [])
        return columns
