"""The docs say what the code does: the settings table against ``elastictrain.core.config``,
the event names against the events the code logs, the exit codes against
``elastictrain.core.errors``, file and object names against the functions that make them,
every relative link and anchor resolves, and user pages tell no project history."""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types
import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from elastictrain.core import errors, layout
from elastictrain.core.config import Settings
from elastictrain.runlog import events
from tests.helpers import REPO

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def section(page: Path, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    text = page.read_text()
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert match, f"{page.name} has no heading {heading!r}"
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, match.end())
    return text[match.end():end.start() if end else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every row of the markdown tables in ``text`` (header rows included,
    separator rows left out)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|[\s:|-]+\|$", line):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


# --- the settings table ----------------------------------------------------------------


def leaf_settings(model: type[BaseModel] = Settings, prefix: str = "") -> dict[str, Any]:
    """Every setting a user can give: dotted key → pydantic FieldInfo, walking sections
    (and optional sections such as ``storage.faults``) down to their fields."""
    found: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        members = get_args(info.annotation) if is_union(info.annotation) else (info.annotation,)
        sections = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
        if sections:
            found.update(leaf_settings(sections[0], f"{prefix}{name}."))
        else:
            found[f"{prefix}{name}"] = info
    return found


def is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (typing.Union, types.UnionType)


def flat_members(annotation: Any) -> list[Any]:
    """The members of a union (Annotated members unwrapped one level), else itself."""
    members = list(get_args(annotation)) if is_union(annotation) else [annotation]
    out = []
    for member in members:
        if get_origin(member) is typing.Annotated:
            out.append(member)
        elif get_origin(member) is Literal:
            out.extend(Literal[v] for v in get_args(member))
        else:
            out.append(member)
    return out


def literals(annotation: Any) -> list[str]:
    values: list[str] = []
    for member in flat_members(annotation):
        if get_origin(member) is Literal:
            values += [str(v) for v in get_args(member)]
        elif get_origin(member) is list:
            values += literals(get_args(member)[0])
    return values


def bounds(info: Any) -> list[float]:
    """Numeric bounds (ge, gt, le, lt) from the field and from Annotated union members."""
    metadata = list(info.metadata)
    for member in flat_members(info.annotation):
        if get_origin(member) is typing.Annotated:
            for extra in get_args(member)[1:]:
                metadata += list(getattr(extra, "metadata", [extra]))
    found = []
    for item in metadata:
        for attr in ("ge", "gt", "le", "lt"):
            value = getattr(item, attr, None)
            if isinstance(item, annotated_types.BaseMetadata) and value is not None:
                found.append(float(value))
    return found


def numbers_in(cell: str) -> set[float]:
    """Numbers a cell states, sizes in MiB/GiB converted to bytes."""
    found = set()
    for number, unit in re.findall(r"(?<![\w.])(\d+(?:\.\d+)?)(?:\s*(MiB|GiB))?", cell):
        found.add(float(number) * {"": 1, "MiB": 2**20, "GiB": 2**30}[unit])
    return found


def default_of(info: Any) -> Any:
    if info.default_factory is not None:
        return info.default_factory()
    return None if info.default is PydanticUndefined else info.default


# Settings whose default is None but mean something else: the doc must name it, and
# where the code has the value, the value is checked.
EFFECTIVE_DEFAULTS = {
    "run_id": "torchrun",
    "log.json_output": "TTY",
    "log.events_dir": f"<storage>/{events.EVENTS_DIR}",
    "snapshot.memory_dir": "/dev/shm/elastictrain-<uid>/run-<hash of the storage URL>",
}


def settings_table() -> dict[str, list[str]]:
    rows = table_rows(section(DOCS / "configuration.md", "Every setting"))
    assert rows[0][:4] == ["field", "environment variable", "default", "allowed"]
    return {row[0].strip("`"): row for row in rows[1:]}


def test_every_setting_is_in_the_table_and_nothing_else() -> None:
    documented, keys = set(settings_table()), set(leaf_settings())
    assert not keys - documented, f"settings missing from configuration.md: {keys - documented}"
    assert not documented - keys, f"configuration.md lists no such setting: {documented - keys}"


@pytest.mark.parametrize("key", sorted(leaf_settings()))
def test_setting_row_matches_the_code(key: str) -> None:
    info = leaf_settings()[key]
    row = settings_table().get(key)
    assert row is not None, f"{key} is missing from configuration.md"
    _, env, default_cell, allowed = row[:4]
    assert env.strip("`") == "ELASTICTRAIN_" + key.upper().replace(".", "__")

    default = default_of(info)
    if default is None:
        expected = EFFECTIVE_DEFAULTS.get(key, "unset")
        assert expected in default_cell, f"{key}: default is None, the doc says {default_cell!r}"
    elif isinstance(default, bool):
        assert str(default).lower() in default_cell.lower(), f"{key}: default {default}"
    elif isinstance(default, (int, float)):
        assert float(default) in numbers_in(default_cell), f"{key}: default {default}"
    elif isinstance(default, str):
        assert default in default_cell, f"{key}: default {default!r}"
    elif isinstance(default, list):
        for item in default:
            assert str(item) in default_cell, f"{key}: default holds {item!r}"
    elif isinstance(default, dict):
        assert str(default) in default_cell, f"{key}: default {default}"

    for value in literals(info.annotation):
        assert f"`{value}`" in allowed or value in allowed.split(", "), \
            f"{key}: allowed value {value!r} is not in {allowed!r}"
    for bound in bounds(info):
        assert bound in numbers_in(allowed), f"{key}: bound {bound:g} is not in {allowed!r}"
    members = flat_members(info.annotation)
    if bool in members:
        assert "bool" in allowed or ("`true`" in allowed and "`false`" in allowed), key
    if type(None) in members and default is not None:
        assert "unset" in allowed or "unset" in default_cell, f"{key} may be unset"


def test_names_that_are_not_settings_are_listed() -> None:
    from elastictrain.core.env import OUTSIDE_SETTINGS

    text = (DOCS / "configuration.md").read_text()
    for name in OUTSIDE_SETTINGS:
        assert f"`{name}`" in text, f"configuration.md does not name {name}"
    count = re.search(r"(\w+) `ELASTICTRAIN_\*` names are not settings", text)
    words = {"One": 1, "Two": 2, "Three": 3, "Four": 4, "Five": 5, "Six": 6,
             "Seven": 7, "Eight": 8}
    assert count and words.get(count.group(1)) == len(OUTSIDE_SETTINGS)


# --- events ----------------------------------------------------------------------------

LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}
EVENT_NAME = re.compile(r"^[a-z_]+(\.[a-z_]+)*$")
# Log calls whose name is not a literal, and what they log.
DYNAMIC_EVENTS = {
    ("dist.py", "self._event"): "deadline",  # names come from deadline(seconds, "name")
    ("generic.py", "full"): None,  # self.fs.info(path): not a log call
    ("helpformat.py", "usage_error"): None,  # argparse's error(): not a log call
}


