"""One module per drafter. Importing this package registers every built-in drafter type."""
from . import dflash, eagle3, mfd, planted, pld, recycling  # noqa: F401
