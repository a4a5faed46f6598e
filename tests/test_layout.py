"""The server file's table of contents (its module docstring) and its titled sections agree, in order;
the request's four stages are defined in the order a request meets them; the API-formats appendix opens
with its index, each API's parse function and encoder in the subsection the index names. Read as
source."""
from __future__ import annotations

import ast
import re
from pathlib import Path

SERVER = Path(__file__).resolve().parent.parent / "mashbox.py"
RULE = "# " + "=" * 97
# A subsection's header inside a section: "# ---- Title ---...".
SUBSECTION = re.compile(r"# ---- (.+?) -+$")


def section_titles(text: str) -> list[str]:
    """Each section's title (its header's first line, between a pair of rules), up to its colon."""
    lines = text.splitlines()
    opening = [i for i, line in enumerate(lines) if line == RULE][0::2]
    return [lines[i + 1][2:].split(":")[0] for i in opening]


def contents(text: str) -> list[str]:
    """The docstring's list: indented lines, a title then (after two spaces) what it holds."""
    doc = ast.get_docstring(ast.parse(text))
    listed = doc[doc.index("the same):"):].splitlines()[1:]
    return [re.split(r"\s{2,}", line.strip())[0] for line in listed if line.startswith("    ")]


def test_the_table_of_contents_lists_the_sections_in_order():
    """Guards against a section moved, added or renamed without the module docstring following."""
    text = SERVER.read_text()
    assert len(section_titles(text)) >= 10
    assert contents(text) == section_titles(text)


def test_a_requests_stages_are_defined_in_the_order_it_meets_them():
    """Guards against the generation section drifting back out of the order its docstring tells."""
    order = [node.name for node in ast.parse(SERVER.read_text()).body
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    stages = ["handle_generation", "admit_and_run", "run_generation", "run_attempt"]
    assert sorted(stages, key=order.index) == stages


def appendix(text: str) -> tuple[int, int, dict[str, int]]:
    """The API-formats appendix's first and last line (1-based) and its subsections' header lines."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("# API formats (appendix)"))
    closing = lines.index(RULE, head)                   # the header's own closing rule
    end = lines.index(RULE, closing + 1)                # the next section's opening rule
    subsections = {m.group(1): i + 1 for i in range(head, end) if (m := SUBSECTION.match(lines[i]))}
    return head + 1, end, subsections


def api_index(tree: ast.Module) -> tuple[ast.stmt, list[list[str]]]:
    """API_FORMATS's assignment, and each ApiFormat(...) in it: its name, parse, encoder, subsection."""
    node = next(n for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "API_FORMATS")
    calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "ApiFormat"]
    return node, [[arg.value for arg in call.args[:4]] for call in calls]


def test_the_api_appendix_opens_with_its_index_one_line_per_api():
    """Guards against an API added (or its parse function or encoder renamed or moved) without the
    appendix's index following, and against the index drifting back below the subsections."""
    text = SERVER.read_text()
    tree = ast.parse(text)
    start, end, subsections = appendix(text)
    index, apis = api_index(tree)
    first = min(subsections.values())
    heading = [n for n in tree.body if start < n.lineno < first]
    assert [getattr(n, "name", None) for n in heading[:1]] == ["ApiFormat"]
    assert start < index.lineno < first
    routes = re.findall(r'\("/v1/[\w/]+", "(\w+)"\)', text)
    assert {name for name, *_ in apis} == set(routes) and len(apis) == 4, (apis, routes)
    bounds = sorted(subsections.values()) + [end]
    defined = {n.name: n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for name, parse, encoder, subsection in apis:
        assert subsection in subsections, (name, subsection)
        top = subsections[subsection]
        bottom = bounds[bounds.index(top) + 1]
        for what in (parse, encoder):
            assert what in defined and top < defined[what] < bottom, (name, what, subsection)