@functools.cache  # the package's sources do not change during a test session
def emitted_events() -> frozenset[str]:
    """Every event name the package logs: literal first arguments of log calls (both
    branches of a conditional), and the names given to ``dist.deadline``."""
    names: set[str] = set()
    for path in (REPO / "elastictrain").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            first = node.args[0]
            if isinstance(node.func, ast.Name) and node.func.id == "deadline":
                names.add(node.args[1].value)  # type: ignore[attr-defined]
                continue
            if not (isinstance(node.func, ast.Attribute) and node.func.attr in LOG_METHODS):
                continue
            options = [first.body, first.orelse] if isinstance(first, ast.IfExp) else [first]
            for option in options:
                if isinstance(option, ast.Constant) and isinstance(option.value, str):
                    if EVENT_NAME.match(option.value):
                        names.add(option.value)
                else:
                    key = (path.name, ast.unparse(option))
                    assert key in DYNAMIC_EVENTS, \
                        f"{path}:{node.lineno} logs a computed event name: teach this test"
    return frozenset(names)


def test_events_are_found() -> None:
    names = emitted_events()
    assert {"snapshot.committed", "resume", "agent.worker_failed", "dist.init_timeout"} <= names


def documented_events() -> set[str]:
    """Dotted names in the list (settings left out), and the undotted ones the code logs
    (field names such as `reason` are not events)."""
    text = section(DOCS / "events.md", "Names")
    settings = set(leaf_settings())
    settings |= {key.rsplit(".", 1)[0] for key in settings}
    return {t for t in CODE_SPAN.findall(text) if EVENT_NAME.match(t) and t not in settings
            and ("." in t or t in emitted_events())}


def test_events_page_lists_exactly_the_events_logged() -> None:
    emitted, documented = emitted_events(), documented_events()
    assert not emitted - documented, f"events.md does not list {sorted(emitted - documented)}"
    assert not documented - emitted, f"no code logs {sorted(documented - emitted)}"


FILE_NAME = re.compile(r"\.(?:py|md|sh|sbatch|yaml|yml|json|jsonl|toml|png|pt|txt)$")


