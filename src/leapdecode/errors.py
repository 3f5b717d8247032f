"""The one exception type users see for bad input."""


class LeapDecodeError(ValueError):
    """Bad input or an unusable model: the message says what is wrong and what to do.

    The CLI prints it as one line and exits non-zero; the Python API raises it. `field`, where
    one input is at fault, names it as the API does (a SpecConfig / SamplingParams field, or a
    `request` option: "prompt", "max_new_tokens", "stop"): the CLI maps it to its flag and the
    server to the request's parameter, each by a table.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
