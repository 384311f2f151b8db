"""What an importer read, kept and dropped."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ImportReport:
    """Counts of one import; ``dropped`` maps a reason to the number of rows dropped for it."""

    source: str
    rows_read: int = 0
    rows_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def drop(self, reason: str, count: int) -> None:
        if count:
            self.dropped[reason] = self.dropped.get(reason, 0) + int(count)

    def summary(self) -> str:
        """One line for the CLI."""
        text = f"read {self.rows_read:,} rows from {self.source}, kept {self.rows_kept:,}"
        if self.dropped:
            reasons = ", ".join(f"{count:,} with {reason}" for reason, count in sorted(self.dropped.items()))
            text += f"; dropped {sum(self.dropped.values()):,} ({reasons})"
        else:
            text += "; dropped none"
        return text + "".join(f"; {note}" for note in self.notes)
