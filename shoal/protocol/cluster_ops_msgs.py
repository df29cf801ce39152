"""The wire messages of the client's cluster operations (docs/protocol.md §9.3:
``shoal.scheduler.ops``); the tables of :mod:`.messages` include them."""

from __future__ import annotations

from typing import Any, ClassVar

from .msgbase import Msg

__all__ = ["CLUSTER_OPS_REQUESTS", "UploadFileMsg"]


class WaitForWorkersMsg(Msg, tag="wait-for-workers"):
    """To the scheduler: answer once ``n_workers`` workers are registered (an error
    ``TimeoutError`` after ``timeout`` seconds; nil: no limit)."""

    n_workers: int
    timeout: float | None = None
    reply: bool = True


class HasWhatMsg(Msg, tag="has-what"):
    """To the scheduler: the keys each worker holds (``workers``: only these; nil: all)."""

    workers: list[str] | None = None
    reply: bool = True


class ProcessingMsg(Msg, tag="processing"):
    """To the scheduler: the keys given to each worker to compute."""

    workers: list[str] | None = None
    reply: bool = True


class VersionsMsg(Msg, tag="versions"):
    """To the scheduler: the versions it runs (its own; it imports nothing it is sent)."""

    packages: list[str] = []
    reply: bool = True


class RebalancePlanMsg(Msg, tag="rebalance-plan"):
    """To the scheduler: moves that even out the bytes the workers hold (``keys``:
    only these may move; ``workers``: only between these)."""

    keys: list[Any] | None = None
    workers: list[str] | None = None
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)


class AdaptivePlanMsg(Msg, tag="adaptive-plan"):
    """To the scheduler: what adaptive scaling needs of its state for the workers
    ``workers`` names (name -> address, ``""`` while starting): how many workers of
    ``threads_per_worker`` threads the load asks for, and which of them may go."""

    workers: dict[str, str] = {}
    threads_per_worker: int = 1
    target_duration: float = 5.0
    reply: bool = True


class RemoveReplicasMsg(Msg, tag="remove-replicas"):
    """To the scheduler: drop these copies (``{key: [worker, ...]}``), each only while
    another worker holds the key; the scheduler tells the workers to free them."""

    who_has: dict[Any, list[str]] = {}
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("who_has",)


class RestartMsg(Msg, tag="restart"):
    """To the scheduler: cancel every task of every client (``Client.restart``; the
    caller, ``client``, cancels its own futures and is sent no ``cancelled-key``)."""

    client: str = ""
    reply: bool = True


class UploadFileMsg(Msg, tag="upload-file"):
    """To the scheduler (which keeps it for workers that join later and passes it on to
    every worker) and to a worker: a file to write into the worker's directory of
    uploads, put on ``sys.path`` and, with ``load``, import. ``data`` is the file's bytes."""

    filename: str
    data: bytes
    load: bool = True
    reply: bool = True


class RestartWorkersMsg(Msg, tag="restart-workers"):
    """To the scheduler: have the nanny of every worker restart it (``Client.restart``
    of a cluster without a cluster object); ``timeout`` bounds the whole (nil: none)."""

    timeout: float | None = None
    reply: bool = True


CLUSTER_OPS_REQUESTS = (WaitForWorkersMsg, HasWhatMsg, ProcessingMsg, VersionsMsg, RebalancePlanMsg,
                        RemoveReplicasMsg, RestartMsg, RestartWorkersMsg, UploadFileMsg, AdaptivePlanMsg)
