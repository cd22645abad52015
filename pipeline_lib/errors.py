"""The base of every user-facing error: the CLI prints its message as one line and exits 2."""


class AlignflowError(Exception):
    """A one-line error that names the file / field / value at fault and what was expected."""
