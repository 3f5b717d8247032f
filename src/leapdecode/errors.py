"""The one exception type users see for bad input."""


class LeapDecodeError(ValueError):
    """Bad input or an unusable model: the message says what is wrong and what to do.

    The CLI prints it as one line and exits non-zero; the Python API raises it.
    """
