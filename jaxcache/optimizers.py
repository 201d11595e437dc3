"""Sparse row optimizers: the classes behind ``jaxcache.sgd`` and the others, and their row state.

``jaxcache.SparseOptimizer`` is the base class of user-defined ones.
"""

from jaxcache._src.optimizers import SGD, Adagrad, Adam, RowStateSpec, RowwiseAdagrad

__all__ = ["SGD", "Adagrad", "Adam", "RowStateSpec", "RowwiseAdagrad"]
