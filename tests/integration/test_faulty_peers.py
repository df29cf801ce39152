"""Workers that misbehave on the wire (authenticated, but buggy), played by a fake
worker in this process (``foreign_worker.ForeignWorker``, written from
docs/protocol.md: msgpack over the real authenticated tcp connections) beside a
``shoal scheduler`` and ``shoal worker`` processes. Each case ends with the right value
(checked against plain Python) or a clear error within its timeout:

- a ``task-finished`` for a key the worker was never given does not make it a holder;
- a ``missing-data`` naming another worker does not lose a scattered value it holds,
  nor do such reports from two workers sent to fetch it, each saying it twice: the
  scheduler asks the holder, which says it holds the value;
- a holder that answers the fetch too late but the scheduler's question in time keeps
  its value (an event loop held up for a while);
- a holder that answers ``get-data`` without the key (and the scheduler's question as
  well) is asked a few times, not a thousand times a second, and the task that needs
  the value ends with a clear error;
- a holder that never answers ``get-data`` nor the scheduler's question: the fetches
  give up at their deadline and, two workers having said so, the holder is removed and
  the value made again elsewhere; ``Future.result(timeout=)`` returns by its timeout.
"""

from __future__ import annotations

import operator
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import shoal
from foreign_wire import WireError
from foreign_worker import ForeignWorker
from shoal.comm import security
from shoal.comm.core import local_info
from shoal_helpers import auth_files, free_port, stop_processes

#: seconds the workers (and this process's client) wait for a get-data answer
FETCH_TIMEOUT = 1.5
#: seconds the scheduler gives a worker to show it is alive, and a holder to answer its
#: question (has-keys)
WORKER_TTL = 5.0
#: seconds a test waits for a condition before it fails
DEADLINE = 30.0


class Cluster:
    """A ``shoal scheduler`` and ``shoal worker`` processes (one thread each, no nanny),
    their logs in files."""

    def __init__(self, logs: str):
        self.logs = logs
        self.procs: list[subprocess.Popen[str]] = []
        self.files: list[Any] = []
        self.address = ""
        self.workers: list[str] = []

    def _start(self, name: str, *args: str) -> tuple[subprocess.Popen[str], str]:
        err = open(os.path.join(self.logs, f"{name}.log"), "w")  # noqa: SIM115 - closed in stop()
        self.files.append(err)
        env = {**os.environ, "SHOAL_FETCH_TIMEOUT": str(FETCH_TIMEOUT), "SHOAL_WORKER_TTL": str(WORKER_TTL)}
        p = subprocess.Popen([sys.executable, "-m", "shoal", *args], stdout=subprocess.PIPE, stderr=err, text=True,
                             env=env)
        self.procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith(f"shoal {args[0]} at tcp://"), (line, self.log_tail())
        return p, line.split()[-1]

    def start(self, n_workers: int) -> Cluster:
        _, self.address = self._start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", str(free_port()))
        for i in range(n_workers):
            self.add_worker(f"w{i}")
        return self

    def add_worker(self, name: str) -> str:
        _, address = self._start(name, "worker", self.address, "--no-nanny", "--nthreads", "1", "--name", name)
        self.workers.append(address)
        return address

    def log_tail(self) -> str:
        out = []
        for f in self.files:
            f.flush()
            with open(f.name, errors="replace") as r:
                out.append(f"--- {os.path.basename(f.name)}\n{r.read()[-3000:]}")
        return "\n".join(out)

    def stop(self, auth_before: set[str]) -> None:
        stop_processes(self.procs, auth_before)
        for f in self.files:
            f.close()


