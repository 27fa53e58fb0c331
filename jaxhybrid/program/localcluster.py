"""One-core-per-device CPU "clusters" on localhost, for honest model-parallel timing.

XLA's CPU backend spreads one device's work over every core, so simulated devices in one process
compete for the same cores and say nothing about MP speed. Here each device is its own process,
pinned to its own core with a single-threaded XLA CPU runtime, and the processes join through
JAX's own runtime (`jax.distributed.initialize`, gloo collectives on localhost).

The parent calls `launch(argv, nprocs)`; the child calls `worker_setup()` FIRST (before importing
anything that starts JAX), then `worker_init()` after importing jax.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

# How often `launch` looks at its processes (s).
POLL_S = 0.2

ENV_RANK = "JAXHYBRID_RANK"
ENV_NPROCS = "JAXHYBRID_NPROCS"
ENV_COORD = "JAXHYBRID_COORDINATOR"
ENV_CORE = "JAXHYBRID_CORE"

# XLA CPU flags for a one-core device: no Eigen thread pool (the process's core affinity, set
# by `worker_setup`, does the rest). Every word must be a `--flag`: XLA stops reading XLA_FLAGS
# at the first word that is not one, so a bare word would silently drop every flag after it.
SINGLE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"

# glibc malloc tunables for the timing processes. XLA's CPU runtime takes a step's large
# temporaries from malloc; by default glibc serves blocks above its mmap threshold with fresh
# mappings (and trims freed heap back to the kernel), so every step touches its temporaries page
# by page again, faults included, which a GPU's arena allocator never pays. Measured on this
# project's 2-core VM, GNMT-small (one core per process): 53,900 minor page faults and 1.41 s per
# 2-way step with none of these, 268 faults and 1.22 s with hugetlb alone (large blocks on
# transparent huge pages); the plain one-core jit step still took 400-1,900 faults per step with
# hugetlb alone and 0 with all four (one arena, no mmap'd blocks, no trimming: freed memory is
# reused as it is), the fastest of three alternating runs 0.554-0.561 s against 0.573-0.597 s.
# An assumption of the CPU stand-in, not of the method. glibc >= 2.35 (older glibc ignores
# hugetlb).
MALLOC_TUNABLES = (
  "glibc.malloc.hugetlb=1",
  "glibc.malloc.arena_max=1",
  "glibc.malloc.mmap_max=0",
  "glibc.malloc.trim_threshold=17179869184",  # 16 GiB: freed memory stays in the heap
)


# Idle spinners (`launch(idle_spinners=True)`): one busy loop per pinned core at the SCHED_IDLE
# policy, which runs only when nothing else on its core wants to. A device waiting for a message
# then never leaves its core idle; on a VM without guest halt polling (this project's: kernel
# command line `haltpoll.guest_halt_poll_ns=0`) an idle vCPU halts, and waking it goes through
# the host, which a GPU waiting in a collective never pays. An assumption of the CPU stand-in
# under test, off by default (experiments/bench/pair_times.py times plans with and without).
IDLE_SPINNER = "while True: pass"


def _start_idle_spinners(cores: Sequence[int]) -> list[subprocess.Popen]:
  """One SCHED_IDLE busy loop pinned to each of `cores` (see IDLE_SPINNER)."""

  def idle_on(core: int):
    def setup():
      os.sched_setaffinity(0, {core})
      os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return setup

  return [subprocess.Popen([sys.executable, "-c", IDLE_SPINNER], preexec_fn=idle_on(c),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
          for c in sorted(set(cores))]


def with_malloc_tunables(env: dict[str, str]) -> dict[str, str]:
  """`env` with MALLOC_TUNABLES added to GLIBC_TUNABLES; a tunable the environment already sets
  (by name) keeps its value."""
  out = dict(env)
  tunables = [t for t in out.get("GLIBC_TUNABLES", "").split(":") if t]
  have = {t.split("=", 1)[0] for t in tunables}
  tunables += [t for t in MALLOC_TUNABLES if t.split("=", 1)[0] not in have]
  out["GLIBC_TUNABLES"] = ":".join(tunables)
  return out


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(
  argv: Sequence[str],
  nprocs: int,
  *,
  timeout_s: float = 900,
  cores: Sequence[int] | None = None,
  devices_per_process: int = 1,
  pin: bool = True,
  malloc_tunables: bool = True,
  idle_spinners: bool = False,
) -> list[subprocess.CompletedProcess]:
  """Runs `python argv...` as `nprocs` processes of one JAX job on localhost.

  Args:
    argv: the script and its arguments (the interpreter is `sys.executable`).
    nprocs: number of processes.
    timeout_s: wall-clock limit for the whole job.
    cores: the core each process is pinned to (default 0, 1, ...; wraps around).
    devices_per_process: simulated CPU devices per process (1 for timing).
    pin: pin each process to one core with a single-threaded XLA runtime.
    malloc_tunables: start the processes with MALLOC_TUNABLES (see there).
    idle_spinners: with `pin`, keep a SCHED_IDLE busy loop on each process's core while the job
      runs (see IDLE_SPINNER); Linux only.

  Returns:
    The completed processes (returncode, stdout, stderr), rank order.

  Raises:
    RuntimeError: if a process fails or the job times out; the message holds its stderr tail.
  """
  port = free_port()
  ncpu = os.cpu_count() or 1
  cores = list(cores) if cores is not None else [i % ncpu for i in range(nprocs)]
  with contextlib.ExitStack() as files:
    if idle_spinners and pin:
      spinners = _start_idle_spinners([cores[r % len(cores)] for r in range(nprocs)])
      files.callback(lambda: [(p.kill(), p.wait()) for p in spinners])
    procs = []
    for rank in range(nprocs):
      env = dict(os.environ)
      env.update({
        ENV_RANK: str(rank), ENV_NPROCS: str(nprocs), ENV_COORD: f"127.0.0.1:{port}",
        "JAX_PLATFORMS": "cpu",
      })
      flags = f"--xla_force_host_platform_device_count={devices_per_process}"
      if pin:
        env[ENV_CORE] = str(cores[rank % len(cores)])
        flags += " " + SINGLE_THREAD_XLA_FLAGS
      env["XLA_FLAGS"] = flags
      if malloc_tunables:
        env = with_malloc_tunables(env)
      # Output goes to files, not pipes: the parent polls every process (below) and a pipe that
      # nobody reads would block a chatty child.
      logs = (files.enter_context(tempfile.TemporaryFile("w+")),
              files.enter_context(tempfile.TemporaryFile("w+")))
      procs.append((subprocess.Popen([sys.executable, *argv], env=env, stdout=logs[0], stderr=logs[1],
                                     text=True), logs))
    deadline = time.monotonic() + timeout_s
    timed_out = False
    # The first process to fail ends the job: the others would otherwise wait for it (in a
    # collective, or as a load that runs until told to stop) until the timeout.
    while any(p.poll() is None for p, _ in procs):
      if any(p.poll() not in (None, 0) for p, _ in procs) or time.monotonic() > deadline:
        timed_out = not any(p.poll() not in (None, 0) for p, _ in procs)
        for p, _ in procs:
          if p.poll() is None:
            p.kill()
        break
      time.sleep(POLL_S)
    results = []
    for p, (out, err) in procs:
      p.wait()
      out.seek(0)
      err.seek(0)
      results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
    if timed_out:
      raise RuntimeError(f"local cluster job {argv} timed out after {timeout_s:.0f} s")
    # The process that failed first on its own, not one killed for it (rank order among those).
    bad = [r for r in results if r.returncode not in (0, -signal.SIGKILL)] or [
      r for r in results if r.returncode != 0]
    if bad:
      tail = "\n".join(bad[0].stderr.strip().splitlines()[-15:])
      raise RuntimeError(f"local cluster job {list(argv)} failed (rc={bad[0].returncode}):\n{tail}")
    return results


def worker_setup() -> tuple[int, int]:
  """In a child of `launch`, before JAX starts: pins the core. Returns (rank, nprocs)."""
  rank = int(os.environ.get(ENV_RANK, "0"))
  nprocs = int(os.environ.get(ENV_NPROCS, "1"))
  core = os.environ.get(ENV_CORE)
  if core is not None and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {int(core)})
  return rank, nprocs


def worker_init() -> None:
  """In a child of `launch`, after importing jax: joins the job (no-op for one process)."""
  import jax

  nprocs = int(os.environ.get(ENV_NPROCS, "1"))
  if nprocs <= 1:
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=os.environ[ENV_COORD],
    num_processes=nprocs,
    process_id=int(os.environ[ENV_RANK]),
  )
