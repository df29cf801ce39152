"""Request/response servers, proxies, a connection pool and batched streams."""

from .batched import BatchedSend, read_batch, send_heartbeats, without_values
from .core import Server, error_message, raise_error_message, request, result_of, send_recv
from .pool import ConnectionPool, PooledRPC, fetch_deadline, rpc

__all__ = [
    "BatchedSend",
    "read_batch",
    "send_heartbeats",
    "without_values",
    "ConnectionPool",
    "fetch_deadline",
    "PooledRPC",
    "Server",
    "error_message",
    "raise_error_message",
    "request",
    "result_of",
    "rpc",
    "send_recv",
]
