"""dask.distributed's scheduler without IO: ``SchedulerState`` driven by virtual workers.

The counterpart of ``run_shoal`` in ``bench/sim.py`` (same graphs, same model, same
:class:`~bench.sim.Result`): one graph is submitted by one client to ``n_workers``
virtual workers of 1 thread each; every ``compute-task`` the scheduler sends goes into a
FIFO, and the oldest one "finishes" as one ``task-finished`` message handled on its own.
Only the CPU time spent inside the scheduler (``time.process_time`` around each call) is
counted.

What of ``distributed.scheduler.Scheduler`` (2026.8) it reproduces
-------------------------------------------------------------------
``_SimState`` is a ``SchedulerState`` which also carries the *synchronous, IO-free*
handlers of ``Scheduler``, taken from that class as plain functions and executed
unchanged on this state (they only touch ``SchedulerState`` attributes, plus
``generation`` / ``_last_time``, which ``_SimState`` adds). So the code measured is the
code a real scheduler runs for these events:

* adding a worker: what ``Scheduler.add_worker`` does to the state -- a ``WorkerState``
  built with the same arguments, ``workers``, ``running``, ``host_info``,
  ``total_memory``, ``total_nthreads`` (+ history), ``aliases``,
  ``check_idle_saturated``, then ``transitions(bulk_schedule_unrunnable_after_adding_worker)``
  and ``stimulus_queue_slots_maybe_opened`` (no-ops here: the graph comes later);
* a client: ``ClientState("client")`` in ``clients``, as ``Scheduler.add_client`` does;
* the submit: the synchronous part of ``Scheduler.update_graph`` on an already
  materialized graph (a dict of ``dask._task_spec.Task``, which is what
  ``_materialize_graph`` hands it): ``dask.order.order`` (the real scheduler runs it
  there when the client sends no priorities, as ``Client.compute``/``persist`` do; its
  share is in ``extra["order_s"]``), ``_find_lost_dependencies``, then
  ``_create_taskstate_from_graph`` (``Computation``, ``_generate_taskstates`` with
  ``new_task`` / ``add_dependency``, ``_set_priorities``, ``client_desires_keys``, the
  ``{key: "waiting"}`` recommendations for the wanted keys in priority order, and
  ``transitions``);
* a finished task: ``Scheduler.handle_task_finished`` with the fields of a worker's
  ``TaskFinishedMsg`` (``nbytes``, ``type``, ``typename``, ``metadata``, ``thread``,
  ``startstops`` with one ``compute`` of ``duration`` seconds, ``status``), i.e.
  ``stimulus_task_finished`` -> ``_transitions`` -> ``send_all`` ->
  ``stimulus_queue_slots_maybe_opened`` (which sends queued root-ish tasks to the
  workers that freed up). Root-task queuing stays at dask's default configuration
  (``distributed.scheduler.worker-saturation``, 1.1 by default), as does every other
  setting (``distributed.scheduler.validate``, ``distributed.admin.low-level-log-length``;
  ``transition_counter_max`` is ``Scheduler``'s default, False).

What it leaves out
------------------
* All IO: comms, ``BatchedSend`` (``send_all`` appends the messages to an in-memory
  outbox instead of the per-worker batched streams), serialization and deserialization
  of the graph, ``_materialize_graph`` (the graph is built as ``Task`` objects
  beforehand, like shoal's ``NewTask`` list, and not timed), ``_cull`` (only done for
  low-level-graph expressions; these graphs have nothing to cull), event logging
  (``log_event`` is a no-op), metrics digests, heartbeats (``heartbeat_worker`` only
  updates bandwidth/memory metrics), ``_refresh_no_workers_since``.
* The default extensions and scheduler plugins: work stealing (its ``transition``
  hook and periodic balancing), spans (``observe_tasks`` in update_graph), the shuffle
  plugin, the active memory manager, etc. ``plugins`` and ``extensions`` are empty, so
  these numbers are a lower bound for a default ``Scheduler``.
* Worker-side behaviour: a finished task's data is never fetched, dropped or lost, so
  there is no ``add-keys`` / ``release-worker-data`` / ``missing-data`` traffic; the
  ``free-keys`` and ``key-in-memory`` messages are produced and ignored.
"""

from __future__ import annotations

import gc
import operator
import pickle
import time
import tracemalloc
from collections import Counter, deque
from collections.abc import Collection
from typing import Any, cast

import dask
import dask.order
from dask._task_spec import GraphNode, Task, TaskRef
from dask.typing import Key
from distributed.collections import HeapSet
from distributed.core import Status
from distributed.metrics import time as dask_time
from distributed.scheduler import ClientState, Scheduler, SchedulerState, TaskState, WorkerState
from sortedcontainers import SortedDict

from bench.sim import Graph, Result, _retained_per_task, finish_all

__all__ = ["run_dask"]

