"""Errors of ``apir bench``: each is one line for the user, no traceback."""

from ..errors import ApirError


class BenchError(ApirError):
    """A benchmark that cannot run: unknown backend or shape, unreachable daemon, bad options."""


class BenchInputError(BenchError):
    """A results file ``apir bench compare`` cannot read (missing, unreadable, no records)."""
