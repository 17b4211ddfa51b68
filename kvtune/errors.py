"""The one exception type the command line turns into a clear one-line error."""


class KvtuneError(Exception):
    """Bad input or an impossible configuration: shown to the user as one line, no traceback."""
