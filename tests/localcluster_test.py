"""The one-core-per-device local cluster's process environment (no JAX in the children)."""

from __future__ import annotations

import json
import time

import pytest

from jaxhybrid.program import localcluster

_SHOW_ENV = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
             "('GLIBC_TUNABLES', 'XLA_FLAGS', 'JAXHYBRID_RANK', 'JAXHYBRID_NPROCS')}))")


def test_malloc_tunables_are_merged_not_overwritten():
  assert localcluster.with_malloc_tunables({})["GLIBC_TUNABLES"] == ":".join(
    localcluster.MALLOC_TUNABLES)
  other = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0", "PATH": "/bin"}
  out = localcluster.with_malloc_tunables(other)
  assert out["GLIBC_TUNABLES"] == ":".join(("glibc.malloc.tcache_count=0",
                                            *localcluster.MALLOC_TUNABLES))
  assert out["PATH"] == "/bin" and other["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0"
  # A user's own choice of one of them is kept, the others added.
  mine = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=4"}
  got = localcluster.with_malloc_tunables(mine)["GLIBC_TUNABLES"].split(":")
  assert got[:2] == ["glibc.malloc.hugetlb=0", "glibc.malloc.arena_max=4"]
  assert sorted(t.split("=")[0] for t in got) == sorted(
    t.split("=")[0] for t in localcluster.MALLOC_TUNABLES)


def test_single_thread_flags_are_all_flags():
  # XLA stops reading XLA_FLAGS at the first word that is not a --flag, dropping the rest.
  words = localcluster.SINGLE_THREAD_XLA_FLAGS.split()
  assert words and all(w.startswith("--") and "=" in w for w in words), words


def test_launch_gives_each_process_its_rank_flags_and_tunable(monkeypatch):
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  results = localcluster.launch(["-c", _SHOW_ENV], 2, timeout_s=120)
  envs = [json.loads(r.stdout) for r in results]
  assert [e["JAXHYBRID_RANK"] for e in envs] == ["0", "1"]
  for e in envs:
    assert e["JAXHYBRID_NPROCS"] == "2"
    assert e["GLIBC_TUNABLES"] == ":".join(localcluster.MALLOC_TUNABLES)
    assert localcluster.SINGLE_THREAD_XLA_FLAGS in e["XLA_FLAGS"]
  plain = localcluster.launch(["-c", _SHOW_ENV], 1, timeout_s=120, malloc_tunables=False)
  assert json.loads(plain[0].stdout)["GLIBC_TUNABLES"] is None


_FAIL_OR_WAIT = (
  "import os, sys, time\n"
  "if os.environ['JAXHYBRID_RANK'] == '0':\n"
  "  print('rank 0 gives up', file=sys.stderr)\n"
  "  sys.exit(3)\n"
  "time.sleep(600)\n"
)


def test_a_failing_process_ends_the_job_at_once():
  # Rank 1 would wait 600 s (as a load waits to be told to stop); rank 0's failure ends the job.
  t0 = time.monotonic()
  with pytest.raises(RuntimeError, match=r"failed \(rc=3\):\nrank 0 gives up"):
    localcluster.launch(["-c", _FAIL_OR_WAIT], 2, timeout_s=900, pin=False)
  assert time.monotonic() - t0 < 600


def test_a_job_past_its_timeout_is_stopped():
  with pytest.raises(RuntimeError, match="timed out after 1 s"):
    localcluster.launch(["-c", "import time; time.sleep(600)"], 1, timeout_s=1, pin=False)


_FIND_SPINNERS = (
  "import json, os\n"
  "found = []\n"
  "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
  "  try:\n"
  "    cmd = open(f'/proc/{pid}/cmdline').read().rstrip(chr(0)).split(chr(0))\n"
  "    if cmd[-2:] == ['-c', %r]:\n"
  "      found.append([os.sched_getscheduler(int(pid)) == os.SCHED_IDLE,\n"
  "                    sorted(os.sched_getaffinity(int(pid)))])\n"
  "  except OSError:\n"
  "    pass\n"
  "print(json.dumps(sorted(found)))\n"
) % localcluster.IDLE_SPINNER


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="Linux scheduling only")
def test_idle_spinners_run_on_each_core_at_idle_priority_while_the_job_runs():
  import os

  cores = sorted(os.sched_getaffinity(0))[:2]
  (res,) = localcluster.launch(["-c", _FIND_SPINNERS], 1, timeout_s=120, cores=cores[:1],
                               idle_spinners=True)
  assert json.loads(res.stdout) == [[True, cores[:1]]]
  # Gone once the job has ended; none without the option.
  (res,) = localcluster.launch(["-c", _FIND_SPINNERS], 1, timeout_s=120, cores=cores[:1])
  assert json.loads(res.stdout) == []
