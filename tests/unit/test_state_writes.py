"""Every change of a task's state goes through its machine's one writer,
``_set_state``, which checks the change against the machine's table and logs it: no
other code assigns ``.state`` (a write that bypassed the table could half-change the
state where no table, no log and no ``validate()`` sees it)."""

from __future__ import annotations

import ast
import inspect

import pytest

import shoal.scheduler.state
import shoal.scheduler.transitions
import shoal.worker.state


def _state_writes(module: object) -> list[tuple[str, int]]:
    """``(enclosing function, line)`` of every assignment to an attribute ``state``."""
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                targets = [child.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and t.attr == "state" and isinstance(t.ctx, ast.Store):
                        found.append((function, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


@pytest.mark.parametrize("modules", [
    [shoal.scheduler.state, shoal.scheduler.transitions],
    [shoal.worker.state],
], ids=["scheduler", "worker"])
def test_states_are_written_only_by_set_state(modules: list[object]) -> None:
    writes = [w for module in modules for w in _state_writes(module)]
    assert writes, "the scan found no writer at all: it is broken"
    outside = [(f, line) for f, line in writes if f != "_set_state"]
    assert not outside, f"state assigned outside _set_state: {outside}"


def test_the_scan_sees_a_write_outside_set_state() -> None:
    """The scan itself: an assignment in another function is found."""
    code = "class S:\n    def _set_state(self, ts, s):\n        ts.state = s\n    def other(self, ts):\n        ts.state = 'x'\n"
    module = type("M", (), {})()
    tree = ast.parse(code)
    writes = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            writes += [(fn.name, n.lineno) for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr == "state"
                       and isinstance(n.ctx, ast.Store)]
    assert writes == [("_set_state", 3), ("other", 5)]
    del module
