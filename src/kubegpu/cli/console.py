"""The rich consoles every CLI command prints through, so none hard-wraps output that is not a terminal.

Rich wraps text at the console width, and with no terminal (a pipe, a file, ``kubectl logs``, CI) that
width is ``COLUMNS`` or 80. A long error line then arrives as two lines, which breaks ``grep`` and log
readers. Here: a terminal keeps rich's behaviour; anything else gets soft wrapping (text is never
broken into lines) and a width wide enough that tables are not folded either.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

# Tables printed to a pipe or a log are laid out at this width (text lines are not wrapped at all).
PIPE_WIDTH = 220


def make_console(*, stderr: bool = False, width: int | None = None, **kwargs: Any) -> Console:
    """A console on stdout (or stderr) that never hard-wraps when it is not a terminal.

    ``width`` is the least width for tables when not a terminal (a terminal uses its own width).
    """
    console = Console(stderr=stderr, **kwargs)
    if not console.is_terminal:
        console.soft_wrap = True
        console.width = max(width or 0, PIPE_WIDTH)
    elif width is not None:
        console.width = max(console.width, width)
    return console
