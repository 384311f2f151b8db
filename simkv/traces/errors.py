"""The one error type of the traces package."""


class TraceError(ValueError):
    """A trace file or option is invalid.

    The message is one line: ``"<file>: column '<col>', row <i>: <what is wrong>"`` for a bad cell
    (row = 0-based data row of the file), or ``"<file>: <what is wrong>"`` for file-level problems.
    """
