"""MkDocs hooks of the user guide (mkdocs.yml ``hooks:``).

The CLI reference page (docs/reference/cli.md) holds the marker ``<!-- tb5sync:cli-reference -->``;
at build time it is replaced by the reference generated from the argparse parsers
(:func:`tb5sync.cli.manpage.markdown`), so the page lists exactly the options the installed
command takes.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- tb5sync:cli-reference -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from tb5sync.cli.manpage import markdown as cli_markdown

    return markdown.replace(MARKER, cli_markdown())
