"""Every command's --help ends with examples, and every example parses with today's flags."""

from __future__ import annotations

import shlex

import pytest

from monetlike.cli import build_parser
from monetlike.cli_help import EXAMPLES


@pytest.mark.parametrize("command", [c for c in EXAMPLES if c])
def test_help_shows_examples(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    assert "examples:\n  monetlike " + command in out


@pytest.mark.parametrize("line", [line for lines in EXAMPLES.values() for line in lines
                                  if "COMMAND" not in line])
def test_every_example_parses(line):
    argv = shlex.split(line)
    assert argv[0] == "monetlike"
    build_parser().parse_args(argv[1:])  # exits (fails the test) on an unknown flag
