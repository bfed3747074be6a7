"""The command line's reference, generated from its argparse parsers: man pages and Markdown.

Nothing here is written by hand about an option: every command, subcommand, argument and option
comes from :func:`tb5sync.cli.command.build_parser` (the ``store`` subcommands from
:mod:`tb5sync.cli.store`), and the exit codes from the ``exit_code`` of each class in
:mod:`tb5sync.errors`, so the reference cannot drift from the parsers.

``python -m tb5sync.cli.manpage man DIR`` writes ``tb5sync.1`` and one ``tb5sync-COMMAND.1`` per
command into DIR (``make man``); ``python -m tb5sync.cli.manpage markdown`` prints the CLI
reference page of the user guide (the MkDocs hook in ``scripts/mkdocs_hooks.py`` inserts the
same text at build time). Options whose help is ``argparse.SUPPRESS`` are left out, as
``--help`` leaves them out.
"""

from __future__ import annotations

import argparse
import html
import inspect
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["Command", "commands", "visible_options", "exit_codes", "markdown", "man_pages", "write_man_pages", "main"]


@dataclass
class Command:
    """One parser of the command line: ``path`` is its words after ``tb5sync`` (``[]`` for
    ``tb5sync`` itself, ``["store", "put"]``), ``help`` the line ``--help`` shows for it."""

    path: list[str]
    parser: argparse.ArgumentParser
    help: str = ""
    subcommands: list[Command] = field(default_factory=list)

    @property
    def name(self) -> str:
        return " ".join(["tb5sync", *self.path])

    @property
    def page(self) -> str:
        """Its man page's name: ``tb5sync``, ``tb5sync-serve``; a store subcommand is in ``tb5sync-store``."""
        return "-".join(["tb5sync", *self.path[:1]])


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, sub, helps.get(name, "")))
    return out


def commands(parser: argparse.ArgumentParser | None = None) -> Command:
    """The tree of commands under ``parser`` (default: the whole ``tb5sync`` parser)."""
    if parser is None:
        from tb5sync.cli.command import build_parser

        parser = build_parser()

    def walk(path: list[str], p: argparse.ArgumentParser, help_: str) -> Command:
        node = Command(path, p, help_)
        node.subcommands = [walk([*path, name], sub, h) for name, sub, h in _subparsers(p)]
        return node

    return walk([], parser, parser.description or "")


def all_commands(root: Command) -> list[Command]:
    """``root`` and every command below it, depth first, in ``--help`` order."""
    out = [root]
    for sub in root.subcommands:
        out.extend(all_commands(sub))
    return out


def visible_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The optional arguments ``parser --help`` lists (not the suppressed ones)."""
    return [a for a in parser._actions
            if a.option_strings and a.help is not argparse.SUPPRESS]


def visible_positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not a.option_strings and a.help is not argparse.SUPPRESS
            and not isinstance(a, argparse._SubParsersAction)]


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(parser.prog, width=100)


def _invocation(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """``-n, --dry-run``, ``--bind BIND``, ``--compress {auto,lz4,none}``, as ``--help`` shows it."""
    return _formatter(parser)._format_action_invocation(action)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    return " ".join(_formatter(parser)._expand_help(action).split())


def _positional_name(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return _formatter(parser)._format_args(action, action.dest.upper()) if action.metavar is None and action.nargs \
        else (action.metavar or action.dest.upper())


#: Columns the usage lines are wrapped to.
USAGE_WIDTH = 72


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage line(s) ``--help`` shows, without ``usage:``, continuation lines indented by 4."""
    # a formatter of a fixed width, not parser.format_usage(): that one reads $COLUMNS, and the
    # committed man pages must not depend on the terminal that ran `make man`
    f = argparse.HelpFormatter(parser.prog, width=USAGE_WIDTH)
    f.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    text = f.format_help().strip()
    text = text[len("usage: "):] if text.startswith("usage: ") else text
    first, *rest = text.split("\n")
    return "\n".join([first, *("    " + ln.strip() for ln in rest)])


