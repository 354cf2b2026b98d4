"""Errors that name the problem and the fix."""
import sys


class ConfigError(ValueError):
    """A config, checkpoint or argument is malformed or inconsistent with the target."""


def run_command(main, prog: str) -> int:
    """Run a command's ``main()``: a ConfigError (bad input) prints one line ``PROG: error: ...`` and gives exit
    status 2, as argparse does for a bad flag, instead of a traceback."""
    try:
        main()
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0
