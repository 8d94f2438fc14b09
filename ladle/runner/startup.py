"""The CLI's start-up step: the process-level runtime settings that must be in place before torch loads.

`ladle` (and `python -m ladle`) calls `prepare()` first thing, before torch (and with it torch's OpenMP
runtime, GNU libgomp) is imported; libgomp reads its environment once, when it is loaded, and a malloc
must be in place before the first allocation, so neither can be changed later in the process.
What it does (measured by benchmarks/startup_runtime.py; docs/design-notes.md, "Runtime start-up"):

- OpenMP wait policy: `OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000`. libgomp's default keeps an idle
  worker thread spinning ~300,000 rounds (~10 ms) after each parallel region; when the cores are shared
  (other jobs, or ladle's own Python thread between ops) the spinning thread steals the core the next op
  needs (1.6x slower with a busy neighbour). Sleeping at once (PASSIVE alone) costs a futex wake-up at
  every region, ~40 us, 2-4% of an idle 2-thread run. 1,000 rounds (~30 us: the gap between two ops of
  one forward) keep the worker awake inside a forward and asleep between steps. libgomp lets
  GOMP_SPINCOUNT override the policy's spin count; another OpenMP runtime (Intel's) ignores it and sleeps.
  Set only when the user has set neither variable.
- malloc: tcmalloc, when installed (Debian: `apt-get install libtcmalloc-minimal4`) and LD_PRELOAD is
  empty: the process re-executes itself once with `LD_PRELOAD=<libtcmalloc_minimal.so.4>`. The marker
  `LADLE_STARTUP_EXEC` in the environment stops a second exec (the restarted process removes it, and
  LD_PRELOAD too when the preload failed, so the programs it starts begin afresh); a user's own LD_PRELOAD,
  or glibc malloc settings (MALLOC_*, GLIBC_TUNABLES=glibc.malloc...), are left alone and nothing is
  preloaded. Without tcmalloc, a program that cannot be restarted (read from stdin), a path LD_PRELOAD
  cannot hold or a failed exec, ladle runs on glibc's malloc and says so once.
- no thread binding (OMP_PROC_BIND / GOMP_CPU_AFFINITY): ladle picks fewer threads than cores when the
  machine is busy (runner/threads.py), and a thread pinned to a busy core cannot move to the idle one.

One line on stderr says what was done (`ladle: runtime: ...`); summary.json records it (`cpu_threads.runtime`).
`LADLE_STARTUP=0` (or off/false/no) turns the whole step off.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SWITCH = "LADLE_STARTUP"  # 0/off/false/no: do nothing
MARKER = "LADLE_STARTUP_EXEC"  # set for the re-executed process: it never executes itself again
OFF = {"0", "off", "false", "no"}
# How OpenMP's idle threads wait (docs/design-notes.md, "Runtime start-up"). A user who set either
# variable chose between spinning and sleeping already: then both are theirs.
OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}
MALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
INSTALL_HINT = "apt-get install libtcmalloc-minimal4"


def library_dirs() -> list[Path]:
    """Where a system library may be: the multiarch dir (Debian/Ubuntu), the usual others, the venv's."""
    multiarch = sysconfig.get_config_var("MULTIARCH")
    dirs = [Path("/usr/lib") / multiarch, Path("/lib") / multiarch] if multiarch else []
    return dirs + [Path("/usr/lib64"), Path("/usr/lib"), Path("/usr/local/lib"), Path(sys.prefix) / "lib"]


def find_malloc(dirs: Sequence[Path] | None = None) -> Path | None:
    """The first tcmalloc found (MALLOC_NAMES in order, dir by dir), None when it is not installed."""
    for name in MALLOC_NAMES:
        for d in library_dirs() if dirs is None else dirs:
            if (d / name).is_file():
                return d / name
    return None


@dataclass(slots=True)
class Plan:
    """What the step does: variables to set, whether to re-execute, and the words of its one line."""

    env: dict[str, str] = field(default_factory=dict)
    reexec: bool = False
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        return "ladle: runtime: " + "; ".join(self.notes)


def is_off(environ: Mapping[str, str]) -> bool:
    return environ.get(SWITCH, "").strip().lower() in OFF


def _glibc_malloc_tuning(environ: Mapping[str, str]) -> str:
    """The user's own glibc malloc settings (MALLOC_*_ variables, glibc.malloc tunables), '' when none:
    a user tuning glibc's malloc does not want it replaced."""
    names = sorted(k for k in environ if k.startswith("MALLOC_"))
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        names.append("GLIBC_TUNABLES")
    return ", ".join(names)


