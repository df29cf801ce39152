"""The wire messages of the scheduler's coordination objects (docs/protocol.md §9.4);
the tables of :mod:`.messages` include them."""

from __future__ import annotations

from typing import Any, ClassVar

from .msgbase import Msg

__all__ = ["COORDINATION_STREAM", "COORDINATION_REQUESTS"]


# ------------------------------------------------------------------ coordination (§9.4)
# Named objects the scheduler holds for clients (Variable, Queue, Lock/Semaphore, Event,
# Pub/Sub, datasets). Values are opaque (``data``); ``keys`` are futures' keys the
# object keeps alive; ``client`` is the caller's id (leases, subscriptions and keys
# handed over are tied to it); ``flush`` names a ``coordination-flush`` the caller sent
# on its stream first, so that the graphs of the futures it passes have arrived.


class CoordinationFlushMsg(Msg, tag="coordination-flush"):
    """On the client stream: a marker that requests naming ``uid`` wait for."""

    uid: str


class PubSubSubscribeMsg(Msg, tag="pubsub-subscribe"):
    name: str
    sub: str


class PubSubUnsubscribeMsg(Msg, tag="pubsub-unsubscribe"):
    sub: str


class PubSubPublishMsg(Msg, tag="pubsub-publish"):
    name: str
    data: Any = None


class PubSubGetMsg(Msg, tag="pubsub-get"):
    name: str
    sub: str
    client: str = ""
    timeout: float | None = None
    reply: bool = True


class VariableSetMsg(Msg, tag="variable-set"):
    name: str
    keys: list[Any] = []
    data: Any = None
    client: str = ""
    flush: str = ""
    timeout: float | None = None
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)


class VariableGetMsg(Msg, tag="variable-get"):
    name: str
    client: str = ""
    timeout: float | None = None
    reply: bool = True


class VariableDeleteMsg(Msg, tag="variable-delete"):
    name: str
    reply: bool = True


class QueuePutMsg(Msg, tag="queue-put"):
    name: str
    maxsize: int = 0
    keys: list[Any] = []
    data: Any = None
    client: str = ""
    flush: str = ""
    timeout: float | None = None
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)


class QueueGetMsg(Msg, tag="queue-get"):
    name: str
    maxsize: int = 0
    batch: bool | int = False
    client: str = ""
    timeout: float | None = None
    reply: bool = True


class QueueSizeMsg(Msg, tag="queue-size"):
    name: str
    maxsize: int = 0
    reply: bool = True


class SemaphoreAcquireMsg(Msg, tag="semaphore-acquire"):
    name: str
    max_leases: int
    lease: str
    client: str = ""
    timeout: float | None = None
    reply: bool = True


class SemaphoreReleaseMsg(Msg, tag="semaphore-release"):
    name: str
    lease: str
    reply: bool = True


class SemaphoreValueMsg(Msg, tag="semaphore-value"):
    name: str
    max_leases: int = 0
    reply: bool = True


class EventWaitMsg(Msg, tag="event-wait"):
    name: str
    client: str = ""
    timeout: float | None = None
    reply: bool = True


class EventSetMsg(Msg, tag="event-set"):
    name: str
    reply: bool = True


class EventClearMsg(Msg, tag="event-clear"):
    name: str
    reply: bool = True


class EventIsSetMsg(Msg, tag="event-is-set"):
    name: str
    reply: bool = True


class PublishPutMsg(Msg, tag="publish-put"):
    names: list[Any]
    keys: list[list[Any]] = []
    data: list[Any] = []
    override: bool = False
    client: str = ""
    flush: str = ""
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("names",)


class PublishGetMsg(Msg, tag="publish-get"):
    names: list[Any]
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("names",)


class PublishDeleteMsg(Msg, tag="publish-delete"):
    names: list[Any]
    client: str = ""
    flush: str = ""
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("names",)


class PublishListMsg(Msg, tag="publish-list"):
    reply: bool = True


#: the coordination ops of the client stream (the scheduler hands them to its
#: coordination extension)
COORDINATION_STREAM = (CoordinationFlushMsg, PubSubSubscribeMsg, PubSubUnsubscribeMsg, PubSubPublishMsg)
COORDINATION_REQUESTS = (PubSubGetMsg, VariableSetMsg, VariableGetMsg, VariableDeleteMsg, QueuePutMsg, QueueGetMsg,
                         QueueSizeMsg, SemaphoreAcquireMsg, SemaphoreReleaseMsg, SemaphoreValueMsg, EventWaitMsg,
                         EventSetMsg, EventClearMsg, EventIsSetMsg, PublishPutMsg, PublishGetMsg, PublishDeleteMsg,
                         PublishListMsg)
