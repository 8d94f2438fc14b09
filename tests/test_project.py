"""Project-wide rules: the dependency direction of DESIGN and a clean lint."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> top-level modules it must never import (runner -> engine -> models -> kernels)
FORBIDDEN = {
    "kernels": {"models", "engine", "runner", "hydra", "omegaconf", "pyarrow"},
    "models": {"engine", "runner", "hydra", "omegaconf", "pyarrow"},
    "engine": {"runner", "hydra", "omegaconf", "pyarrow", "datasets"},
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_flow_one_way(package):
    files = sorted((ROOT / package).rglob("*.py"))
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
