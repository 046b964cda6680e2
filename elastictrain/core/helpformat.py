"""The help layout of every ``elastictrain`` command, ``elastictrain run`` included, and
the "did you mean" of their usage errors."""

from __future__ import annotations

import argparse
import difflib
import re
import textwrap
from typing import Any, NoReturn


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


class SuggestingParser(argparse.ArgumentParser):
    """An argument parser whose errors name the closest command or option: ``stauts``
    gets "did you mean 'status'?", ``--kil-at`` "did you mean --kill-at?". Its
    subcommands' parsers are of this class too (argparse makes them of the parent's)."""

    _chosen: argparse.ArgumentParser | None = None  # the subcommand the line named

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # as argparse's own, knowing which subcommand the options were for
            self._chosen = _subcommand(self, parsed)
            usage_error = f"unrecognized arguments: {' '.join(extras)}"
            self.error(usage_error)
        return parsed

    def error(self, message: str) -> NoReturn:
        hint = self._closest(message)
        usage_error = f"{message}; did you mean {hint}?" if hint else message
        super().error(usage_error)

    def _closest(self, message: str) -> str | None:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice is not None:
            names = [c.strip(" '") for c in choice.group(2).split(",")]
            close = difflib.get_close_matches(choice.group(1), names, n=1, cutoff=0.6)
            return f"'{close[0]}'" if close else None
        unknown = re.search(r"unrecognized arguments: (.*)", message)
        for token in unknown.group(1).split() if unknown is not None else []:
            if token.startswith("--"):
                chosen = self._chosen if isinstance(self._chosen, SuggestingParser) else self
                close = difflib.get_close_matches(token.split("=", 1)[0], chosen._options(),
                                                  n=1, cutoff=0.6)
                if close:
                    return close[0]
        return None

    def _options(self) -> list[str]:
        """Every long option of this parser and of its subcommands, at any depth."""
        found = [o for o in self._option_string_actions if o.startswith("--")]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for parser in action.choices.values():
                    found += (parser._options() if isinstance(parser, SuggestingParser)
                              else [])
        return sorted(set(found))


def _subcommand(parser: argparse.ArgumentParser,
                parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser that ``parsed`` went through."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
            if chosen is not None:
                return _subcommand(chosen, parsed)
    return parser