class FaultyPeer(ForeignWorker):
    """A worker that runs tasks as the protocol says, on this host (so that it is
    listed among the holders near the Python workers), and answers ``get-data`` and
    the scheduler's ``has-keys`` as ``serve`` says: ``"honest"``; ``"without"`` (answers
    without any key); ``"silent"`` (no answer, the connection left open); ``"late"``
    (its first get-data is answered only once the scheduler has asked has-keys, which
    is answered at once: an event loop held up past the fetcher's deadline). It counts
    the requests it is sent, sends heartbeats, and any stream message it is told to."""

    def __init__(self, scheduler_address: str, serve: str = "honest", port: int = 0):
        super().__init__(scheduler_address, name=f"faulty-{serve}", shm=False, port=port)
        self.host_id = local_info()["host"]
        self.serve = serve
        self.get_data_requests = 0
        self.has_keys_requests = 0
        #: a key whose holder it says did not hand it out (without asking), ``lies`` times
        self.lie_about: Any = None
        self.lies = 1
        #: its lies say the holder took the request and did not serve it
        self.lie_unserved = False
        self._asked = threading.Event()
        self._send_lock = threading.Lock()

    def start(self) -> FaultyPeer:
        super().start()
        self._spawn(self._heartbeats, "faulty-heartbeat")
        return self

    def _heartbeats(self) -> None:
        # the scheduler's worker-ttl is short here: a sign of life twice a second
        while not self._stop.wait(0.5) and not self.stream_ended.is_set():
            try:
                self.say({"op": "heartbeat"})
            except (OSError, WireError):
                return  # the stream is gone (the scheduler removed us, or the test ends)

    def _fetch(self, dep: Any, holders: list[str], info: Any, out: list[dict[str, Any]]) -> tuple[bool, Any]:
        if dep == self.lie_about and self.lies > 0:
            self.lies -= 1
            lie: dict[str, Any] = {"op": "missing-data", "key": dep, "errant_worker": holders[0]}
            if self.lie_unserved:
                lie["unserved"] = True
            out.append(lie)
            return False, None  # (the task is given back: reschedule)
        return super()._fetch(dep, holders, info, out)

    def _get_data(self, keys: list[Any]) -> dict[str, Any]:
        with self._lock:
            self.get_data_requests += 1
            first = self.get_data_requests == 1
        if self.serve == "without":
            return {"status": "OK", "result": {"data": {}}}
        if self.serve == "silent":
            self._stop.wait()  # until the test ends: the connection stays open, unanswered
        if self.serve == "late" and first:
            # held up until the scheduler asks: the fetcher has given up by then
            _wait_or_stop(self._asked, self._stop)
        return super()._get_data(keys)

    def _has_keys(self, keys: list[Any]) -> dict[str, Any]:
        with self._lock:
            self.has_keys_requests += 1
        self._asked.set()
        if self.serve == "without":
            return {"status": "OK", "result": {"held": []}}
        if self.serve == "silent":
            self._stop.wait()
        return super()._has_keys(keys)

    def _serve(self, conn: socket.socket) -> None:
        try:
            super()._serve(conn)
        except (OSError, WireError):
            if self.serve != "late":
                raise
            # (the late answer found the fetcher gone: that is the point)

    def _send(self, msgs: list[dict[str, Any]]) -> None:
        with self._send_lock:  # (the stream thread sends too)
            super()._send(msgs)

    def say(self, *msgs: dict[str, Any]) -> None:
        """Send ``msgs`` on the scheduler stream, as this worker."""
        self._send(list(msgs))


def _wait_or_stop(event: threading.Event, stop: threading.Event) -> None:
    while not event.wait(0.1) and not stop.is_set():
        pass


@pytest.fixture
def cluster(tmp_path: Any) -> Iterator[Callable[[int], Cluster]]:
    made: list[Cluster] = []
    before = auth_files()

    def make(n_workers: int) -> Cluster:
        c = Cluster(str(tmp_path))
        made.append(c)
        return c.start(n_workers)

    try:
        yield make
    finally:
        for c in made:
            c.stop(before)


@pytest.fixture
def peers() -> Iterator[list[FaultyPeer]]:
    started: list[FaultyPeer] = []
    try:
        yield started
    finally:
        for p in started:
            p.stop()
        errors = [e for p in started for e in p.errors]
        assert not errors, errors


def faulty_peer(peers: list[FaultyPeer], c: Cluster, serve: str = "honest", port: int = 0) -> FaultyPeer:
    p = FaultyPeer(c.address, serve, port)
    peers.append(p)  # stopped by the fixture even if start() fails
    p.secret = security.read_secret(security.auth_file_for(c.address))
    return p.start()


def port_listed_first(than: list[str]) -> int:
    """A free port whose address sorts before ``than`` (holders of one host are listed
    in the order of their addresses): the Python workers listen on ephemeral ports."""
    for port in range(10000, 30000, 97):
        if all(f"tcp://127.0.0.1:{port}" < a for a in than):
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise AssertionError(f"no free port sorts before {than}")


