"""The base of every user-facing error: the CLI prints its message as one line and exits 2."""


class AlignflowError(Exception):
    """A one-line error that names the file / field / value at fault and what was expected."""


def one_line(exc: BaseException, width: int = 400) -> str:
    """`Type: message` on one line: how a wrapped library error appears inside a one-line error. A message over
    several lines (transformers lists what it tried on the lines after the first) is joined with spaces and cut at
    `width` characters."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text[:width]}{'...' if len(text) > width else ''}"


def text_start(text: str, width: int = 40) -> str:
    """The start of a (data) text, quoted, to name it in a one-line error."""
    return repr(text[:width] + ("..." if len(text) > width else ""))