#: ``{client or worker address: [message, ...]}``, what the scheduler hands to ``send_all``
Msgs = dict[str, list[dict[str, Any]]]

CLIENT = "client"
#: what a worker reports as the result's type (``pickle.dumps(type(result))``) and ``typename``
_RESULT_TYPE = pickle.dumps(bytes)
_RESULT_TYPENAME = "bytes"
#: per-worker memory limit (bytes); only used by dask for its "inputs bigger than the
#: worker" safety check and the memory totals
_MEMORY_LIMIT = 4 * 2**30


#: ``Scheduler``, for taking its handlers as plain functions (typed ``Any``: they are
#: annotated ``self: Scheduler`` and run here on a ``SchedulerState``)
_Scheduler = cast(Any, Scheduler)


def _placeholder(*args: Any) -> None:
    """The function every task's ``run_spec`` would call (never called here)."""


class _SimState(SchedulerState):
    """``SchedulerState`` plus the IO-free event handlers of ``Scheduler``.

    The handlers are ``Scheduler``'s own functions, run on this object; the only
    methods defined here are the IO ones, which record instead of sending.
    """

    # The synchronous part of update_graph and its helpers
    _find_lost_dependencies = _Scheduler._find_lost_dependencies
    _create_taskstate_from_graph = _Scheduler._create_taskstate_from_graph
    _generate_taskstates = _Scheduler._generate_taskstates
    _apply_annotations = _Scheduler._apply_annotations
    _set_priorities = _Scheduler._set_priorities
    client_desires_keys = _Scheduler.client_desires_keys
    coerce_address = _Scheduler.coerce_address  # (workers= annotations)
    report_on_key = _Scheduler.report_on_key
    # transitions() = _transitions() + send_all()
    transitions = _Scheduler.transitions
    # The worker's "task-finished" stream handler
    handle_task_finished = _Scheduler.handle_task_finished
    stimulus_task_finished = _Scheduler.stimulus_task_finished
    stimulus_queue_slots_maybe_opened = _Scheduler.stimulus_queue_slots_maybe_opened

    def __init__(self) -> None:
        # The containers Scheduler.__init__ hands to SchedulerState.__init__
        super().__init__(
            aliases={},
            clients={},
            workers=SortedDict(),
            host_info={},
            resources={},
            tasks={},
            unrunnable={},
            queued=HeapSet(key=operator.attrgetter("priority")),
            validate=bool(dask.config.get("distributed.scheduler.validate")),
            plugins=(),
            transition_counter_max=False,  # Scheduler(transition_counter_max=False), its default
        )
        # Scheduler attributes used by _set_priorities
        self.generation = 0
        self._last_time = 0.0
        #: worker messages in the order they would have been sent
        self.worker_outbox: list[tuple[str, list[dict[str, Any]]]] = []
        self.client_msgs_sent = 0

    # --------------------------------------------------------------- the IO, recorded

    def send_all(self, client_msgs: Msgs, worker_msgs: Msgs) -> None:
        for msgs in client_msgs.values():
            self.client_msgs_sent += len(msgs)
        if worker_msgs:
            self.worker_outbox.extend(worker_msgs.items())

    def report(self, msg: dict[str, Any], ts: TaskState | None = None, client: str | None = None) -> None:
        self.client_msgs_sent += 1

    def log_event(self, topic: str | Collection[str], msg: Any) -> None:
        pass

    # ------------------------------------------------------------ what add_worker does

    def add_virtual_worker(self, address: str, nthreads: int, name: int,
                           resources: dict[str, float] | None = None) -> WorkerState:
        """What ``Scheduler.add_worker`` does to the state for a new running worker."""
        if address in self.workers:
            raise ValueError(f"Worker already exists {address}")
        ws = WorkerState(
            address=address,
            status=Status.running,
            pid=0,
            nthreads=nthreads,
            memory_limit=_MEMORY_LIMIT,
            name=name,
            local_directory=f"/tmp/dask-scratch-space/worker-{name}",
            services={},
            versions={},
            nanny="",
            extra={},
            server_id=f"Worker-{name}-{address}",
            scheduler=self,
        )
        self.workers[address] = ws
        self.running.add(ws)
        dh = self.host_info.setdefault(ws.host, {})
        dh.setdefault("addresses", set()).add(address)
        dh["nthreads"] = dh.get("nthreads", 0) + nthreads
        dh["last-seen"] = dask_time()
        self.total_memory += ws.memory_limit
        self.total_nthreads += nthreads
        self.total_nthreads_history.append((dask_time(), self.total_nthreads))
        self.aliases[name] = address
        for resource, quantity in (resources or {}).items():  # as Scheduler.add_resources
            ws.resources[resource] = quantity
            ws.used_resources[resource] = 0
            self.resources.setdefault(resource, {})[address] = quantity
        self.check_idle_saturated(ws)
        stimulus_id = f"add-worker-{dask_time()}"
        self.transitions(self.bulk_schedule_unrunnable_after_adding_worker(ws), stimulus_id)
        self.stimulus_queue_slots_maybe_opened(stimulus_id=stimulus_id)
        return ws


