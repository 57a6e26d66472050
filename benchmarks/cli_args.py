"""What the benchmark scripts' command lines share: argparse with the project's manners, and the ``--json`` check.

Imported by scripts run from this folder (``python benchmarks/X.py`` puts it on the path)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """argparse with the project's manners: a refusal is one ``Error:`` line and exit 2."""

    def error(self, message: str):
        sys.stderr.write(f"Error: {message}\nHint: see '{self.prog} --help'\n")
        sys.exit(2)


def check_json_out(ap: argparse.ArgumentParser, value) -> None:
    """``--json VALUE`` names a file that can be written in a folder that exists (refused before any work)."""
    if value is None:
        return
    out = Path(value)
    if not value or out.is_dir() or value.endswith(os.sep):
        ap.error(f"--json {value!r}: a file to write, not a folder")
    if not out.parent.is_dir():
        ap.error(f"--json {value}: the folder {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK):
        ap.error(f"--json {value}: the folder {out.parent} is not writable")
