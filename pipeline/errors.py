"""The one exception type for user errors (bad input, bad configuration, refused operations).

Library code raises it with a one-line message that names the file, sample or field at fault;
the CLI renders it once, in one place, and exits non-zero. `assert` is for invariants only.
"""


class PipelineError(Exception):
    """A user-facing error: the message is shown as is, without a traceback."""
