"""The base of every user-facing error: the CLI prints its message as one line and exits 2."""


class AlignflowError(Exception):
    """A one-line error that names the file / field / value at fault and what was expected."""


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`: how a wrapped library error appears inside a one-line error."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def text_start(text: str, width: int = 40) -> str:
    """The start of a (data) text, quoted, to name it in a one-line error."""
    return repr(text[:width] + ("..." if len(text) > width else ""))
