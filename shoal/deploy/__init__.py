"""Starting clusters: :class:`LocalCluster` on this machine, :class:`SSHCluster` on
machines reached by ssh and :class:`SlurmCluster` as Slurm jobs (both on the launchers
of :mod:`.spec`), and
:class:`Adaptive` scaling (``cluster.adapt()``)."""

from .adaptive import Adaptive
from .local import LocalCluster
from .spec import DeployedCluster, DeployError, Launched, Launcher, ProcessSpec
from .slurm import SlurmCluster
from .ssh import SSHCluster

__all__ = ["Adaptive", "LocalCluster", "SSHCluster", "SlurmCluster", "DeployError", "DeployedCluster", "Launched", "Launcher",
           "ProcessSpec"]
