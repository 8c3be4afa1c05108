"""Issue 32: the `--help` texts are complete: the command's description is its whole first
paragraph (it was cut mid-sentence), every option of every command says what it does
(`--dtype` and `--max-tokens` said nothing), and `serve --help` lists every SEMIF_* variable of
docs/configuration.md and points there."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from semif_serve.cli import build_parser

CONFIGURATION = Path(__file__).parent.parent / "docs" / "configuration.md"


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(subparsers.choices)


def test_the_description_is_a_whole_sentence():
    text = " ".join(build_parser().format_help().split())  # as wrapped for the terminal
    assert "`accept` measure a model or a running server on labelled decisions." in text
    assert "--help" in build_parser().epilog


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_option_of_every_command_has_a_help_text(name):
    parser = commands()[name]
    silent = [
        action.option_strings or [action.dest]
        for action in parser._actions
        if not action.help and not isinstance(action, argparse._HelpAction)
    ]
    assert silent == []


def test_serve_help_lists_every_configuration_variable_and_points_at_its_doc():
    text = commands()["serve"].format_help()
    documented = re.findall(r"^\| `(SEMIF_[A-Z_]+)`", CONFIGURATION.read_text(), re.MULTILINE)
    assert len(documented) > 20
    assert [name for name in documented if name not in re.findall(r"SEMIF_[A-Z_]+", text)] == []
    assert "docs/configuration.md" in text
