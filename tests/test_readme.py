"""The README as a front door: short, the map early, every engine file on the map once, every option a
line with a link that resolves; and its "One request, end to end" trace: every function and class it
names is defined, so the trace cannot drift from the code unnoticed. Read as source (ast), so the
worker's modules are not imported here."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A backticked name, dotted or not, perhaps called: `Bridge.submit`, `chat.OutputParser`, `Submit(...)`.
NAME = re.compile(r"`([A-Za-z_][\w.]*)(?:\(.*?\))?`")
# A front door is read in one sitting: what it is, how to run it, then the map; the rest is in docs/.
README_MAX_LINES = 500
MAP_BY_LINE = 200
# A relative Markdown link: [text](path) or [text](path#anchor).
LINK = re.compile(r"\]\((?!https?:)([^)#]+)(?:#[^)]*)?\)")


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


def readme() -> str:
    return (ROOT / "README.md").read_text()


def section(text: str, title: str) -> str:
    start = text.index(title + "\n")
    end = text.find("\n## ", start + len(title))
    return text[start:end if end >= 0 else len(text)]


def test_the_readme_is_short_and_reaches_the_map_early():
    """Guards against the front door growing back into a manual: the long sections belong in docs/."""
    lines = readme().splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    assert lines.index("## How it is built") + 1 < MAP_BY_LINE
    assert lines.index("## How it is built") < lines.index("### One request, end to end") < MAP_BY_LINE + 60


def map_entries() -> list[str]:
    """The paths the map's code block gives an entry to (a line that starts with a path, then spaces)."""
    built = section(readme(), "## How it is built")
    start = built.index("```\n") + 4
    block = built[start:built.index("\n```", start)]
    return [line.split()[0] for line in block.splitlines()
            if re.match(r"[\w.][\w./-]*\s{2,}\S", line)]


def test_every_engine_file_is_on_the_map_once():
    """Guards against a module added to engine/ (or removed) without the map following, or one listed
    under two processes."""
    entries = map_entries()
    files = sorted(f"engine/{p.name}" for p in (ROOT / "engine").iterdir() if p.suffix in (".py", ".cc"))
    assert sorted(e for e in entries if e.startswith("engine/")) == files
    assert len(entries) == len(set(entries)), entries


def server_modules() -> set[str]:
    """engine/__init__.py's SERVER_MODULES, read as source."""
    tree = ast.parse((ROOT / "engine" / "__init__.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "SERVER_MODULES")
    return set(ast.literal_eval(node.value))


def test_the_maps_server_process_names_the_modules_the_server_loads():
    """Guards against the map's server process and engine.SERVER_MODULES (which a test holds to what
    start-up loads) telling two stories."""
    built = section(readme(), "## How it is built")
    server = built[built.index("The server process"):built.index("The worker process")]
    named = set(re.findall(r"engine/(\w+)\.py", server)) - {"__init__"}
    assert named == server_modules()


def test_every_option_is_one_line_with_a_link():
    """Guards against a flag of `mashbox run` missing from the README's Options, or told there at
    length instead of in its page."""
    flags = set(re.findall(r'run\.add_argument\("(--[\w-]+)"', (ROOT / "mashbox.py").read_text()))
    assert len(flags) >= 15, flags          # the pattern still finds the parser's flags
    options = section(readme(), "## Options")
    lines = [line for line in options.splitlines() if line.startswith("- ")]
    for flag in flags:
        told = [line for line in lines if f"`{flag}`" in line]
        assert len(told) == 1, (flag, told)
        assert LINK.search(told[0]), told[0]


def test_every_relative_link_resolves():
    """Guards against a page moved or renamed under a link of the README or of docs/."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [(page.name, target) for page in pages for target in LINK.findall(page.read_text())
              if not (page.parent / target).exists()]
    assert not broken, broken
