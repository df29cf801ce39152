"""Process-wide settings, overridable by ``SHOAL_*`` environment variables.

Values are read once at import and can be changed at run time with :func:`set`
(tests and benchmarks use it as a context manager).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

_DEFAULTS: dict[str, Any] = {
    # tcp: messages whose buffers exceed this many bytes are (de)serialized in a thread pool
    "offload-threshold": 1 << 20,
    # tcp connections checksum their large frames (both ends must offer it; docs/protocol.md
    # §2.4); 0: this end offers none (only to measure what they cost)
    "wire-checksums": 1,
    # tcp: a single frame larger than this is a protocol error
    "max-frame-bytes": 1 << 36,
    # tcp: more frames than this in one message is a protocol error
    "max-frames": 1 << 20,
    # tcp: a message whose frames add up to more than this is a protocol error
    "max-message-bytes": 1 << 36,
    # tcp: seconds a peer may stay silent in the middle of a message before the
    # connection is closed (0: forever)
    "partial-message-timeout": 30.0,
    # tcp: a request connection (not a stream) idle this many seconds is closed by the
    # server; pools stop reusing their idle connections after half as long (0: never)
    "idle-timeout": 300.0,
    # tcp and tls listeners: connections still in their handshake (strangers: not yet
    # authenticated; over tls the TLS handshake counts), at most, in all and from one
    # peer address. A newcomer is always taken: at the limit, the oldest stranger from
    # its address (per host), or the oldest of all, is closed to make room for it
    # (docs/protocol.md §3.2). Authenticated connections do not count against these
    "max-handshaking": 256,
    "max-handshaking-per-host": 128,
    # tcp and tls listeners: open connections at most, strangers and authenticated
    # ones together; at the limit a newcomer closes the oldest stranger, and is refused
    # only when every open connection is authenticated
    "max-connections": 8192,
    # when fewer than this fraction of the process's descriptor limit (raised to the
    # hard limit when a listener starts) is free, each new connection closes the two
    # oldest strangers of the process's listeners; an accept or an outgoing connection
    # that finds no descriptor closes strangers first, and fails only without any
    "descriptor-reserve": 0.125,
    # frames at least this large are written with a zero-copy path
    "large-frame-bytes": 1 << 20,
    # seconds a connect() waits, including the handshake
    "connect-timeout": 10.0,
    # tcp: a connection whose peer acknowledges nothing for this many seconds (what we
    # sent, or keepalive probes once it is idle) is broken, as after a partition or a
    # host that went away without closing it (0: the kernel's defaults, many minutes)
    "tcp-timeout": 30.0,
    # batched streams coalesce messages over this many seconds once busy,
    # i.e. after this many writes within one interval
    "batched-interval": 0.002,
    "batched-burst": 8,
    # housekeeping messages (releases, free-keys) wait up to this long for a message
    # that must go now, and ride along with it (no write or wake-up of their own)
    "batched-lazy-delay": 0.01,
    # workers and clients send a heartbeat on their scheduler stream this often, in
    # seconds (0: never)
    "heartbeat-interval": 1.0,
    # the scheduler removes a worker it heard nothing from for this many seconds, as if
    # its connection had died (0: never)
    "worker-ttl": 300.0,
    # a worker's fetch of inputs from a peer that fails for want of resources (out of
    # descriptors or memory, here or at the peer) is tried this many times in all, the
    # pause between two attempts starting at gather-retry-delay seconds and doubling
    "gather-attempts": 4,
    "gather-retry-delay": 0.1,
    # a worker asked for a value it is fetching itself (the scheduler names it to the
    # other workers of its host, so that the value crosses to a host once) answers when
    # it has it, or after this many seconds without it (the asker then fetches it from
    # another holder)
    "host-fetch-wait": 30.0,
    # a worker asked by a peer of its host for a value it has not heard of waits this
    # many seconds for the task that makes it the host's fetcher (the scheduler's
    # message to it may come after the asker's request), then answers without it
    "host-fetch-grace": 2.0,
    # a fetch of values from a peer (a worker's of its tasks' inputs, a client's of
    # results) whose answer has not come within this many seconds, plus one second per
    # 10 MB expected, fails as if the connection had broken: the next holder is asked
    # (0: wait for ever). Above host-fetch-wait: a peer may hold a request that long
    "fetch-timeout": 60.0,
    # after this many failed fetches from one peer in a row, a worker's tasks that need
    # a value only that peer holds err with the fetch's error instead of being handed
    # back to the scheduler (which would send them to this worker again)
    "gather-peer-failures": 3,
    # shoal.progress asks the scheduler how far its tasks are this often, in seconds
    "progress-interval": 0.1,
    # connection pool limit (open comms) per pool
    "pool-limit": 512,
    # a task whose arguments are larger than this warns once, suggesting scatter (0: never)
    "large-payload-bytes": 1_000_000,
    # worker results whose buffers hold at least this many bytes go to shared memory
    "shm-threshold": 1 << 16,
    # 1: owners checksum the values they place in shared memory and readers check them
    # as they map them (costs more than the mapping: shoal.comm.shm)
    "shm-verify": 0,
    # numpy arrays of at least this many bytes made by a worker's tasks come from its
    # pool of retired segments (no page faults, no copy to publish them); 0: never
    "shm-alloc-threshold": 1 << 20,
    # a worker keeps the memory of released results for reuse; what no value reused for
    # this many seconds goes back to the system (0: kept until the worker closes)
    "shm-pool-idle": 30.0,
    # ... and at most this many bytes of it (nor more than an eighth of its memory limit;
    # a value no pooled segment fits takes as many bytes out of the pool)
    "shm-pool-bytes": 256 << 20,
    # tasks a worker hands its thread pool beyond one per thread (their inputs all
    # here), so a thread goes from one task to the next without the event loop
    "executor-queue": 1,
    # a worker's memory thresholds, as fractions of its memory limit (0: that rule is
    # off): values beyond the target (by their sizes) move to disk; past spill of the
    # process's memory it spills down to the target; past pause it starts no task and no
    # fetch; past terminate its nanny restarts it
    "memory-target": 0.6,
    "memory-spill": 0.7,
    "memory-pause": 0.8,
    "memory-terminate": 0.95,
    # of a worker's memory limit, what it fetches from peers at once (over the network;
    # mapped segments are not counted), as dask.distributed's memory.transfer (0: no
    # bound but the 64 MiB of one request)
    "memory-transfer": 0.1,
    # seconds between two looks at a worker's process memory (by the worker, and by its
    # nanny for the terminate rule)
    "memory-monitor-interval": 0.1,
    # a worker process has glibc map blocks of this many bytes and more on their own
    # (returned when freed) and give back what is free at the top of its heap past it
    # (0: glibc's defaults; MALLOC_TRIM_THRESHOLD_ or MALLOC_MMAP_THRESHOLD_ in the
    # environment wins)
    "malloc-threshold": 4 << 20,
    # where workers keep their spilled values (a directory of their own under it);
    # "" is the system's temporary directory
    "local-directory": "",
    # a nanny stops restarting its worker after more than this many crashes (deaths
    # that were not asked for, memory past terminate) within nanny-restart-window seconds
    "nanny-max-restarts": 5,
    "nanny-restart-window": 60.0,
    # the dashboard sends each open page an update this often, in seconds
    "dashboard-interval": 1.0,
    # 1: the dashboard is served without login (on a loopback address only; warns):
    # anyone on this host sees the workers and the counts by key prefix, never a task's
    # key or error unless they log in (docs/dashboard.md)
    "dashboard-open": 0,
    # 1: /metrics is served without login (it shows counts, never keys or errors)
    "metrics-public": 0,
    # the dashboard's connections at most, in all and from one peer host; past either,
    # the oldest idle connection that has not logged in is dropped for a new one
    "dashboard-max-connections": 256,
    "dashboard-max-connections-per-host": 128,
    # seconds a dashboard connection has to send a whole request head, from when it
    # opened or its previous answer was made (then it is closed: slow or silent clients)
    "dashboard-header-timeout": 10.0,
    # task-stream records the scheduler keeps (the oldest go first): what the dashboard,
    # get_task_stream and performance_report can show
    "dashboard-task-stream-size": 100_000,
    # while a scheduler or a worker runs in a process, the cyclic garbage collector's
    # young generation is collected after this many allocations at the least (Python's
    # default: 700), so full passes over every object come that much less often
    # (shoal.gcpolicy; 0: the collector is left as it is)
    "gc-threshold": 10_000,
    # function cache entries
    "function-cache-size": 1000,
    # functions whose serialized form is larger than this are not cached
    "function-cache-max-bytes": 100_000,
}


def _from_env(name: str, default: Any) -> Any:
    raw = os.environ.get("SHOAL_" + name.upper().replace("-", "_"))
    if raw is None:
        return default
    return type(default)(raw)


_config: dict[str, Any] = {k: _from_env(k, v) for k, v in _DEFAULTS.items()}


def get(name: str) -> Any:
    """Return the current value of setting ``name`` (raises ``KeyError`` if unknown)."""
    return _config[name]


@contextlib.contextmanager
def set(**values: Any) -> Iterator[None]:
    """Change settings (``offload_threshold=0`` sets ``offload-threshold``) for a block."""
    changes = {k.replace("_", "-"): v for k, v in values.items()}
    unknown = [k for k in changes if k not in _config]
    if unknown:
        raise KeyError(f"unknown shoal setting(s): {', '.join(unknown)}")
    old = {k: _config[k] for k in changes}
    _config.update(changes)
    try:
        yield
    finally:
        _config.update(old)
