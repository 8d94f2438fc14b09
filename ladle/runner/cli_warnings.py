"""Warnings as a user of the CLI sees them: ladle's own on one clean line, everyone else's as Python shows them.

Python prints a warning with the source line that raised it under it (`self.model = load_model(...)`
under the random-weights warning): noise to a user, who did not write that line. `install()` (called by
the CLI entry, runner/__main__.py) prints a warning of ladle's own as `ladle: warning: <message>`: one
whose class is defined in ladle's packages, or that is raised from a file in them. Warnings of other
libraries (torch, transformers, ...) keep Python's format, which locates them.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, TextIO

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the `ladle` package


def is_ladle_warning(category: type[Warning], filename: str) -> bool:
    if category.__module__.split(".")[0] == "ladle":
        return True
    try:
        Path(filename).resolve().relative_to(PACKAGE_DIR)
    except (ValueError, OSError):
        return False
    return True


def install() -> None:
    """Route ladle's warnings to one line each; idempotent."""
    if getattr(warnings.showwarning, "ladle", False):
        return
    default = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        if not is_ladle_warning(category, filename):
            default(message, category, filename, lineno, file, line)
            return
        stream: Any = file if file is not None else sys.stderr
        try:
            stream.write(f"ladle: warning: {message}\n")
        except (OSError, AttributeError):  # no usable stderr (as Python's own showwarning tolerates)
            pass

    show.ladle = True  # type: ignore[attr-defined]
    warnings.showwarning = show
