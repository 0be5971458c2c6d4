"""User-facing errors.

Every error a user can cause (a bad path, a corrupt file, an unsupported model) is a
`QserveError`. Its message says what is wrong and how to fix it; the command line prints
the message alone, without a traceback.
"""


class QserveError(Exception):
    """An error caused by input, with a message meant for the user."""


class CheckpointError(QserveError):
    """A checkpoint is missing, corrupt, or not one qserve supports."""


class UnsupportedArchitectureError(CheckpointError):
    """The checkpoint's architecture has no implementation in runtime/models."""
