"""Bad user input ends in a clear error for its task (or the submit call), never a hang
or a dead client: arguments that cannot travel, keys the wire cannot carry, results
and exceptions whose own methods raise. Each case runs on three clusters: all in one
process (values pass by reference: nothing is pickled), worker processes with the
client in the scheduler's process (the scheduler serializes the tasks for the workers),
and a scheduler and a worker started from the command line with the client connected
over tcp (the client serializes the tasks). Every worker has one thread, so that a
wedged thread would show as the next task hanging.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import shoal
from shoal_helpers import auth_files, start_scheduler, start_worker, stop_processes

pytestmark = pytest.mark.timeout(120)


# -------------------------------------------------------------------- user objects


class RaisingReduce:
    def __reduce__(self) -> Any:
        raise RuntimeError("this object refuses to be pickled")


class ExitingReduce:
    def __reduce__(self) -> Any:
        raise SystemExit(3)


class RaisingNbytes:
    @property
    def nbytes(self) -> int:
        raise RuntimeError("nbytes is broken")


class RaisingSizeof:
    def __sizeof__(self) -> int:
        raise RuntimeError("__sizeof__ is broken")


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ is broken")


class UnpicklableError(Exception):
    def __init__(self) -> None:
        super().__init__("an error holding a lock")
        self.lock = threading.Lock()


def _generator() -> Iterator[int]:
    yield 1


def identity(x: Any) -> Any:
    return x


def make(cls: type) -> Any:
    return cls()


def raise_(cls: type) -> None:
    raise cls()


def inc(x: int) -> int:
    return x + 1


# ------------------------------------------------------------------------ clusters


@pytest.fixture(scope="module", params=["threads", "processes", "remote-client"])
def kind_and_address(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    if request.param != "remote-client":
        with shoal.LocalCluster(n_workers=1, threads_per_worker=1, processes=request.param == "processes") as c:
            yield request.param, c
        return
    before = auth_files()
    procs: list[subprocess.Popen[str]] = []
    # the worker imports this module's functions, as a user's workers import theirs
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    try:
        _, address = start_scheduler(procs)
        start_worker(procs, address, "--nthreads", "1", env={"PYTHONPATH": path})
        yield request.param, address
    finally:
        stop_processes(procs, before)


@pytest.fixture
def kind(kind_and_address: tuple[str, Any]) -> str:
    return kind_and_address[0]


@pytest.fixture
def client(kind_and_address: tuple[str, Any]) -> Iterator[shoal.Client]:
    with shoal.Client(kind_and_address[1], timeout=30) as c:
        yield c


def _still_serves(client: shoal.Client) -> None:
    """The client, its scheduler and the (one-thread) worker carry on."""
    assert client.submit(inc, 41, pure=False).result(timeout=30) == 42


# ------------------------------------------------------------------------ arguments


UNPICKLABLE_ARGUMENTS = {
    "lock": (threading.Lock, "_thread.lock"),
    "generator": (_generator, "generator"),
    "socket": (socket.socket, "socket.socket"),
    "raising __reduce__": (RaisingReduce, "RaisingReduce"),
    "__reduce__ raising SystemExit": (ExitingReduce, "ExitingReduce"),
}


@pytest.mark.parametrize("case", list(UNPICKLABLE_ARGUMENTS))
def test_an_argument_that_cannot_be_pickled_fails_at_submit(client: shoal.Client, kind: str, case: str) -> None:
    make_arg, typename = UNPICKLABLE_ARGUMENTS[case]
    arg = make_arg()
    try:
        if kind == "threads":
            assert client.submit(identity, arg, pure=False).result(timeout=30) is arg  # never pickled
        else:
            with pytest.raises(shoal.SerializationError) as info:
                client.submit(identity, arg, pure=False)
            assert typename in str(info.value) and "args[0]" in str(info.value)
            assert isinstance(info.value, TypeError)
            with pytest.raises(shoal.SerializationError, match=r"kwargs\['handle'\]"):
                client.submit(identity, 1, handle=arg, pure=False)
        _still_serves(client)
    finally:
        if isinstance(arg, socket.socket):
            arg.close()


@pytest.mark.parametrize("case", list(UNPICKLABLE_ARGUMENTS))
def test_an_argument_that_cannot_be_pickled_on_its_way_fails_its_task_only(
        client: shoal.Client, kind: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What gets past submit (a client that does not know its tasks will be pickled)
    fails on the hop that cannot carry it: that task only."""
    monkeypatch.setattr(client, "_pickles_tasks", False)
    make_arg, typename = UNPICKLABLE_ARGUMENTS[case]
    arg = make_arg()
    try:
        good = client.submit(inc, 1, pure=False)
        bad = client.submit(identity, arg, pure=False)
        dependent = client.submit(identity, bad, pure=False)
        assert good.result(timeout=30) == 2
        if kind == "threads":
            # one process: the argument is passed by reference, never pickled
            assert bad.result(timeout=30) is arg and dependent.result(timeout=30) is arg
        else:
            for future in (bad, dependent):
                with pytest.raises(shoal.SerializationError) as info:
                    future.result(timeout=30)
                assert typename in str(info.value) and "args[0]" in str(info.value)
                assert isinstance(info.value, TypeError)
        _still_serves(client)
    finally:
        if isinstance(arg, socket.socket):
            arg.close()


