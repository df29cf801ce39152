"""Starting clusters: :class:`LocalCluster`, and :class:`Adaptive` scaling
(``cluster.adapt()``)."""

from .adaptive import Adaptive
from .local import LocalCluster

__all__ = ["Adaptive", "LocalCluster"]
