"""Project-wide rules: the direction of dependencies (runner -> engine -> models -> kernels), no import circles, a clean
lint, no development history in the files."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PACKAGE_ROOT = ROOT / "ladle"

# subpackage -> modules it must never import (runner -> engine -> models -> kernels); ladle's own are
# named ladle.<subpackage>, third-party ones by their top-level name
FORBIDDEN = {
    "kernels": {"ladle.models", "ladle.engine", "ladle.runner", "hydra", "omegaconf", "pyarrow"},
    "models": {"ladle.engine", "ladle.runner", "hydra", "omegaconf", "pyarrow"},
    "engine": {"ladle.runner", "hydra", "omegaconf", "pyarrow", "datasets"},
}


def top_name(module: str) -> str:
    """`ladle.engine.x` -> `ladle.engine`; `pyarrow.parquet` -> `pyarrow`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "ladle" else parts[0]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(top_name(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(top_name(node.module))
            if node.module == "ladle":  # `from ladle import engine`
                names.update(f"ladle.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_flow_one_way(package):
    files = sorted((PACKAGE_ROOT / package).rglob("*.py"))
    assert files
    bad = {
        str(f.relative_to(ROOT)): sorted(imported_modules(f) & FORBIDDEN[package])
        for f in files
        if imported_modules(f) & FORBIDDEN[package]
    }
    assert not bad, f"{package}/ imports what it must not: {bad}"


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    proc = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT, package_root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """Project module -> the project modules it imports, anywhere in the file (inside functions too).
    `from a import b` is an edge to a (its __init__ runs and its namespace is read, re-exports included)
    and also to the module a.b when b is one. `import a.b` is an edge to a.b alone: a package's __init__
    may import its own submodules, and a submodule that needs a sibling names the sibling."""
    files = {module_name(f, root): f for f in sorted(package_root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                edges.add(base)
                edges.update(f"{base}.{a.name}" for a in node.names)
        edges &= files.keys() - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_a_circle_through_a_package_init_is_found(tmp_path):
    """`from pkg import sub` inside pkg/other.py reads pkg's __init__, which imports other: a circle that
    Python survives only while the name is a submodule; naming the submodule (`import pkg.sub`) is none."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.other import run\n")
    (pkg / "sub.py").write_text("X = 1\n")
    (pkg / "other.py").write_text("from pkg import sub\n")
    assert find_cycle(import_graph(tmp_path, pkg)) == ["pkg", "pkg.other", "pkg"]
    (pkg / "other.py").write_text("import pkg.sub as sub\n")
    assert find_cycle(import_graph(tmp_path, pkg)) is None


def test_no_import_circles():
    graph = import_graph()
    assert "ladle.runner.executors.local" in graph["ladle.runner.job"]
    # `from ladle.engine import LLMEngine` inside a function
    assert "ladle.engine" in graph["ladle.runner.executors.local"]
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


# Words that tell how the project was made rather than what it does. Its history lives in git; a name or
# comment says the property instead ("batch invariance", not the number of the ticket that asked for it).
HISTORY_WORDS = re.compile(
    r"\bsessions?\b|\bleases?\b|\bissues?[ -]?#?\d|\breview(?:er|ers|ed|s|ing)?\b|\bhelpers?\b|\bround \d"
    r"|\bturn \d|\b(?:commit|revision) [0-9a-f]{7,40}\b"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\w+teenth|\d+(?:st|nd|rd|th))"
    r"[- ](?:session|lease|round|turn)s?\b",
    re.IGNORECASE,
)
# Real API words that contain one: pytest's session scope, POSIX process sessions, and the engine tests'
# shared module (tests/engine/helpers.py) that two dozen test files import by name.
HISTORY_ALLOWED = re.compile(
    r'scope="session"|pytest session|start_new_session|process sessions?|tests[./]engine[./]helpers',
)
# this file names the words it forbids
HISTORY_EXEMPT = {"tests/test_project.py"}


def history_hits(text: str) -> list[str]:
    """The lines of `text` that use a history word outside the allowed phrases."""
    return [line.strip() for line in text.splitlines()
            if HISTORY_WORDS.search(HISTORY_ALLOWED.sub("", line))]


def test_history_words_are_found_and_api_words_are_not():
    assert history_hits("# Batch invariance (issue 22): bitwise the same") == ["# Batch invariance (issue 22): bitwise the same"]
    assert history_hits("measured in the thirteenth session") and history_hits("the second lease")
    assert history_hits("a test helper") and history_hits("see commit 1a2b3c4d") and history_hits("the issue-21 model")
    assert history_hits('"""Adversarial review of the runner."""')
    assert not history_hits('@pytest.fixture(scope="session")\nPopen(cmd, start_new_session=True)')
    assert not history_hits("each in turn; released rows; round(x, 2); from tests.engine.helpers import GREEDY")


def tracked_files() -> list[str]:
    """The repository's files (git's list: no virtualenv, no build output), relative to the root."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return [name for name in listed.stdout.decode().split("\0") if name and (ROOT / name).is_file()]


def test_no_development_history_in_the_repository_files():
    bad = {}
    for name in tracked_files():
        path = ROOT / name
        if name in HISTORY_EXEMPT:
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (the sample Parquet file)
        hits = history_hits(data.decode("utf-8", errors="replace"))
        if hits:
            bad[name] = hits[:3]
    assert not bad, f"development history in the repository's files (name the property instead): {bad}"


# C++ lives in .cpp and .h files (kernels/csrc, benchmarks/), where a compiler, an editor and clang-format
# see it: a line of a .py file that starts like C++ is a kernel hidden in a string.
CPP_LINE = re.compile(r'^\s*(?:#include\s*[<"]|#pragma\s|#if(?:def)?\s|extern\s+"C"|template\s*<|constexpr\s)', re.MULTILINE)


def test_cpp_lines_are_recognised():
    assert CPP_LINE.search('SOURCE = r"""\n#include <cstdint>\nextern "C" int f();\n"""')
    assert not CPP_LINE.search("# include the header\nimport ctypes  # extern C functions, loaded by ctypes")


def test_no_python_file_holds_cpp():
    texts = {name: (ROOT / name).read_text() for name in tracked_files() if name.endswith(".py")}
    bad = {name: CPP_LINE.search(text).group(0).strip() for name, text in texts.items() if CPP_LINE.search(text)}
    assert not bad, f"C++ inside Python files (move it to a .cpp or .h file): {bad}"


# Size rules: a module of the serving core or the runner fits in one reading, and a function on one screen.
MAX_MODULE_LINES = {"engine": 350, "runner": 350}
MAX_FUNCTION_LINES = 50
NO_FUNCTION_LIMIT = {"kernels"}  # kernels unroll on purpose; their C++ is not Python's to measure


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`name (N lines)` for each function or method in `path` longer than `limit`, nested ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit]


def test_long_functions_are_measured(tmp_path):
    short, long = tmp_path / "short.py", tmp_path / "long.py"
    short.write_text("def f():\n" + "    x = 1\n" * 49)
    long.write_text("class C:\n    def g(self):\n" + "        x = 1\n" * 50)
    assert long_functions(short) == []
    assert long_functions(long) == ["g (51 lines)"]


@pytest.mark.parametrize("package", sorted(MAX_MODULE_LINES))
def test_modules_stay_short(package):
    limit = MAX_MODULE_LINES[package]
    sizes = {str(f.relative_to(ROOT)): len(f.read_text().splitlines()) for f in (PACKAGE_ROOT / package).rglob("*.py")}
    assert sizes
    over = {name: n for name, n in sizes.items() if n > limit}
    assert not over, f"modules over {limit} lines (split them along a seam, one job per module): {over}"


def test_functions_stay_short():
    files = [f for f in sorted(PACKAGE_ROOT.rglob("*.py")) if f.relative_to(PACKAGE_ROOT).parts[0] not in NO_FUNCTION_LIMIT]
    over = {str(f.relative_to(ROOT)): long_functions(f) for f in files if long_functions(f)}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them where their steps part): {over}"