def test_many_tasks_in_one_graph_with_one_bad_argument(client: shoal.Client, kind: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """map() sends its tasks in one message: the bad one errs, the others run."""
    monkeypatch.setattr(client, "_pickles_tasks", False)
    lock = threading.Lock()
    futures = client.map(identity, [1, 2, lock, 4], pure=False)
    assert [f.result(timeout=30) for f in (futures[0], futures[1], futures[3])] == [1, 2, 4]
    if kind == "threads":
        assert futures[2].result(timeout=30) is lock
    else:
        with pytest.raises(shoal.SerializationError, match="lock"):
            futures[2].result(timeout=30)


# ----------------------------------------------------------------------------- keys


@pytest.mark.parametrize("key,problem", [
    ("a\udc80", "valid Unicode"),
    (float("nan"), "finite"),
    (float("inf"), "finite"),
    (("x", float("-inf")), "finite"),
    (1 << 70, "64 bits"),
    ((((((((((((((((((("deep",),),),),),),),),),),),),),),),),),), "16 deep"),
    (object(), "not object"),
    ([1, 2], "not list"),
])
def test_a_key_the_wire_cannot_carry_is_refused_at_submit(client: shoal.Client, key: Any, problem: str) -> None:
    with pytest.raises(shoal.InvalidKeyError, match=problem) as info:
        client.submit(inc, 1, key=key)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
    with pytest.raises(shoal.InvalidKeyError, match=problem):
        client.map(inc, [1, 2], key=["fine", key])
    _still_serves(client)


# -------------------------------------------------------------------------- results


@pytest.mark.parametrize("cls,text", [(RaisingNbytes, "nbytes is broken"), (RaisingSizeof, "__sizeof__ is broken")])
def test_a_result_that_cannot_say_its_size_fails_its_task(client: shoal.Client, cls: type, text: str) -> None:
    future = client.submit(make, cls, pure=False)
    with pytest.raises(RuntimeError, match=text) as info:
        future.result(timeout=30)
    assert any("measured the result" in note for note in getattr(info.value, "__notes__", ()))
    _still_serves(client)


@pytest.mark.parametrize("cls,cause", [(RaisingReduce, "RuntimeError: this object refuses"),
                                       (ExitingReduce, "SystemExit: 3")])
def test_a_result_that_cannot_be_pickled_is_an_error_when_it_must_travel(
    client: shoal.Client, kind: str, cls: type, cause: str,
) -> None:
    future = client.submit(make, cls, pure=False)
    used_in_place = client.submit(type, future, pure=False)  # on the worker that holds it: no travel
    assert used_in_place.result(timeout=30) is cls
    if kind == "threads":
        assert type(future.result(timeout=30)) is cls
    else:
        with pytest.raises(shoal.SerializationError, match=cls.__name__) as info:
            future.result(timeout=30)
        assert cause in str(info.value)
    _still_serves(client)


def test_an_exception_whose_str_raises_reaches_the_caller(client: shoal.Client) -> None:
    future = client.submit(raise_, UnprintableError, pure=False)
    with pytest.raises(UnprintableError):
        future.result(timeout=30)
    assert isinstance(future.exception(timeout=30), UnprintableError)
    _still_serves(client)


def test_an_exception_that_cannot_be_pickled_reaches_the_caller_as_text(client: shoal.Client, kind: str) -> None:
    future = client.submit(raise_, UnpicklableError, pure=False)
    with pytest.raises(Exception, match="an error holding a lock") as info:
        future.result(timeout=30)
    if kind == "threads":
        assert type(info.value) is UnpicklableError
    else:
        assert isinstance(info.value, shoal.RemoteError) and "UnpicklableError" in info.value.remote_type
    _still_serves(client)


def test_a_function_that_cannot_be_pickled_fails_its_task_only(client: shoal.Client, kind: str) -> None:
    class Call:
        def __init__(self) -> None:
            self.lock = threading.Lock()

        def __call__(self) -> int:
            return 7

    if kind == "threads":
        assert client.submit(Call(), pure=False).result(timeout=30) == 7
    else:
        with pytest.raises(shoal.SerializationError, match="function.*lock"):
            client.submit(Call(), pure=False)  # refused at submit
        client._pickles_tasks = False  # past submit, it fails its task on the way
        try:
            future = client.submit(Call(), pure=False)
            with pytest.raises(shoal.SerializationError, match="lock"):
                future.result(timeout=30)
        finally:
            client._pickles_tasks = True
    _still_serves(client)


def test_scattering_a_value_that_cannot_be_pickled_raises_at_scatter(client: shoal.Client, kind: str) -> None:
    lock = threading.Lock()
    if kind == "threads":
        [future] = client.scatter([lock])
        assert future.result(timeout=30) is lock
    else:
        with pytest.raises(shoal.SerializationError, match="lock"):
            client.scatter([lock])
    _still_serves(client)
