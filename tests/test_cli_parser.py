"""The CLI builds only the command it runs; what it parses and prints must not change.

``main`` builds the parser of one command (the others by name and help alone), found by
``_command_of``; the reference is the whole parser, ``build_parser()``.
"""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

import tb5sync.cli.command as cli

ARGVS = [
    ["sync", "src/", "tb5://127.0.0.1:1/dst", "--delete", "-aHv", "--exclude", "*.o", "--bwlimit", "1M"],
    ["-v", "--hash-threads", "3", "sync", "a", "b", "--chunk-threads=2", "-n", "--link-dest", "../x"],
    ["--hash-threads=2", "-vv", "ls", "tb5://h/p", "--timeout", "5"],
    ["serve", "/srv", "--bind", "[::]:0", "--allow", "lo", "--store", "--max-entries", "10"],
    ["http-cache", "/st", "--bind", "127.0.0.1:0", "--read-only"],
    ["bench", "tb5://h", "--size", "64M", "--json"],
    ["store", "put", "r1", "/d", "-m", "x", "--json"],
    ["--chunk-threads", "1", "store", "--store", "/s", "pull", "tb5://h", "r1"],
    ["sync", "--", "-odd-name", "dst"],
]


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, object]:
    ns, extras = parser.parse_known_args(argv)
    d = {k: v for k, v in vars(ns).items() if k != "sync_parser"}
    d["_extras"] = extras
    return d


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", ARGVS, ids=lambda a: " ".join(a)[:40])
def test_one_command_parser_parses_as_the_whole(argv: list[str]) -> None:
    cmd = cli._command_of(argv)
    assert cmd == next(a for a in argv if a in cli.COMMANDS)
    assert _parse(cli.build_parser(cmd), argv) == _parse(cli.build_parser(), argv)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [["--hash", "4", "sync", "a", "b"], ["--help"], [], ["synk", "a"], ["-v"], ["--", "sync"]])
def test_no_command_told_builds_the_whole_parser(argv: list[str]) -> None:
    """An abbreviated global option with a value, no command, an unknown one: argparse decides."""
    assert cli._command_of(argv) in (None, "sync")
    if argv == ["--", "sync"]:
        assert cli._command_of(argv) == "sync"
    else:
        assert cli._command_of(argv) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [["--help"], ["sync", "--help"], ["serve", "--help"], ["store", "--help"], ["store", "get", "--help"], ["synk"]])
def test_help_and_errors_same_as_the_whole_parser(argv: list[str]) -> None:
    def run(parser: argparse.ArgumentParser) -> tuple[str, str, object]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as ei:
            parser.parse_known_args(argv)
        return out.getvalue(), err.getvalue(), ei.value.code

    got = run(cli.build_parser(cli._command_of(argv)))
    assert got == run(cli.build_parser())
    assert got[0] or got[1]
