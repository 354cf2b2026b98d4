"""Errors that name the problem and the fix."""


class ConfigError(ValueError):
    """A config, checkpoint or argument is malformed or inconsistent with the target."""
