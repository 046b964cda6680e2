"""The README and docs/ are tested: code blocks parse, every command line a page shows
parses with the real CLI, scripts named exist, relative links resolve, the index lists
every page, and the README's test command is the one CI runs (the commands run for
real: tests/processes/docs/test_docs_run.py)."""
from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import pytest

from elastictrain.cli import build_parser
from elastictrain.launcher.run_help import torchrun_parser
from tests.helpers import REPO

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([\w+-]*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
def blocks(lang: set[str]) -> list[tuple[Path, str]]:
    return [(page, m.group(2)) for page in PAGES for m in FENCE.finditer(page.read_text())
            if m.group(1) in lang]


def command_lines(prefix: str) -> list[tuple[Path, str]]:
    """Lines of shell blocks that run ``prefix`` (prompts, comments, ``&&`` chains and
    continuation lines handled); synopses with ``[--option]`` placeholders are not commands."""
    found = []
    for page, text in blocks({"bash", "sh", "console", ""}):
        for raw in text.replace("\\\n", " ").splitlines():
            for part in raw.removeprefix("$ ").split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == [prefix] and not any(w.startswith(("[", "<")) for w in words):
                    found.append((page, shlex.join(words)))
    return found


def test_there_are_pages_and_the_readme_is_short() -> None:
    assert len(PAGES) >= 9
    assert len((REPO / "README.md").read_text().splitlines()) <= 120


def test_the_docs_index_lists_every_page() -> None:
    index = (REPO / "docs" / "README.md").read_text()
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    listed = set(re.findall(r"\]\(([^)#]+\.md)\)", index))
    missing = pages - {"README.md"} - listed
    assert not missing, f"docs/README.md misses {sorted(missing)}"


@pytest.mark.parametrize(("page", "code"), blocks({"python"}), ids=lambda v: str(v)[-40:])
def test_python_blocks_compile(page: Path, code: str) -> None:
    ast.parse(code, filename=str(page))


def test_config_blocks_parse() -> None:
    tomls, jsons = blocks({"toml"}), blocks({"json"})
    assert tomls, "docs show the TOML configuration"
    for _, code in tomls:
        tomllib.loads(code)
    for _, code in jsons:
        json.loads(code)


def test_every_elastictrain_command_parses() -> None:
    commands = command_lines("elastictrain")
    assert len(commands) >= 20
    parser = build_parser()
    for page, line in commands:
        argv = shlex.split(line)[1:]
        try:
            if argv[:1] == ["run"]:
                torchrun_parser().parse_args(argv[1:])
            else:
                parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code != 0:  # --help exits 0
                raise AssertionError(f"{page.name}: `{line}` does not parse") from None


def test_scripts_named_exist() -> None:
    named = [(page, shlex.split(line)[1]) for page, line in command_lines("python")
             if len(shlex.split(line)) > 1 and shlex.split(line)[1].endswith(".py")]
    assert named
    for page, script in named:
        assert (REPO / script).is_file(), f"{page.name} names {script}, which does not exist"


def test_relative_links_resolve() -> None:
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.name} links to {target}, which does not exist"


def test_ci_runs_the_readme_commands_read_from_the_readme() -> None:
    """CI reads both command lines from README.md (not a copy that could drift) and
    runs each in a fresh venv."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "grep -E '^pip install ' README.md" in ci and "python3 -m venv" in ci
    readme = (REPO / "README.md").read_text().splitlines()
    commands = [line for line in readme if line.startswith("pip install ")]
    assert len(commands) == 2
    assert "elastictrain demo" in commands[0] and "python -m pytest" in commands[1]




def test_the_readme_shows_its_example_file_exactly() -> None:
    """The process tests run examples/ddp_resumable.py as the README's script: the README
    must show exactly that file."""
    example = (REPO / "examples" / "ddp_resumable.py").read_text()
    assert example.strip() in (REPO / "README.md").read_text()
