"""Wire protocol: messages, frames, serializer families, function cache. No asyncio."""

from .core import dumps, loads, prepare, unwrap
from .leases import Lease, lease
from .functions import clear_function_cache, dumps_function, function_cache_info, loads_function
from .serialize import (
    DESTINATIONS,
    NEUTRAL,
    REMOTE,
    SAME_HOST,
    SAME_PROCESS,
    Serialize,
    Serialized,
    deserialize,
    register_serializer,
    serialize,
    sizeof,
    to_serialize,
)

from . import neutral as _neutral  # noqa: F401 - its families: shoal.value, shoal.array

PROTOCOL_VERSION = 5

__all__ = [
    "PROTOCOL_VERSION",
    "Lease",
    "lease",
    "dumps",
    "loads",
    "prepare",
    "unwrap",
    "dumps_function",
    "loads_function",
    "function_cache_info",
    "clear_function_cache",
    "DESTINATIONS",
    "NEUTRAL",
    "REMOTE",
    "SAME_HOST",
    "SAME_PROCESS",
    "Serialize",
    "Serialized",
    "deserialize",
    "register_serializer",
    "serialize",
    "sizeof",
    "to_serialize",
]