def test_event_names_on_every_page_exist() -> None:
    emitted = emitted_events()
    namespaces = {name.split(".")[0] for name in emitted if "." in name}
    settings = set(leaf_settings())
    sections = {key.rsplit(".", 1)[0] for key in settings}
    for page in PAGES:
        for token in CODE_SPAN.findall(page.read_text()):
            token = token.split()[0].split("(")[0].split("=")[0]
            if "." not in token or not EVENT_NAME.match(token) or FILE_NAME.search(token):
                continue
            if token.split(".")[0] not in namespaces or token in settings | sections:
                continue
            parent = token.rsplit(".", 1)[0]  # an event's field: agent.standby_ready.failed
            assert token in emitted or parent in emitted, \
                f"{page.name} names event {token}, which no code logs"


# --- exit codes ------------------------------------------------------------------------


def exit_table() -> dict[str, list[str]]:
    rows = table_rows((DOCS / "exit-codes.md").read_text().split("\n## ")[0])
    return {row[0]: row for row in rows[1:]}


def test_exit_code_table_has_every_code_of_the_code() -> None:
    codes = {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    documented = exit_table()
    for code in codes | {1}:
        assert str(code) in documented, f"exit-codes.md has no row for {code}"
    stray = {c for c in documented if c.isdigit()} - {str(c) for c in codes | {1}}
    assert not stray, f"exit-codes.md documents codes the code does not have: {stray}"


def all_errors(cls: type = errors.ElasticTrainError) -> list[type]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in all_errors(child))]


@pytest.mark.parametrize("error", all_errors(), ids=lambda e: e.__name__)
def test_every_error_class_is_under_its_exit_code(error: type) -> None:
    table = exit_table()
    named = {code for code, row in table.items() if f"`{error.__name__}`" in row[-1]}
    if error.exit_code != 1:
        assert named == {str(error.exit_code)}, \
            f"{error.__name__} exits {error.exit_code}; exit-codes.md names it under {named}"
    else:
        assert not named - {"1"}, f"{error.__name__} exits 1, not {named}"


def test_readme_names_every_exit_code() -> None:
    text = (REPO / "README.md").read_text()
    line = next(p for p in text.split("\n\n") if p.startswith("Exit codes:"))
    for name, code in vars(errors).items():
        if name.startswith("EXIT_"):
            assert re.search(rf"\b{code}\b", line), f"README's exit codes lack {code} ({name})"


# --- file and object names -------------------------------------------------------------

TOKEN = "0a1b"
PLACEHOLDER = re.compile(r"<[^>]+>|\{[^}]+\}|…")


def code_spans_and_blocks(page: Path) -> list[str]:
    text = page.read_text()
    return [*CODE_SPAN.findall(FENCE.sub("", text)),
            *(line for block in FENCE.findall(text) for line in block.splitlines())]


def concrete(name: str) -> str:
    """A name with its placeholders filled as the code would fill them."""
    name = re.sub(r"(rank)(<[^>]+>|\{[^}]+\}|R\b)", r"\g<1>00001", name)
    return PLACEHOLDER.sub(TOKEN, name)


EVENT_FILE = re.compile(r"(?:attempt|agent-)(?:\{[^}]*\}|<[^>]*>|[^\s`/{<])*\.jsonl")


def test_event_file_names_are_the_codes() -> None:
    worker = events.worker_file_name(123, 45, "LAUNCH")
    agent = events.agent_file_name("HOST", 6789, "LAUNCH")
    templates = {
        worker.replace("123", "{NNN}").replace("LAUNCH", "{launch id}").replace("45", "{R}"),
        agent.replace("LAUNCH", "{launch id}").replace("HOST", "{host}").replace("6789", "{pid}"),
    }
    examples = [events.worker_file_name(r, k, "20261123T152453Z-9f91") for r in (0, 1)
                for k in (0, 1)] + [events.agent_file_name("node1", 4242, "20261123T152453Z-9f91")]
    seen = 0
    for page in PAGES:
        for span in code_spans_and_blocks(page):
            for name in EVENT_FILE.findall(span):
                seen += 1
                spelled = re.sub(r"<([^>]+)>", r"{\1}", name)
                if "*" in name:
                    assert any(fnmatch.fnmatch(e, name) for e in examples), \
                        f"{page.name}: no event file matches {name}"
                else:
                    assert spelled in templates, \
                        f"{page.name}: event file {name}; the code writes {sorted(templates)}"
    assert seen >= 3


