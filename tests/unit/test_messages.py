"""Typed wire messages: every op of docs/protocol.md is a struct with the same fields,
every struct is documented, and decoding names the op and the field it refuses."""

from __future__ import annotations

import os
import re

import pytest

from shoal.errors import ProtocolError
from shoal.protocol import messages as M

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "protocol.md")


def _documented_ops() -> dict[str, set[str]]:
    """op -> field names, from the doc's message blocks and op tables."""
    with open(DOC) as f:
        doc = f.read()
    ops: dict[str, set[str]] = {}
    # code blocks: {"op": "name", "field": ..., ...}; a request/response pair is cut at
    # the response
    for block in re.findall(r"```\n(.*?)```", doc, re.S):
        for chunk in re.split(r"\n(?=response:)|→", block):
            m = re.search(r'\{"op": "([a-z-]+)"', chunk)
            if m:
                fields = set(re.findall(r'"([a-z_]+)":', chunk[m.start():])) - {"op", "reply"}
                ops.setdefault(m.group(1), set()).update(fields)
    # op tables: | `op` | fields | ...: the fields are the backticked names the cell
    # starts with or lists after ", " / "optional(ly) "
    for row in re.findall(r"^\| `([a-z-]+)`(?:, `([a-z-]+)`)? \| ([^|]*)\|", doc, re.M):
        names = set(re.findall(r"(?:^ ?|, |optionally |optional )`([a-z_]+)`", row[2]))
        for op in filter(None, row[:2]):
            ops.setdefault(op, set()).update(names)
    return ops


def _struct_fields(typ: type[M.Msg]) -> set[str]:
    return set(typ.__struct_fields__) - {"reply"}


def test_every_documented_op_is_a_struct_with_the_same_fields():
    documented = _documented_ops()
    by_op: dict[str, list[type[M.Msg]]] = {}
    for typ in M.ALL_OPS:
        by_op.setdefault(typ.__struct_config__.tag, []).append(typ)
    assert set(documented) == set(by_op), (
        f"documented but not structs: {sorted(set(documented) - set(by_op))}; "
        f"structs not documented: {sorted(set(by_op) - set(documented))}"
    )
    for op, fields in documented.items():
        # two structs share a tag where one op name serves two connections
        # (task-erred, update-data): the document lists the fields of both
        union = set().union(*(_struct_fields(t) for t in by_op[op]))
        assert union == fields, f"{op}: document {sorted(fields)}, structs {sorted(union)}"


def test_decode_names_the_op_and_the_field():
    with pytest.raises(ProtocolError, match=r"malformed 'task-finished'.*nbytes"):
        M.decode(M.WORKER_TO_SCHEDULER, {"op": "task-finished", "key": "k", "nbytes": "12"})
    with pytest.raises(ProtocolError, match=r"malformed 'missing-data'.*errant_worker"):
        M.decode(M.WORKER_TO_SCHEDULER, {"op": "missing-data", "key": "k"})
    with pytest.raises(ProtocolError, match=r"unknown op 'compute-task'"):
        M.decode(M.WORKER_TO_SCHEDULER, {"op": "compute-task", "key": "k", "payload": None})
    with pytest.raises(ProtocolError, match="expected a message"):
        M.decode(M.WORKER_TO_SCHEDULER, ["task-finished"])
    with pytest.raises(ProtocolError, match=r"field 'key'.*not list"):
        M.decode(M.WORKER_TO_SCHEDULER, {"op": "reschedule", "key": ["a", 1]})
    with pytest.raises(ProtocolError, match=r"a key in 'keys'.*16 deep"):
        deep: object = "k"
        for _ in range(20):
            deep = (deep,)
        M.decode(M.CLIENT_TO_SCHEDULER, {"op": "release-keys", "keys": [deep]})
    with pytest.raises(ProtocolError, match=r"task 0.*64 bits"):
        M.decode(M.CLIENT_TO_SCHEDULER, {"op": "update-graph", "tasks": [{"key": 1 << 70}], "wanted": []})


