"""One module per drafter. Each registers its type on import; the core finds them through the
``graft_block.drafters`` entry points (pyproject.toml), so importing this package stays cheap."""
from pathlib import Path

from graft_block.drafter import register_checkpoints

register_checkpoints(Path(__file__).resolve().parent / "checkpoints")