def test_snapshot_object_names_are_the_codes() -> None:
    names_ok = [
        lambda n: layout.is_payload(n) or n == layout.MANIFEST,
        layout.is_sharded_object,
    ]
    step = re.compile(r"\bstep_\d+")
    seen = 0
    for page in PAGES:
        for span in code_spans_and_blocks(page):
            for match in step.findall(span):
                assert layout.parse_step(match) is not None, \
                    f"{page.name}: {match} is not a step directory ({layout.step_dir(1200)})"
            for name in re.findall(r"(?<![\w.-])(?:MANIFEST[\w.-]*|(?:state|train|dcp)[^\s`/,)]*"
                                   r"\.(?:pt|metadata)|rank[^\s`/]*\.distcp|\.metadata\b)", span):
                seen += 1
                assert any(ok(concrete(name)) for ok in names_ok), \
                    f"{page.name}: {name} is not a name elastictrain gives a snapshot object"
            if ".partial" in span:
                assert layout.PARTIAL_PREFIX in span, page.name
    assert seen >= 5


# --- links -----------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens,
    repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#+ (.+?)\s*$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


REPO_PATH = re.compile(r"(?<![\w/.-])((?:elastictrain|tests|scripts|examples|deploy|docs|\.ci)/"
                       r"[\w./*-]*\w)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_repository_paths_named_in_text_exist(page: Path) -> None:
    """A path such as `tests/unit/test_x.py` or `elastictrain/snapshot/memory/rescue.py` in a
    page's text names a file or directory that exists (a glob matches one)."""
    for name in REPO_PATH.findall(page.read_text()):
        path = name.split("::")[0]
        if "*" in path:
            assert list(REPO.glob(path)), f"{page.name}: nothing matches {name}"
        else:
            assert (REPO / path).exists(), f"{page.name} names {name}, which does not exist"


def test_anchor_slugs_follow_github() -> None:
    page = DOCS / "guide.md"
    assert "torchrun-restarts-torch-213-with-gloo" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    for groups in LINK.findall(FENCE.sub("", page.read_text())):
        target = groups[0] or groups[1]
        if "://" in target or target.startswith("mailto:"):
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        assert path.exists(), f"{page.name} links to {target}, which does not exist"
        assert REPO in path.parents or path == REPO, f"{page.name}: {target} leaves the repo"
        if anchor:
            assert path.suffix == ".md", f"{page.name}: #{anchor} on a non-page {path_part}"
            assert anchor in anchors(path), \
                f"{page.name} links to {target}: {path.name} has no heading #{anchor}"


# --- no project history in user docs ---------------------------------------------------

HISTORY = re.compile(
    r"\bsessions? \d|\bissue \d|\bissue #\d|\bissues? \"|\bcommit [0-9a-f]{7}"
    r"|\bbefore the fix|\bafter the fix|\b[Rr]uns? [A-Z]\d?(?=[\s,.:;)|])"
    r"|\bthe (?:old|new) (?:code|version)\b|\bwork period|\bsince this run\b"
    r"|\bbench-goodput-s\d|\blent\b|\bborrowed\b|\bNot implemented yet",
)
# "run [A-Z]" catches run labels ("run P", "in run B"); these capitals are not labels.
NOT_LABELS = re.compile(r"\b[Rr]uns? (?:A|I)\b(?= [a-z])")


def history_lines(text: str) -> list[str]:
    found = []
    for line in text.splitlines():
        cleaned = NOT_LABELS.sub("", line)
        match = HISTORY.search(cleaned)
        if match:
            found.append(f"{match.group(0)!r} in: {line.strip()[:120]}")
    return found


def test_history_pattern_catches_narration() -> None:
    narrated = ("measured in session 7", "issue 10 part 2 made it faster",
                "At commit 3b6046b it hung", "Run P with the pairing", "before the fix it was",
                "in run B the write took", "| run A | run B |",
                "the first GPU lent to this project", "docs/bench-goodput-s8a.json")
    plain = ("a run of 150 s", "each of W ranks", "runs A script", "of a memory snapshot",
             "run `elastictrain demo`", "exit code 75", "the run id")
    for line in narrated:
        assert history_lines(line), line
    for line in plain:
        assert not history_lines(line), line


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_project_history(page: Path) -> None:
    found = history_lines(page.read_text())
    assert not found, f"{page.name} narrates project history:\n" + "\n".join(found)


# --- glossary --------------------------------------------------------------------------


def test_glossary_is_linked_and_one_line_per_term() -> None:
    readme = (REPO / "README.md").read_text()
    assert "](docs/glossary.md" in readme
    entries = [line for line in (DOCS / "glossary.md").read_text().splitlines()
               if line.startswith("- **")]
    terms = {re.match(r"- \*\*([^*]+)\*\*", e).group(1).lower() for e in entries}  # type: ignore[union-attr]
    for term in ("standby", "memory tier", "rescue", "copy behind", "notice", "durable",
                 "goodput"):
        assert term in terms, f"glossary.md lacks {term}"
