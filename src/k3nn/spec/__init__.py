"""Speculative decoding: DSpark drafting, one-forward verification, KDA state rollback, drafter training."""

from ..layers.dspark import DSparkConfig, DSparkDrafter

from .generate import SpecOptions, SpecStats, speculative_generate
from .rollback import ROLLBACK_STRATEGIES, SpecKDAState, WindowRollback, rollback_memory_bytes
from .session import clear_sessions
from .verify import greedy_accept, rejection_accept, synthetic_accept

__all__ = ["DSparkConfig", "DSparkDrafter", "SpecOptions", "SpecStats", "speculative_generate", "ROLLBACK_STRATEGIES", "SpecKDAState",
           "WindowRollback", "rollback_memory_bytes", "clear_sessions", "greedy_accept", "rejection_accept", "synthetic_accept"]
from .train import DSparkTrainer, dspark_loss, sample_anchors  # noqa: E402

__all__ += ["DSparkTrainer", "dspark_loss", "sample_anchors"]
