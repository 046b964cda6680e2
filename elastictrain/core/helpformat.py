"""The help layout of every ``elastictrain`` command, ``elastictrain run`` included."""

from __future__ import annotations

import argparse
import textwrap


class HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to an option's help unless its help already names the
    default; wraps descriptions and epilogs by paragraph, leaving indented lines
    (examples, tables) as they are."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.required
                or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Values such as k=v,k=v lists or URLs stay whole rather than split mid-word.
        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False,
                             break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        prose: list[str] = []
        for line in [*text.splitlines(), ""]:
            if line and not line.startswith(" "):
                prose.append(line)
                continue
            if prose:  # a run of plain lines is one paragraph, wrapped
                out.append(super()._fill_text(" ".join(prose), width, indent))
                prose = []
            out.append(indent + line if line else "")
        return "\n".join(out).rstrip("\n")
