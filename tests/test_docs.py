"""The reference cannot drift from the parsers: every option of every parser (tb5sync's, each
command's, each store subcommand's) appears in the built CLI reference page, under its command,
and in that command's man page; the committed man pages (man/) are what `make man` writes now.

The site is built here with MkDocs into tmp_path (the `docs` extra; `make docs` installs it). Without
mkdocs the site test is skipped, unless TB5SYNC_REQUIRE_DOCS=1 (CI sets it), where it fails.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tb5sync.cli.manpage import all_commands, commands, man_pages, visible_options, write_man_pages

ROOT = Path(__file__).resolve().parent.parent


def _option_strings() -> list[tuple[Any, list[str]]]:
    """(command, its visible option strings) for every parser."""
    return [(c, [s for a in visible_options(c.parser) for s in a.option_strings]) for c in all_commands(commands())]


def test_the_parsers_have_options_to_check() -> None:
    per = {c.name: opts for c, opts in _option_strings()}
    assert "--max-connections" in per["tb5sync serve"]
    assert "--link-dest" in per["tb5sync sync"] and "--delete-after" in per["tb5sync sync"]
    assert "--hardlink" in per["tb5sync store get"]
    assert "--no-ac-validation" in per["tb5sync http-cache"]
    assert sum(len(v) for v in per.values()) > 200


def _have_mkdocs() -> bool:
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not _have_mkdocs():
        if os.environ.get("TB5SYNC_REQUIRE_DOCS") == "1":
            pytest.fail("TB5SYNC_REQUIRE_DOCS=1 but mkdocs, mkdocs-material or mkdocstrings is not installed (make docs installs them)")
        pytest.skip("mkdocs, mkdocs-material and mkdocstrings are not installed (pip install '.[docs]', or make docs)")
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=240, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert r.returncode == 0, r.stderr[-4000:]
    return out


def _sections(page: str) -> dict[str, str]:
    """The CLI reference page's text per command anchor (from its heading to the next command's)."""
    text = html.unescape(page)
    marks = [(m.start(), m.group(1)) for m in re.finditer(r'<h[2-6] id="([a-z0-9-]+)"', text)]
    return {name: text[start:(marks[i + 1][0] if i + 1 < len(marks) else len(text))] for i, (start, name) in enumerate(marks)}


@pytest.mark.timeout(300)
def test_every_option_is_in_the_built_cli_reference(site: Path) -> None:
    page = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    sections = _sections(page)
    missing = []
    for cmd, opts in _option_strings():
        anchor = "-".join(cmd.path) or "tb5sync"
        assert anchor in sections, f"no section for {cmd.name} in the CLI reference"
        listed = set(re.findall(r"<dt><code>(.*?)</code></dt>", sections[anchor]))
        names = {n for item in listed for n in re.findall(r"(?<![\w-])(--?[\w][\w-]*)", item)}
        missing += [f"{cmd.name} {o}" for o in opts if o not in names]
    assert not missing, f"options missing from the built CLI reference: {missing}"


@pytest.mark.timeout(120)
def test_the_guide_pages_are_built(site: Path) -> None:
    for page in ("guide/getting-started", "guide/sync", "guide/daemon", "guide/python", "guide/store",
                 "guide/build-cache", "guide/bench", "guide/troubleshooting", "reference/api", "reference/formats",
                 "reference/wire", "ARCHITECTURE", "changelog"):
        assert (site / page / "index.html").is_file(), page
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("SyncStats", "SyncOptions", "TB5FileSystem", "open_store", "pull_fanout", "Tb5syncError"):
        assert name in api, name
    assert "TB5PACK1" in (site / "reference" / "formats" / "index.html").read_text(encoding="utf-8")


def _roff_text(text: str) -> str:
    return text.replace("\\-", "-").replace("\\e", "\\").replace("\\fB", "").replace("\\fI", "").replace("\\fR", "")


@pytest.mark.timeout(60)
def test_every_option_is_in_its_man_page(tmp_path: Path) -> None:
    write_man_pages(tmp_path)
    missing = []
    for cmd, opts in _option_strings():
        text = _roff_text((tmp_path / f"{cmd.page}.1").read_text(encoding="utf-8"))
        # the OPTIONS entries are the .TP paragraphs' first lines
        entries = re.findall(r"^\.TP\n(.*)$", text, flags=re.M)
        names = {n for e in entries for n in re.findall(r"(?<![\w-])(--?[\w][\w-]*)", e)}
        missing += [f"{cmd.name} {o}" for o in opts if o not in names]
    assert not missing, f"options missing from the man pages: {missing}"


@pytest.mark.timeout(60)
def test_the_committed_man_pages_are_current() -> None:
    pages = man_pages()
    committed = {p.name: p.read_text(encoding="utf-8") for p in (ROOT / "man").glob("*.1")}
    assert set(committed) == set(pages), "man/ holds other pages than `make man` writes: run make man"
    stale = [name for name, text in pages.items() if committed[name] != text]
    assert not stale, f"man/{stale[0]} differs from what the parsers give now: run `make man` and commit man/"


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("man") is None, reason="needs man (man-db) to render the pages")
def test_the_man_pages_render_without_warnings(tmp_path: Path) -> None:
    for path in write_man_pages(tmp_path):
        r = subprocess.run(["man", "--warnings", "-l", path], capture_output=True, text=True, timeout=30,
                           env=dict(os.environ, MANWIDTH="80", PAGER="cat"))
        assert r.returncode == 0, r.stderr
        assert not r.stderr.strip(), f"{os.path.basename(path)}: {r.stderr[:1000]}"
        assert "OPTIONS" in re.sub(".\x08", "", r.stdout)  # bold is overstrike when not on a terminal
