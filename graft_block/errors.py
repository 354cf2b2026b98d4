"""Errors that name the problem and the fix."""
import sys


class ConfigError(ValueError):
    """A config, checkpoint or argument is malformed or inconsistent with the target."""


class MethodUnavailable(ConfigError):
    """A benchmark method that cannot run here (its bundled checkpoint or llama.cpp build is absent, the target lacks
    what it needs): the bench skips it with this message, where any other ConfigError stops the run."""


def run_command(main, prog: str) -> int:
    """Run a command's ``main()``: a ConfigError (bad input) prints one line ``PROG: error: ...`` and gives exit
    status 2, as argparse does for a bad flag, instead of a traceback."""
    try:
        main()
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def check_options(ap, args, rules) -> None:
    """``ap.error`` (usage and exit status 2) for the first ``(flag, ok, rule)`` whose ``ok`` is false, naming the
    flag, its rule and the value given: commands check their numbers this way before any model loads."""
    for flag, ok, rule in rules:
        if not ok:
            ap.error(f"{flag} must be {rule}, got {getattr(args, flag[2:].replace('-', '_'))}")
