"""Rules of the serving code, read from its source: every wait in live/ and ui/ is bounded, every
broad exception handler in live/, ui/, app.py and pages/ logs its traceback (or re-raises), and no
weights load with strict=False anywhere in the package. A rule broken by new code fails here with
the file, line and call."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVING = [
    *sorted((ROOT / "dynatree_core" / "live").glob("*.py")),
    *sorted((ROOT / "dynatree_core" / "ui").glob("*.py")),
]
PAGES = [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py"))]
BLOCKING = {"wait", "wait_for", "join", "acquire", "recv", "get"}
# show_error: ui/resources.py (logs, then one line on the page); fail: engine_child._ChildEngine's (logs, then
# sends the error to the parent)
LOGGERS = {"log_exception", "show_error", "fail"}
# (file, function, what) -> why it needs no timeout / no log of its own
ALLOWED_WAITS = {
    ("engine_child.py", "_read_commands", "recv"): "reads only after poll() said a message (or EOF) is there",
}
ALLOWED_HANDLERS = {
    ("thread_backend.py", "_work"): "_advance() logged the exception and kept it in the run's error (re-raised)",
}


def _functions(tree: ast.AST):
    """(enclosing function name, node) for every node."""
    stack = [("<module>", tree)]
    while stack:
        name, node = stack.pop()
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else name
            yield inner, child
            stack.append((inner, child))


def _unbounded(call: ast.Call) -> str | None:
    """The blocking method a call makes without a timeout, or None."""
    func = call.func
    if not isinstance(func, ast.Attribute) or func.attr not in BLOCKING:
        return None
    if isinstance(func.value, ast.Constant):  # "".join(...)
        return None
    if any(k.arg in ("timeout", "timeout_s") for k in call.keywords):
        return None
    needed = 2 if func.attr == "wait_for" else 1  # wait_for(predicate, timeout)
    if func.attr in ("get", "join") and call.args:  # dict.get(key), str.join(parts), Thread.join(t)
        return None
    return func.attr if len(call.args) < needed else None


def test_every_wait_in_the_serving_code_has_a_timeout():
    found = []
    for path in SERVING:
        for function, node in _functions(ast.parse(path.read_text())):
            what = _unbounded(node) if isinstance(node, ast.Call) else None
            if what and (path.name, function, what) not in ALLOWED_WAITS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {function}: .{what}() without a timeout")
    assert not found, "\n".join(found)


def test_every_broad_handler_logs_its_traceback():
    found = []
    for path in SERVING + PAGES:
        for function, node in _functions(ast.parse(path.read_text())):
            if not isinstance(node, ast.ExceptHandler):
                continue
            names = [n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)] if node.type else ["bare"]
            if not {"Exception", "BaseException", "bare"} & set(names):
                continue
            body = [n for stmt in node.body for n in ast.walk(stmt)]
            logs = any(
                isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) in LOGGERS for n in body
            )
            reraises = any(isinstance(n, ast.Raise) for n in body)
            if not (logs or reraises) and (path.name, function) not in ALLOWED_HANDLERS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {function}: catches {names} without logging")
    assert not found, "\n".join(found)


def test_no_weights_load_with_strict_false():
    found = []
    for path in sorted((ROOT / "dynatree_core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "load_state_dict":
                for k in node.keywords:
                    if k.arg == "strict" and not (isinstance(k.value, ast.Constant) and k.value.value is True):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_the_rules_catch_what_they_forbid():
    """The checks themselves: a queue get, a wait and a recv without timeouts are caught; a handler
    that swallows is caught; bounded forms pass."""
    tree = ast.parse("q.get()\nev.wait()\ncond.wait_for(p)\nconn.recv()\nq.get(timeout=1)\nev.wait(2)\n'-'.join(x)")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert [_unbounded(c) for c in calls if _unbounded(c)] == ["get", "wait", "wait_for", "recv"]