def restartable() -> bool:
    """Whether this process can be started again from its command line: not a program read from stdin or
    typed at the prompt (its text is gone: a restart would run nothing, and exit 0)."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    if file == "<stdin>":
        return False
    return file is not None or getattr(main, "__spec__", None) is not None or "-c" in sys.orig_argv[1:]


def plan(environ: Mapping[str, str], malloc: Path | None, platform: str = sys.platform,
         can_restart: bool = True) -> Plan:
    """The step for this environment; pure (the tests drive it with fake environments)."""
    if is_off(environ):
        return Plan(notes=[f"start-up step off ({SWITCH}={environ[SWITCH]})"])
    if MARKER in environ:  # the re-executed process: the parent set everything; report it
        return Plan(notes=environ[MARKER].split("|"))
    p = Plan()
    if theirs := [k for k in OMP_ENV if k in environ]:
        p.notes.append(", ".join(f"{k}={environ[k]} (yours)" for k in theirs))
    else:
        p.env.update(OMP_ENV)
        p.notes.append(" ".join(f"{k}={v}" for k, v in OMP_ENV.items()))
    if platform != "linux":
        p.notes.append("system malloc (LD_PRELOAD is Linux only)")
    elif environ.get("LD_PRELOAD"):
        p.notes.append(f"LD_PRELOAD={environ['LD_PRELOAD']} (yours)")
    elif tuned := _glibc_malloc_tuning(environ):
        p.notes.append(f"glibc malloc as you tuned it ({tuned})")
    elif malloc is None:
        p.notes.append(f"glibc malloc (tcmalloc is not installed: {INSTALL_HINT})")
    elif not can_restart:
        p.notes.append("glibc malloc (preloading tcmalloc restarts the program, and one read from stdin cannot be)")
    elif any(c in str(malloc) for c in " :"):  # LD_PRELOAD splits at both, with no escaping
        p.notes.append(f"glibc malloc (LD_PRELOAD cannot name {malloc}: it has a space or a colon)")
    else:
        p.notes.append(f"tcmalloc preloaded ({malloc})")
        p.env["LD_PRELOAD"] = str(malloc)
        p.env[MARKER] = "|".join(p.notes)
        p.reexec = True
    return p


def mapped(name_part: str, maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether a library whose file name contains `name_part` is mapped into this process."""
    try:
        text = maps.read_text()
    except OSError:
        return False
    return any(name_part in os.path.basename(line.split()[-1]) for line in text.splitlines() if "/" in line)


def runtime_info(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """What this process runs with (summary.json's `cpu_threads.runtime`)."""
    environ = os.environ if environ is None else environ
    return {
        "malloc": next((m for m in ("tcmalloc", "jemalloc") if mapped(m)), "system"),
        "omp": {k: environ[k] for k in sorted(environ) if k.startswith(("OMP_", "GOMP_", "KMP_"))},
        "startup_step": "off" if is_off(environ) else "on" if _applied else "not run",
    }


_applied = False  # whether prepare() set this process up (summary.json's startup_step)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def prepare(argv: Sequence[str] | None = None, environ: MutableMapping[str, str] | None = None,
            execve: Callable[[str, list[str], Mapping[str, str]], object] = os.execve,
            malloc: Path | None = None, torch_loaded: bool | None = None, maps: Path = Path("/proc/self/maps"),
            say: Callable[[str], object] = _say) -> Plan:
    """Apply the plan to this process: set the variables, re-execute once if a preload is due, else print
    the one line. Must run before torch is imported (else the OpenMP settings would be too late)."""
    environ = os.environ if environ is None else environ
    if is_off(environ):
        return plan(environ, None)  # silent: the user asked for nothing
    if torch_loaded is None:
        torch_loaded = "torch" in sys.modules
    if torch_loaded:
        p = Plan(notes=["torch was imported before the start-up step: OpenMP and malloc left as they are"])
        say(p.line())
        return p
    global _applied
    _applied = True
    p = plan(environ, malloc if malloc is not None else find_malloc(), can_restart=argv is not None or restartable())
    if MARKER in environ:  # the restarted process: the marker's job is done, subprocesses start afresh
        del environ[MARKER]
        if "tcmalloc" in environ.get("LD_PRELOAD", "") and not mapped("tcmalloc", maps):
            del environ["LD_PRELOAD"]  # else every program the job starts prints the loader's error again
            _drop_preload(p, "glibc malloc (tcmalloc could not be preloaded: see the loader's message above)")
    environ.update(p.env)
    if p.reexec:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            execve(sys.executable, list(sys.orig_argv if argv is None else argv), environ)
            return p  # only a fake execve returns
        except OSError as e:  # e.g. no usable sys.executable (an embedded interpreter): run on glibc's malloc
            for key in ("LD_PRELOAD", MARKER):
                environ.pop(key, None)
            p.reexec = False
            _drop_preload(p, f"glibc malloc (could not restart to preload tcmalloc: {e})")
    say(p.line())
    return p


def _drop_preload(p: Plan, note: str) -> None:
    p.notes = [n for n in p.notes if not n.startswith("tcmalloc preloaded")] + [note]
