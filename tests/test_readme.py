"""The README's "One request, end to end" trace: every function and class it names is defined, so the
trace cannot drift from the code unnoticed. Read as source (ast), so the worker's modules are not
imported here."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A backticked name, dotted or not, perhaps called: `Bridge.submit`, `chat.OutputParser`, `Submit(...)`.
NAME = re.compile(r"`([A-Za-z_][\w.]*)(?:\(.*?\))?`")


def trace_text() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("### One request, end to end")
    return text[start:text.index("\n## ", start)]


def definitions(path: Path) -> set[str]:
    """Top-level functions and classes, and Class.method for each method."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{item.name}" for item in node.body
                      if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def test_every_name_in_the_request_trace_is_defined():
    """Guards against the README's trace naming a function or class that was renamed or removed."""
    server = definitions(ROOT / "mashbox.py")
    engine = {path.stem: definitions(path) for path in (ROOT / "engine").glob("*.py")}
    everywhere = server.union(*engine.values())
    names = [m.group(1) for m in NAME.finditer(trace_text())]
    assert len(names) >= 15, names          # the pattern still finds the trace's names
    missing = []
    for name in names:
        module, _, rest = name.partition(".")
        if module in engine and rest:
            found = rest in engine[module]
        else:
            found = name in everywhere
        if not found:
            missing.append(name)
    assert not missing, f"named in the README's trace, defined nowhere: {missing}"


def test_the_trace_meets_the_server_stages_in_request_order():
    """Guards against the trace's steps drifting out of the order a request goes through them."""
    names = [m.group(1) for m in NAME.finditer(trace_text())]
    order = ["Connection", "RequestReader.feed", "Router", "handle_generation", "parse_messages",
             "admit_and_run", "Admission.enter", "render_prompt", "run_generation", "run_attempt",
             "Bridge.submit", "Scheduler", "sampler.sample", "chat.OutputParser", "MessagesEncoder.feed",
             "Responder.event"]
    assert [n for n in names if n in order][:len(order)] == order
