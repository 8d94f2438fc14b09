"""ladle installs as one import package, `ladle`, that shadows no other distribution's module and is
shadowed by none; it runs from any directory (`ladle`, `python -m ladle`), from the checkout as
`python -m runner`, with a user's own config directory beside the shipped configs, and without a C++
compiler (the CPU kernels fall back with one warning)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERIC_NAMES = ("kernels", "engine", "models", "runner", "conf")


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    # no PYTHONPATH: from outside the checkout, ladle must come from the install alone
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environ.update(HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1", **env)
    return subprocess.run(args, cwd=cwd, env=environ, capture_output=True, text=True, timeout=600, check=False)


def rows(out: Path) -> int:
    return pq.read_metadata(out / "generations.parquet").num_rows


def test_the_checkout_holds_no_importable_package_with_a_generic_name():
    """From the repo root (on sys.path for `python -m pytest` and `python -m runner`) only `ladle` and
    the tests are regular packages; `runner/` is a namespace package that any installed `runner` wins over."""
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())
    assert packages == ["ladle", "tests"], packages
    assert not list(ROOT.glob("*.py")), "a module at the repo root is importable as a top-level name"
    assert sorted(p.name for p in (ROOT / "runner").iterdir() if p.name != "__pycache__") == ["__main__.py"]


def test_from_the_repo_root_generic_names_resolve_outside_ladle():
    """transformers imports Hugging Face's `kernels` (installed with it); from the checkout, where the
    root is on sys.path, that import must still find theirs (or nothing), never a folder of ladle's."""
    probe = ("import importlib.util, json, sys\n"
             f"names = {list(GENERIC_NAMES)!r}\n"
             "specs = {n: importlib.util.find_spec(n) for n in names}\n"
             "print(json.dumps({n: s and s.origin for n, s in specs.items()}))\n")
    p = run([sys.executable, "-c", probe], cwd=ROOT)
    assert p.returncode == 0, p.stderr
    import json

    origins = json.loads(p.stdout)
    for name, origin in origins.items():
        here = Path(origin).resolve() if origin else None  # None: no module, or a namespace package
        assert here is None or not (here.is_relative_to(ROOT / name) or here == ROOT / f"{name}.py"), (name, origin)
    if importlib.util.find_spec("kernels") is not None:  # Hugging Face's, with transformers >= 5.25
        q = run([sys.executable, "-c", "import kernels; kernels.get_kernel"], cwd=ROOT)
        assert q.returncode == 0, q.stderr


def test_the_public_api_is_importable_from_ladle_without_loading_torch_first():
    probe = ("import sys, ladle, ladle.runner.__main__\n"
             "assert 'torch' not in sys.modules, 'torch loaded before the start-up step'\n"
             "from ladle import LLMEngine, EngineConfig, ModelConfig, CacheConfig, ChunkingConfig, SamplingParams\n"
             "from ladle.engine.sampling_params import StructuredOutputs\n"
             "import ladle.engine\n"
             "assert LLMEngine is ladle.engine.LLMEngine and SamplingParams is ladle.engine.SamplingParams\n")
    p = run([sys.executable, "-c", probe], cwd=ROOT.parent)
    assert p.returncode == 0, p.stderr


def test_python_m_runner_runs_from_the_checkout(tmp_path):
    p = run([sys.executable, "-m", "runner", "workload.limit=2", f"hydra.run.dir={tmp_path / 'out'}"], cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert rows(tmp_path / "out") == 2


def test_ladle_runs_from_another_directory_with_a_users_own_config_dir(tmp_path):
    """`ladle --config-dir ./myconf model=mymodel`: a model file of the user's next to the shipped ones,
    found from a directory outside the checkout, with ladle imported from the install."""
    script = Path(sys.executable).with_name("ladle")
    if not script.exists():
        pytest.skip(f"no `ladle` script beside {sys.executable} (pip install -e '.[test]')")
    conf = tmp_path / "myconf" / "model"
    conf.mkdir(parents=True)
    tiny = (ROOT / "ladle" / "conf" / "model" / "tiny.yaml").read_text()
    conf.joinpath("mymodel.yaml").write_text(tiny.replace("name: tiny", "name: mymodel")
                                             .replace("num_hidden_layers: 4", "num_hidden_layers: 2"))
    p = run([str(script), "--config-dir", "./myconf", "model=mymodel", "workload.limit=3",
             "hydra.run.dir=./out"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert rows(tmp_path / "out") == 3
    saved = (tmp_path / "out" / ".hydra" / "config.yaml").read_text()
    assert "name: mymodel" in saved and "num_hidden_layers: 2" in saved


def test_without_a_compiler_the_job_runs_on_torch_ops_with_one_warning(tmp_path):
    """No C++ compiler on PATH and an empty kernel cache: every CPU kernel library falls back, the job
    finishes, and the user reads one warning that names the fix (not one per library)."""
    bare = tmp_path / "bin"
    bare.mkdir()
    p = run([sys.executable, "-m", "ladle", "workload.limit=2", "hydra.run.dir=./out"], cwd=tmp_path,
            PATH=str(bare), CXX="", LADLE_KERNEL_CACHE=str(tmp_path / "cache"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert rows(tmp_path / "out") == 2
    printed = (p.stdout + p.stderr).splitlines()
    warnings = [line for line in printed if "WARNING" in line and "no C++ compiler" in line]
    assert len(warnings) == 1, printed
    assert "set CXX, or install g++" in warnings[0]
    assert not list((tmp_path / "cache").glob("*.so"))
