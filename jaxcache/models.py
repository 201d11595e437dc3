"""DLRM in Flax NNX with its training and prediction steps."""

from jaxcache._src.models import (
    DLRM,
    MLP,
    bce_loss,
    dense_optimizer,
    make_predict_step,
    make_train_step,
)

__all__ = ["DLRM", "MLP", "bce_loss", "dense_optimizer", "make_predict_step", "make_train_step"]
