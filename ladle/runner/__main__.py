"""`ladle` / `python -m ladle` / `python -m runner`: the start-up step, then the CLI (runner/cli.py, docs/RUNNER.md).

This module imports nothing heavy: runner/startup.py must act before torch is loaded (torch's OpenMP
runtime reads its environment when it loads; a malloc is preloaded by re-executing the process).
`LADLE_STARTUP=0` skips the step.
"""

from __future__ import annotations


def main() -> None:
    from ladle.runner.startup import prepare

    prepare()  # may re-execute this process once (LD_PRELOAD); returns when it is done
    from ladle.runner.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
