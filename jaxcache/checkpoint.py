"""Checkpoints: what a saved step holds (``jaxcache.Checkpointer`` writes and reads them)."""

from jaxcache._src.checkpoint import CheckpointInfo

__all__ = ["CheckpointInfo"]
