"""The ``elastictrain`` command's help and exit codes: every subcommand describes itself,
every option has a help text that shows its default, ``--version`` comes from the
package metadata, ``run --help`` is elastictrain's launcher (not torchrun's text), and
bad input exits 2 on every command."""
from __future__ import annotations

import argparse
from importlib import metadata

import pytest

from elastictrain.cli import build_parser
from elastictrain.core.config import LaunchDefaults
from elastictrain.core.helpformat import HelpFormatter
from elastictrain.launcher.run_help import torchrun_parser


def _commands(parser: argparse.ArgumentParser, name: str = "elastictrain"
              ) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser under ``parser`` (subcommands, and their subcommands), by name."""
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found += _commands(sub, f"{name} {sub_name}")
    return found


COMMANDS = [(n, p) for n, p in _commands(build_parser()) if n != "elastictrain run"]
@pytest.mark.parametrize(("name", "parser"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_every_command_has_a_description_and_every_option_help_with_its_default(
        name: str, parser: argparse.ArgumentParser) -> None:
    assert parser.description, f"{name} has no description"
    formatter = HelpFormatter(prog=name)
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                               argparse._SubParsersAction)):
            continue
        where = f"{name} {'/'.join(action.option_strings) or action.dest}"
        assert action.help, f"{where} has no help"
        shown = (formatter._get_help_string(action) or "") % {"default": action.default}
        if not action.option_strings or action.required or action.default is False:
            continue  # positionals, required options and flags have no default to show
        if action.default is None or action.default == []:
            assert "default" in shown, f"{where}: help does not say what the default is"
        else:
            assert f"(default: {action.default})" in shown, f"{where}: {shown!r}"


def test_seed_zero_is_shown_as_a_default() -> None:
    # 0 == False in Python: the formatter must not take a 0 default for an unset flag.
    demo = dict(_commands(build_parser()))["elastictrain demo"]
    assert "random seed (default: 0)" in " ".join(demo.format_help().split())


def test_version_comes_from_the_package_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"elastictrain {metadata.version('elastictrain')}"


def test_run_help_is_elastictrains_launcher_with_its_defaults() -> None:
    text = " ".join(torchrun_parser().format_help().split())
    defaults = LaunchDefaults()
    assert text.startswith("usage: elastictrain run [options] SCRIPT [ARGS ...]")
    assert "(single GPU)" not in text and "defaults to 30 seconds" not in text
    assert f"default, elastictrain: {defaults.shutdown_timeout_s}; torchrun: 30" in text
    assert f"default, elastictrain: {defaults.signals_to_handle})" in text
    assert "SIGUSR1" in defaults.signals_to_handle
    assert f"default, elastictrain: {defaults.max_restarts}; torchrun: 0" in text
    assert "--no-view" in text and "torchrun's other options" in text
    for code in ("0 finished", "2 usage error", "75 preempted", "76 preempted", "78 fatal"):
        assert code in text, code


def test_run_help_shows_every_torchrun_option_with_a_text_of_ours() -> None:
    from torch.distributed.run import get_args_parser

    text = torchrun_parser().format_help()
    for action in get_args_parser()._actions:
        dashed = [o for o in action.option_strings if "_" not in o]
        for option in dashed:
            assert option in text, option
    assert "see torchrun --help" not in text  # each has a summary of ours


def test_chaos_help_explains_the_storage_placeholder() -> None:
    chaos = dict(_commands(build_parser()))["elastictrain chaos"]
    text = " ".join(chaos.format_help().split())
    assert "-- examples/ddp_resumable.py {storage}" in text
    assert "A command line without {storage} is refused" in text