#: What each exit status means, in a line. The error classes behind each code are not listed
#: here: :func:`exit_codes` reads them from :mod:`tb5sync.errors`, and a code an error class has
#: that is missing here is still listed, with that class's docstring.
EXIT_MEANINGS = {
    0: "success (a daemon asked to stop by SIGINT or SIGTERM also exits 0)",
    1: "an error no other code describes",
    2: "bad usage: an unknown or misplaced option, a bad value or URL; a destination or ref that exists "
       "and --force was not given; a pinned ref to remove",
    3: "path refused: outside the server's ROOT, a read-only server, a single file's missing destination "
       "directory, a file where a directory is needed",
    5: "authentication failed: wrong or missing token",
    10: "cannot connect, or refused at admission: server busy, or an address outside the server's --allow",
    11: "the destination or the server's file system refused a write: permissions, disk full, a quota or "
        "--min-free-space, a missing parent without --mkpath",
    12: "protocol error, or the server closed the connection mid-transfer (stopped or killed)",
    13: "data corrupted: a chunk did not match its BLAKE3 digest (nothing was committed); store verify found damage",
    14: "the server reported an error of another kind",
    20: "ended by SIGINT, SIGTERM or SIGHUP (rsync's code 20); what was being written is removed first",
    23: "a source was not found, or some entries could not be synced (partial transfer; each is named on stderr)",
    24: "some source files vanished or kept changing while they were read",
    25: "--max-delete stopped deletions",
    30: "I/O timeout: the peer made no progress for --timeout seconds, or the link went down",
    141: "the output pipe was closed (e.g. piped into head)",
}


def exit_codes() -> list[tuple[int, list[str], str]]:
    """``(code, [error classes], what it means)`` for every exit status the command returns,
    from the ``exit_code`` of each class in :mod:`tb5sync.errors`."""
    import tb5sync.errors as errors

    by_code: dict[int, list[type]] = {}
    for _, obj in inspect.getmembers(errors, inspect.isclass):
        if obj.__module__ == errors.__name__ and issubclass(obj, errors.Tb5syncError) and obj is not errors.Tb5syncError:
            by_code.setdefault(obj.exit_code, []).append(obj)
    out = []
    for code in sorted(set(by_code) | set(EXIT_MEANINGS)):
        classes = sorted(by_code.get(code, []), key=lambda c: (len(c.__mro__), c.__name__))
        if code in EXIT_MEANINGS:
            what = EXIT_MEANINGS[code]
        else:
            what = " ".join((classes[0].__doc__ or "").strip().split("\n\n")[0].split())
            what = re.sub(r"(:class:)?``?([^`]*)``?", r"\2", what)
        out.append((code, [c.__name__ for c in classes], what))
    return out


# ---------------------------------------------------------------- Markdown (the user guide's CLI reference)

def _md_text(text: str) -> str:
    return html.escape(text, quote=False)


def _md_command(cmd: Command, level: int) -> list[str]:
    p = cmd.parser
    anchor = "-".join(cmd.path) or "tb5sync"
    lines = [f"{'#' * level} {cmd.name} {{#{anchor}}}", ""]
    if cmd.help:
        lines += [_md_text(cmd.help[0].upper() + cmd.help[1:]) + ("" if cmd.help.endswith(".") else "."), ""]
    lines += ["```text", _usage(p), "```", ""]
    for cls, actions, name in (("tb5-args", visible_positionals(p), _positional_name),
                               ("tb5-options", visible_options(p), _invocation)):
        if actions:
            lines.append(f'<dl class="{cls}">')
            for a in actions:
                lines.append(f"<dt><code>{_md_text(name(p, a))}</code></dt>"
                             f"<dd>{_md_text(_help(p, a)) or '&nbsp;'}</dd>")
            lines += ["</dl>", ""]
    if cmd.subcommands:
        lines += ["Subcommands: " + ", ".join(f"[`{s.path[-1]}`](#{'-'.join(s.path)})" for s in cmd.subcommands) + ".", ""]
    for sub in cmd.subcommands:
        lines += _md_command(sub, level + 1)
    return lines


def markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The CLI reference as Markdown (with HTML definition lists): every command, every option."""
    root = commands(parser)
    lines = _md_command(root, 2)
    lines += ["## Exit status {#exit-status}", "", "| code | error classes | meaning |", "|---|---|---|"]
    for code, classes, what in exit_codes():
        lines.append(f"| {code} | {', '.join(f'`{c}`' for c in classes) or '-'} | {_md_text(what).replace('|', '&#124;')} |")
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- man pages (roff, man(7) macros)

def _roff(text: str) -> str:
    """Plain text as roff: backslashes and hyphens escaped, no line starting with a control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(("\\&" + ln) if ln[:1] in (".", "'") else ln for ln in text.split("\n"))


def _man_options(p: argparse.ArgumentParser, title: str) -> list[str]:
    out = []
    pos = visible_positionals(p)
    if pos:
        out.append(f".SS {title}arguments" if title else ".SH ARGUMENTS")
        for a in pos:
            out += [".TP", f"\\fI{_roff(_positional_name(p, a))}\\fR", _roff(_help(p, a))]
    opts = visible_options(p)
    if opts:
        out.append(f".SS {title}options" if title else ".SH OPTIONS")
        for a in opts:
            out += [".TP", f"\\fB{_roff(_invocation(p, a))}\\fR", _roff(_help(p, a))]
    return out


