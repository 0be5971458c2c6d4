"""User-facing calibration errors.

Each message says what is wrong and how to fix it. `CalibrationError` derives from
`ValueError` (calib/ does not import quantize/, so it cannot derive from
`QserveError`; the command line should catch both).
"""


class CalibrationError(ValueError):
    """Calibration data or statistics cannot be used as given; the message says why."""


class NotObservedError(CalibrationError):
    """An observer was asked for a result before it saw any data.

    Raised separately so a caller can tell "this module never ran during calibration"
    (e.g. an expert no calibration token was routed to) from bad input.
    """