def test_a_task_says_why_it_may_run_only_once_in_a_bounded_text():
    graph = {"op": "update-graph", "tasks": [{"key": "a"}, {"key": "b", "once": "a store on disk"}], "wanted": []}
    a, b = M.decode(M.CLIENT_TO_SCHEDULER, graph).tasks  # type: ignore[attr-defined]
    assert (a.once, b.once) == ("", "a store on disk")
    graph["tasks"] = [{"key": "c", "once": "x" * (M.ONCE_MAX + 1)}]
    with pytest.raises(ProtocolError, match=r"task 0: once: 2001 characters, at most 2000"):
        M.decode(M.CLIENT_TO_SCHEDULER, graph)


@pytest.mark.parametrize("priority", [[1, "a"], [1, 2.5], [None], "high", [[1]]])
def test_a_compute_task_with_priorities_that_do_not_compare_is_refused(priority):
    """Priorities order a worker's ready tasks (a heap): mixed types would raise in
    the middle of the worker's state machine, so decoding refuses them."""
    with pytest.raises(ProtocolError, match="priority"):
        M.decode(M.SCHEDULER_TO_WORKER, {"op": "compute-task", "key": "k", "payload": None, "priority": priority})


@pytest.mark.parametrize("key", [float("nan"), float("inf"), ("x", float("nan"))])
def test_a_key_that_is_no_key_is_refused(key):
    with pytest.raises(ProtocolError, match="finite"):
        M.decode(M.WORKER_TO_SCHEDULER, {"op": "task-finished", "key": key})


def test_new_fields_are_ignored_and_optional_ones_have_defaults():
    msg = M.decode(M.WORKER_TO_SCHEDULER, {"op": "task-finished", "key": ("x", 1), "from_the_future": 1})
    assert msg == M.TaskFinishedMsg(("x", 1))
    assert msg.nbytes == 0 and msg.shm is None
    nil = M.decode(M.WORKER_TO_SCHEDULER, {"op": "task-finished", "key": "k", "nbytes": None, "duration": None})
    assert nil.nbytes is None and nil.duration is None  # nil counts as 0 (§7.3)


def test_to_wire_leaves_out_optional_fields_at_their_default():
    assert M.to_wire(M.ComputeTaskMsg("k", None)) == {
        "op": "compute-task", "key": "k", "payload": None, "who_has": {}, "nbytes": {}, "priority": [],
    }
    wire = M.to_wire(M.ComputeTaskMsg("k", None, shm={"d": [1]}, report=True))
    assert wire["shm"] == {"d": [1]} and wire["report"] is True
    # what goes out decodes back to the same struct
    sent = M.TaskErredMsg(("k", 2), text="ValueError: x", kind="", blame=("k", 2))
    assert M.decode(M.SCHEDULER_TO_CLIENT, M.to_wire(sent)) == sent


def test_a_struct_from_a_peer_of_this_process_is_taken_as_it_is():
    """An in-process comm hands over the very object written: a worker of this process
    gets the scheduler's compute-task struct, nothing converted; elsewhere, the map."""
    from shoal.protocol import SAME_HOST, SAME_PROCESS, Serialize, unwrap

    task = M.ComputeTaskMsg("k", Serialize(["a value"]), {"d": ["w"]}, {"d": 8}, [0])
    assert M.for_destination(task, SAME_PROCESS) is task
    assert M.for_destination(task, SAME_HOST) == M.to_wire(task)
    # a worker deserializes: the value comes out of its wrapper, the sender's struct is left
    got = unwrap(task)
    assert got.payload == ["a value"] and got.who_has == {"d": ["w"]} and type(task.payload) is Serialize
    assert M.decode(M.SCHEDULER_TO_WORKER, got) is got
    plain = M.FreeKeysMsg(["k"])
    assert unwrap(plain) is plain  # nothing to unwrap: the same object
    # a struct of another table is as wrong as a map with its op would be
    with pytest.raises(ProtocolError, match="expected a message"):
        M.decode(M.WORKER_TO_SCHEDULER, task)


def test_every_table_s_structs_have_the_tags_they_are_filed_under():
    tables = [M.HANDSHAKE, M.CONTROL, M.WORKER_TO_SCHEDULER, M.SCHEDULER_TO_WORKER, M.CLIENT_TO_SCHEDULER,
              M.SCHEDULER_TO_CLIENT, M.SCHEDULER_REQUESTS, M.WORKER_REQUESTS]
    for table in tables:
        for op, typ in table.items():
            assert typ.__struct_config__.tag == op