def _man_header(name: str, summary: str, version: str) -> list[str]:
    return [f'.TH "{name.upper()}" "1" "" "tb5sync {version}" "tb5sync manual"',
            ".SH NAME", f"{_roff(name)} \\- {_roff(summary)}"]


def _synopsis(p: argparse.ArgumentParser) -> list[str]:
    return [".nf", _roff(_usage(p)), ".fi"]


def man_pages(parser: argparse.ArgumentParser | None = None) -> dict[str, str]:
    """``{file name: roff text}``: ``tb5sync.1`` (the global options, the commands, the exit
    status, the environment) and ``tb5sync-COMMAND.1`` per command (``tb5sync-store.1`` holds
    every store subcommand)."""
    from tb5sync import __version__ as version

    root = commands(parser)
    pages: dict[str, str] = {}
    see_also = ", ".join(f"\\fB{c.page}\\fR(1)" for c in root.subcommands)

    top = _man_header("tb5sync", root.help.rstrip(".").lower() if root.help else "tb5sync", version)
    top += [".SH SYNOPSIS", *_synopsis(root.parser), ".SH DESCRIPTION",
            _roff("tb5sync moves files between machines at link speed: an rsync-like sync, a daemon, a tb5:// fsspec "
                  "filesystem, a content-addressed artifact store, an HTTP build cache for ccache and Bazel, and a "
                  "benchmark of the link. Each command has its own page; the options below are taken before or "
                  "after the command."),
            ".SH COMMANDS"]
    for c in root.subcommands:
        top += [".TP", f"\\fB{_roff(c.path[0])}\\fR", _roff(c.help) + f" (\\fB{c.page}\\fR(1))"]
    top += _man_options(root.parser, "")
    top += [".SH EXIT STATUS"]
    for code, classes, what in exit_codes():
        top += [".TP", f"\\fB{code}\\fR", _roff(what + (f" ({', '.join(classes)})" if classes else ""))]
    top += [".SH ENVIRONMENT",
            ".TP", "\\fBTB5SYNC_TOKEN\\fR", _roff("the shared token when no --token-file (or token in the URL) is given"),
            ".TP", "\\fBTB5SYNC_STORE\\fR", _roff("the artifact store when no --store is given"),
            ".TP", "\\fBTB5SYNC_HASH_THREADS\\fR, \\fBTB5SYNC_CHUNK_THREADS\\fR",
            _roff("defaults of --hash-threads and --chunk-threads"),
            ".SH SEE ALSO", see_also + ", \\fBrsync\\fR(1)"]
    pages["tb5sync.1"] = "\n".join(top) + "\n"

    for c in root.subcommands:
        page = _man_header(c.page, c.help, version)
        page += [".SH SYNOPSIS", *_synopsis(c.parser)]
        for s in c.subcommands:
            page += _synopsis(s.parser)
        page += [".SH DESCRIPTION", _roff(c.help[0].upper() + c.help[1:] + ".")]
        if c.subcommands:
            page += [_roff(f"Options of {c.name} itself may also be given after the subcommand.")]
        page += _man_options(c.parser, "")
        for s in c.subcommands:
            page += [f".SH {_roff(s.name.upper())}", _roff(s.help[0].upper() + s.help[1:] + "."),
                     *_synopsis(s.parser)]
            page += _man_options(s.parser, f"{_roff(s.path[-1])} ")
        page += [".SH EXIT STATUS", _roff("See tb5sync(1)."),
                 ".SH SEE ALSO", "\\fBtb5sync\\fR(1)" + (", \\fBrsync\\fR(1)" if c.path == ["sync"] else "")]
        pages[f"{c.page}.1"] = "\n".join(page) + "\n"
    return pages


def write_man_pages(directory: str | os.PathLike[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """Write :func:`man_pages` into ``directory`` (created); returns the paths written."""
    os.makedirs(directory, exist_ok=True)
    written = []
    for name, text in man_pages(parser).items():
        path = os.path.join(directory, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tb5sync.cli.manpage",
                                 description="Generate the CLI reference from the parsers.")
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("man", help="write tb5sync.1 and tb5sync-COMMAND.1 into DIR")
    m.add_argument("dir")
    sub.add_parser("markdown", help="print the CLI reference page as Markdown")
    a = ap.parse_args(argv)
    if a.what == "man":
        for path in write_man_pages(a.dir):
            print(path)
    else:
        sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
