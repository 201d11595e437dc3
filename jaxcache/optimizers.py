"""Sparse row optimizers: the classes behind ``jaxcache.sgd`` and the others, and their registry.

``RowStateSpec`` describes their per-row state. ``jaxcache.SparseOptimizer``
is the base class of user-defined ones; each subclass is registered by name
when it is defined, so checkpoints can rebuild it (``registered`` lists them).
"""

from jaxcache._src.optimizers import SGD, Adagrad, Adam, RowStateSpec, RowwiseAdagrad, registered

__all__ = ["SGD", "Adagrad", "Adam", "RowStateSpec", "RowwiseAdagrad", "registered"]