def run_dask(graph: Graph, n_workers: int, nbytes: int = 100_000, duration: float = 0.001,
             validate_every: int = 0, memory: bool = False) -> Result:
    """Drive dask.distributed's ``SchedulerState`` through ``graph`` on ``n_workers``
    virtual workers (see the module docstring and ``bench/sim.py``). With
    ``validate_every``, ``validate_state()`` runs after that many finished tasks (and at
    the end)."""
    res = Result("dask", graph.name, n_workers, len(graph.keys), graph.edges)
    workers = [f"tcp://10.{i // 65536}.{i // 256 % 256}.{i % 256}:9000" for i in range(n_workers)]
    n_tasks = len(graph.keys)

    def submit() -> tuple[_SimState, float, float]:
        state = _SimState()
        for i, addr in enumerate(workers):
            state.add_virtual_worker(addr, 1, i, {"GPU": 1.0} if graph.constraint == "gpu" else None)
        state.clients[CLIENT] = ClientState(CLIENT, versions={})
        state.worker_outbox.clear()
        # The materialized graph update_graph works on: {key: Task(key, func, *TaskRef(dep))},
        # with new key strings (counted with --memory)
        keys = [k.encode().decode() for k in graph.keys]
        dsk: dict[Key, GraphNode] = {
            k: Task(k, _placeholder, *[TaskRef(keys[d]) for d in deps]) for k, deps in zip(keys, graph.deps)
        }
        wanted: set[Key] = {keys[i] for i in graph.wanted}
        annotations: dict[str, dict[Key, Any]] = {}
        if graph.constraint == "pinned":
            annotations["workers"] = {k: [workers[i % n_workers]] for i, k in enumerate(keys)}
        elif graph.constraint == "gpu":
            annotations["resources"] = {k: {"GPU": 1.0} for k in keys}
        del keys
        start = dask_time()
        stimulus_id = f"update-graph-{start}"
        t0 = time.process_time()
        # update_graph: no internal_priority from the client -> dask.order.order
        ordered = dask.order.order(dsk)
        t_order = time.process_time()
        if state._find_lost_dependencies(dsk, wanted):
            raise RuntimeError("graph has lost dependencies")
        state._create_taskstate_from_graph(
            start=start,
            dsk=dsk,
            keys=wanted,
            ordered=ordered,
            client=CLIENT,
            annotations_by_type=annotations,
            global_annotations=None,
            stimulus_id=stimulus_id,
            submitting_task=None,
            span_metadata={"collections": []},
            user_priority=0,
            actors=None,
            fifo_timeout=0.0,
            code=(),
        )
        t1 = time.process_time()
        # the inputs go, as run_shoal drops its event (the Task objects live on as the
        # TaskStates' run_spec)
        del ordered, dsk, wanted
        return state, t1 - t0, t_order - t0

    if memory:
        res.bytes_per_task = _retained_per_task(submit, n_tasks)
    state, res.submit_s, res.extra["order_s"] = submit()
    res.events = 1

    #: (worker address, key, run_id) of every compute-task sent, oldest first
    running: deque[tuple[str, str, int]] = deque()
    other_msgs: Counter[str] = Counter()

    def collect(_: Any = None) -> None:
        for addr, msgs in state.worker_outbox:
            for msg in msgs:
                if msg["op"] != "compute-task":
                    other_msgs[msg["op"]] += 1
                    continue
                running.append((addr, msg["key"], msg["run_id"]))
                sizes = msg["nbytes"]
                for dep, holders in msg["who_has"].items():
                    n = sizes.get(dep, 0)
                    res.input_bytes += n
                    if addr not in holders:
                        res.moved_bytes += n
        state.worker_outbox.clear()

    handle = state.handle_task_finished

    def finish(task: tuple[str, str, int], _: int) -> None:
        addr, key, run_id = task
        stop = dask_time()  # (timed with the call: ~1 µs of a task's 100-200)
        # the worker's TaskFinishedMsg, as Scheduler.handle_stream passes it on
        handle(key=key, worker=addr, stimulus_id=f"task-finished-{stop}", run_id=run_id, nbytes=nbytes,
               type=_RESULT_TYPE, typename=_RESULT_TYPENAME, metadata={}, thread=0,
               startstops=[{"action": "compute", "start": stop - duration, "stop": stop}], status="OK")

    collect()
    finish_all(res, running, finish, collect, state.validate_state, validate_every)
    res.extra["left"] = dict(Counter(ts.state for ts in state.tasks.values()))
    res.extra["other_worker_msgs"] = dict(other_msgs)
    res.extra["client_msgs"] = state.client_msgs_sent
    res.extra["transitions"] = state.transition_counter
    return res
