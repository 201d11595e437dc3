"""Demo data: a Criteo-shaped synthetic click stream, its published shapes, and ROC AUC."""

from jaxcache._src.metrics import roc_auc
from jaxcache._src.synthetic import (
    CRITEO_KAGGLE_CARDINALITIES,
    DCNV2_BAG_SIZES,
    SyntheticCriteo,
)

__all__ = ["CRITEO_KAGGLE_CARDINALITIES", "DCNV2_BAG_SIZES", "SyntheticCriteo", "roc_auc"]
