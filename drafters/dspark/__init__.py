"""DSpark: the DFlash block drafter plus a low-rank Markov head (conditions each draft on the previous one) and a
confidence head (estimates acceptance, for scheduling the verify). One concern per module: ``model``
(``DSparkModel``, the heads, block alignment), ``checkpoint`` (DeepSpec's native and export spellings, ours),
``drafter`` (``DSparkDrafter``, registered "dspark": chain or Markov-corrected DDTree), ``training`` (DeepSpec's
loss on the shared block machinery)."""
from .checkpoint import is_dspark_layout, load_checkpoint, new_dspark_model, save_checkpoint
from .drafter import DSparkDrafter
from .model import ALIGNMENTS, ConfidenceHead, DSparkModel, MarkovHead, from_dflash

__all__ = ["ALIGNMENTS", "ConfidenceHead", "DSparkDrafter", "DSparkModel", "MarkovHead", "from_dflash",
           "is_dspark_layout", "load_checkpoint", "new_dspark_model", "save_checkpoint"]
