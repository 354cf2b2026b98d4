"""graft-block: the shared core under every drafter (target adapter, sampling, verification loop, graft)."""
from .decoder import DecodeState, Result, SpeculativeDecoder, Stats, Verified  # noqa: F401
from .drafter import Drafter, check_budget, register, registered_types  # noqa: F401
from .errors import ConfigError  # noqa: F401
from .sampling import SamplingConfig, choose, target_probs  # noqa: F401
from .target import Target, load_target  # noqa: F401

__version__ = "0.1.0"