@pytest.mark.timeout(90)
def test_a_task_finished_for_a_key_never_given_does_not_reach_dependents(cluster, peers) -> None:
    c = cluster(2)
    w1, w2 = c.workers
    liar = faulty_peer(peers, c, port=port_listed_first(c.workers))
    with shoal.Client(c.address, timeout=10) as client:
        x = client.submit(operator.add, 1, 1, workers=[w1])
        assert x.result(timeout=DEADLINE) == 2
        # "I computed x too": with a wrong value, which it would hand to whoever asks it
        with liar._lock:
            liar.data[x.key] = 999
        # (a report about a key nobody knows comes after it: freed once the lie is handled)
        liar.say({"op": "task-finished", "key": x.key, "nbytes": 28, "duration": 0.001},
                 {"op": "task-finished", "key": "sync"})
        assert liar.wait_freed("sync", DEADLINE)
        # a dependent on a worker of the same host that must fetch x: from its holder
        y = client.submit(operator.mul, x, 3, workers=[w2])
        assert y.result(timeout=DEADLINE) == operator.mul(operator.add(1, 1), 3)
        assert liar.get_data_requests == 0
        assert client.who_has([x]) == {x.key: [w1]}
        assert liar.wait_freed(x.key, DEADLINE), "the liar was not told to free x"


@pytest.mark.timeout(90)
def test_a_missing_data_naming_another_worker_does_not_lose_a_scattered_value(cluster, peers) -> None:
    c = cluster(1)
    (w,) = c.workers
    peer = faulty_peer(peers, c)
    with shoal.Client(c.address, timeout=10) as client:
        [v] = client.scatter([list(range(10))], workers=[w])
        # a worker never sent to fetch v says, again and again, that w did not give it v
        peer.say(*[{"op": "missing-data", "key": v.key, "errant_worker": w} for _ in range(5)])
        # the same worker, sent a task that needs v, says so once: one word is not enough
        peer.lie_about = v.key
        d = client.submit(sum, v, workers=[peer.address], pure=False)
        assert d.result(timeout=DEADLINE) == sum(range(10))
        assert client.who_has([v]) == {v.key: [w]}
        assert v.result(timeout=DEADLINE) == list(range(10))
        assert client.submit(len, v, workers=[w]).result(timeout=DEADLINE) == 10


@pytest.mark.timeout(90)
def test_two_workers_saying_twice_that_a_holder_did_not_serve_do_not_lose_its_scattered_value(cluster,
                                                                                              peers) -> None:
    """Two workers sent to fetch a scattered value each say twice that its one holder
    took their request and did not serve it: the scheduler asks the holder, which says
    it holds the value, and keeps it (before, the second such report removed the holder
    and the value was lost)."""
    c = cluster(1)
    (w,) = c.workers
    liars = [faulty_peer(peers, c), faulty_peer(peers, c)]
    with shoal.Client(c.address, timeout=10) as client:
        [v] = client.scatter([list(range(10))], workers=[w])
        for liar in liars:
            liar.lie_about, liar.lies, liar.lie_unserved = v.key, 2, True
        ds = [client.submit(sum, v, workers=[liar.address], pure=False) for liar in liars]
        # each lies twice (its task is given back and sent again), then fetches v and sums it
        assert [d.result(timeout=DEADLINE) for d in ds] == [sum(range(10))] * 2
        assert [liar.lies for liar in liars] == [0, 0]
        assert client.who_has([v]) == {v.key: [w]}
        assert v.result(timeout=DEADLINE) == list(range(10))
        assert client.submit(len, v, workers=[w]).result(timeout=DEADLINE) == 10
        assert w in client.scheduler_info()["workers"]


@pytest.mark.timeout(90)
def test_a_holder_that_answers_the_fetch_late_but_the_scheduler_in_time_keeps_its_value(cluster, peers) -> None:
    """The holder takes the fetch and answers it only after the fetcher's deadline (as
    a worker whose event loop a long call holds up), but answers the scheduler's
    question: it keeps the value, and the fetcher, sent its task again, gets it."""
    c = cluster(1)
    (w,) = c.workers
    holder = faulty_peer(peers, c, "late")
    with shoal.Client(c.address, timeout=10) as client:
        x = client.submit(operator.add, 20, 1, workers=[holder.address])
        shoal.wait([x], timeout=DEADLINE)
        y = client.submit(operator.mul, x, 2, workers=[w])
        assert y.result(timeout=DEADLINE) == operator.mul(operator.add(20, 1), 2)
        assert holder.get_data_requests == 2 and holder.has_keys_requests >= 1
        assert client.who_has([x]) == {x.key: [holder.address]}
        assert not holder.stream_ended.is_set()


