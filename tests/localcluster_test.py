"""The one-core-per-device local cluster's process environment (no JAX in the children)."""

from __future__ import annotations

import json

from jaxhybrid.program import localcluster

_SHOW_ENV = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
             "('GLIBC_TUNABLES', 'XLA_FLAGS', 'JAXHYBRID_RANK', 'JAXHYBRID_NPROCS')}))")


def test_malloc_hugepages_tunable_is_merged_not_overwritten():
  assert localcluster.with_malloc_hugepages({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
  other = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"}
  out = localcluster.with_malloc_hugepages(other)
  assert out["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
  assert out["PATH"] == "/bin" and other["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
  # A user's own hugetlb choice is kept.
  mine = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
  assert localcluster.with_malloc_hugepages(mine)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"


def test_launch_gives_each_process_its_rank_flags_and_tunable(monkeypatch):
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  results = localcluster.launch(["-c", _SHOW_ENV], 2, timeout_s=120)
  envs = [json.loads(r.stdout) for r in results]
  assert [e["JAXHYBRID_RANK"] for e in envs] == ["0", "1"]
  for e in envs:
    assert e["JAXHYBRID_NPROCS"] == "2"
    assert e["GLIBC_TUNABLES"] == localcluster.MALLOC_HUGEPAGES_TUNABLE
    assert localcluster.SINGLE_THREAD_XLA_FLAGS in e["XLA_FLAGS"]
  plain = localcluster.launch(["-c", _SHOW_ENV], 1, timeout_s=120, malloc_hugepages=False)
  assert json.loads(plain[0].stdout)["GLIBC_TUNABLES"] is None
