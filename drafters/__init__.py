"""One module per drafter. Importing this package registers every built-in drafter type."""
from . import pld, planted, recycling  # noqa: F401
