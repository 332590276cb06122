"""Running the CLI in-process from a test: rc (argparse's own errors included), stdout, stderr."""

from __future__ import annotations

from monetlike.cli import main


def run_cli(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
