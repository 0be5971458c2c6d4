"""The one error type of the benchmark: a message for the user, shown without a traceback."""

from __future__ import annotations


class BenchmarkError(Exception):
    """Bad input or an unreachable server: the message says what is wrong and how to fix it."""
