"""The server file's table of contents (its module docstring) and its titled sections agree, in order,
and the request's four stages are defined in the order a request meets them. Read as source."""
from __future__ import annotations

import ast
import re
from pathlib import Path

SERVER = Path(__file__).resolve().parent.parent / "mashbox.py"
RULE = "# " + "=" * 97


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
