"""Regenerate the measured figures the docs show from the saved benchmark reports, and
compare them with the pages.

    python scripts/doc_figures.py            # check: exit 1 and a diff on any difference
    python scripts/doc_figures.py --write    # rewrite the blocks from the reports

A page marks a block of figures with the command that prints it from a saved report,
on the line before the block (a fenced block or a markdown table):

    <!-- figures: scripts/bench_goodput.py --table docs/bench-goodput-pooled.json -->

The command is one of the benchmark scripts' replay mode (``--table``):
it reads the JSON the benchmark wrote when it measured and prints the block, measuring
nothing. Each runs in this process (``main(argv)`` of the script), so the check costs
an import, not a benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import io
import itertools
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
MARKER = re.compile(r"^<!-- figures: (?P<command>.+?) -->\n", re.M)
REPLAY_FLAG = "--table"  # the scripts' mode that only reads a saved report


@dataclass(frozen=True)
class Block:
    page: Path
    command: str
    start: int  # offset of the block's first character in the page
    end: int  # offset just past it
    fenced: bool

    def body(self, text: str) -> str:
        block = text[self.start:self.end]
        if self.fenced:  # the lines between the fences
            return block.split("\n", 1)[1].rsplit("```", 1)[0].rstrip("\n")
        return block.rstrip("\n")

    def replaced(self, text: str, body: str) -> str:
        new = f"```text\n{body}\n```\n" if self.fenced else f"{body}\n"
        return text[:self.start] + new + text[self.end:]


def marked_blocks(page: Path, text: str) -> list[Block]:
    blocks = []
    for match in MARKER.finditer(text):
        start = match.end()
        rest = text[start:]
        if rest.startswith("```"):
            close = rest.index("\n```", 3) + len("\n```\n")
            blocks.append(Block(page, match["command"], start, start + close, True))
        elif rest.startswith("|"):
            lines = rest.splitlines(keepends=True)
            table = "".join(itertools.takewhile(lambda line: line.startswith("|"), lines))
            blocks.append(Block(page, match["command"], start, start + len(table), False))
        else:
            raise ValueError(f"{page.name}: the figures marker for `{match['command']}` is "
                             "not followed by a fenced block or a table")
    return blocks


def render(command: str) -> str:
    """What ``command`` prints (a script's replay of a saved report), run in-process."""
    words = shlex.split(command)
    script, argv = REPO / words[0], words[1:]
    if not (words[0].startswith("scripts/") and script.is_file()):
        raise ValueError(f"`{command}`: not one of scripts/*.py")
    if REPLAY_FLAG not in argv:
        raise ValueError(f"`{command}`: only a replay ({REPLAY_FLAG}) of a saved report may "
                         "be run here (it must measure nothing)")
    spec = importlib.util.spec_from_file_location(f"_doc_figures_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(script.parent))  # the scripts import their shared benchlib
    sys.modules[spec.name] = module  # dataclasses look their module up there
    before = Path.cwd()
    try:
        spec.loader.exec_module(module)
        out = io.StringIO()
        # The commands name their reports relative to the repository, as pages show them.
        os.chdir(REPO)
        with contextlib.redirect_stdout(out):
            module.main(argv)
    finally:
        os.chdir(before)
        sys.path.remove(str(script.parent))
        del sys.modules[spec.name]
    return out.getvalue().rstrip("\n")


def differences(pages: list[Path] = PAGES, write: bool = False) -> list[str]:
    """A unified diff per block whose figures differ from its report's (rewritten first
    when ``write``); empty when every block matches."""
    found = []
    for page in pages:
        text = page.read_text()
        # From the last block up, so that a rewrite keeps the earlier offsets right.
        for block in reversed(marked_blocks(page, text)):
            expected, shown = render(block.command), block.body(text)
            if expected == shown:
                continue
            if write:
                text = block.replaced(text, expected)
                continue
            diff = difflib.unified_diff(shown.splitlines(), expected.splitlines(),
                                        f"{_shown(page)} (shown)",
                                        f"{block.command} (from the report)", lineterm="")
            found.append("\n".join(diff))
        if write:
            page.write_text(text)
    return found


def _shown(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else str(page)


def count_blocks(pages: list[Path] = PAGES) -> int:
    return sum(len(marked_blocks(page, page.read_text())) for page in pages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite each marked block from its report")
    args = parser.parse_args(argv)
    found = differences(write=args.write)
    for diff in found:
        print(diff)
    if args.write:
        print(f"{count_blocks()} blocks of figures written from their reports")
        return 0
    print(f"{count_blocks()} blocks of figures checked: "
          + (f"{len(found)} differ from their reports" if found else "all match"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
