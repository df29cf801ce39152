"""Starting clusters: :class:`LocalCluster`."""

from .local import LocalCluster

__all__ = ["LocalCluster"]
