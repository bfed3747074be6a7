"""Peer-controlled text made safe for a terminal, as rsync prints it.

One function, :func:`escaped`, stands between every string a peer controls (file names, link
targets, a server's error messages, ref names and descriptions) and the terminal: a name holding
``ESC [2J`` or an OSC sequence must not clear, retitle or reprogram the user's terminal (rsync's
``filtered_fwrite`` in ``log.c``; OpenSSH fixed the same in scp, CVE-2019-6109). ``--json`` output
is JSON and is not passed through it.
"""

from __future__ import annotations

import re
import sys
from typing import IO

__all__ = ["escaped", "say"]

# what is escaped: C0 controls but tab, DEL, C1 controls (U+0080..U+009F), bytes that are not
# UTF-8 (surrogateescape'd, U+DC80..U+DCFF)
_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f\x80-\x9f\udc80-\udcff]")


def _octal(m: re.Match[str]) -> str:
    c = m.group()
    if "\udc80" <= c <= "\udcff":
        return f"\\#{ord(c) - 0xDC00:03o}"
    return "".join(f"\\#{b:03o}" for b in c.encode("utf-8"))


def escaped(text: str) -> str:
    """``text`` fit for a terminal: each unsafe byte shown as rsync shows it, ``\\#ooo`` (three
    octal digits; ESC is ``\\#033``, a newline ``\\#012``).

    Unsafe, as rsync 3.2.7 judges it in a UTF-8 locale: the C0 control characters but tab
    (U+0000..U+001F), and each byte that is not valid UTF-8 (held in a ``str`` as a
    ``surrogateescape`` code point, U+DC80..U+DCFF). Further than rsync: DEL (U+007F) and the C1
    controls (U+0080..U+009F, of which U+009B is an 8-bit CSI to some terminals), each escaped
    byte by byte of its UTF-8 form (``\\#302\\#233``). Everything else, valid UTF-8 included, is
    printed as is.

    rsync also escapes a backslash that starts ``\\#ddd`` in a name; this does not, so that
    escaping twice (a message quoting an escaped name, escaped again when printed) changes
    nothing: ``escaped(escaped(s)) == escaped(s)``.

    Parameters
    ----------
    text : str
        Any text; ``surrogateescape`` code points stand for bytes that are not UTF-8.

    Returns
    -------
    str
        Printable text (encodable as UTF-8), as long as ``text`` or up to 8 times longer.
    """
    if text.isascii() and text.isprintable():
        return text
    return _UNSAFE.sub(_octal, text)


def say(text: str, file: IO[str] | None = None) -> None:
    """Print the line ``text`` to ``file`` (stdout by default) through :func:`escaped`: how the
    CLI prints every line that may hold peer-controlled text (``sync -v/-i/-n`` lines, failures,
    the error line, ``ls``, ``store ls/diff``...). ``--json`` output is printed raw instead."""
    print(escaped(text), file=sys.stdout if file is None else file)