@pytest.mark.timeout(90)
def test_a_holder_that_answers_without_its_value_ends_the_task_with_a_clear_error(cluster, peers) -> None:
    """It answers get-data without the value, and the scheduler's question the same way:
    its copy is dropped and made again (on it: the task prefers it), and the worker that
    needs it, answered without it three times in a row, errs the task that needs it."""
    c = cluster(0)
    bad = faulty_peer(peers, c, "without")
    with shoal.Client(c.address, timeout=10) as client:
        x = client.submit(operator.add, 20, 1, workers=[bad.address], allow_other_workers=True)
        shoal.wait([x], timeout=DEADLINE)
        w = c.add_worker("w0")
        y = client.submit(operator.mul, x, 2, workers=[w])
        with pytest.raises(Exception, match="answered without it"):
            y.result(timeout=DEADLINE)
        # asked a few times, not a thousand times a second
        assert 1 <= bad.get_data_requests <= 4, bad.get_data_requests
        assert 1 <= bad.has_keys_requests <= 4, bad.has_keys_requests


@pytest.mark.timeout(90)
def test_a_holder_that_does_not_serve_nor_answer_is_removed_and_the_value_made_again(cluster, peers) -> None:
    c = cluster(0)
    bad = faulty_peer(peers, c, "silent")
    with shoal.Client(c.address, timeout=10) as client:
        # x is made on the bad worker (the only one yet), which will not hand it out
        x = client.submit(operator.add, 20, 1, workers=[bad.address], allow_other_workers=True)
        shoal.wait([x], timeout=DEADLINE)
        w0, w1 = c.add_worker("w0"), c.add_worker("w1")
        ys = [client.submit(operator.mul, x, k, workers=[w]) for k, w in ((2, w0), (3, w1))]
        # two workers' fetches time out, the scheduler's question too: bad is removed
        # from the cluster and x made again on w0 or w1
        assert [y.result(timeout=DEADLINE) for y in ys] == [42, 63]
        assert bad.stream_ended.wait(DEADLINE), "the worker that did not serve was not removed"
        assert 2 <= bad.get_data_requests <= 4, bad.get_data_requests
        assert bad.has_keys_requests >= 1
        assert x.result(timeout=DEADLINE) == 21
        requests = bad.get_data_requests
        assert client.submit(operator.add, x, ys[0], workers=[w0]).result(timeout=DEADLINE) == 63
        assert bad.get_data_requests == requests


@pytest.mark.timeout(60)
def test_result_with_a_timeout_returns_by_it_when_the_holder_never_answers(cluster, peers) -> None:
    c = cluster(0)
    bad = faulty_peer(peers, c, "silent")
    with shoal.Client(c.address, timeout=10) as client:
        x = client.submit(operator.add, 1, 2, workers=[bad.address])
        shoal.wait([x], timeout=DEADLINE)  # done: its value is on the worker that will not answer
        with pytest.raises(TimeoutError):
            x.result(timeout=1)
        assert bad.get_data_requests == 1
        assert x.exception(timeout=1) is None  # (done, without an error)
        with pytest.raises(TimeoutError):
            x.result(timeout=0)


@pytest.mark.timeout(60)
def test_an_async_result_with_a_timeout_returns_by_it_when_the_holder_never_answers(cluster, peers) -> None:
    import asyncio

    c = cluster(0)
    bad = faulty_peer(peers, c, "silent")

    async def main() -> None:
        async with shoal.Client(c.address, timeout=10, asynchronous=True) as client:
            x = client.submit(operator.add, 1, 2, workers=[bad.address])
            await shoal.wait([x], timeout=DEADLINE)
            with pytest.raises(TimeoutError):
                await x.result(timeout=1)

    asyncio.run(main())
    assert bad.get_data_requests == 1
