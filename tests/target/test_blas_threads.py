"""The emulator runs numpy's BLAS on one thread (``device.one_blas_thread``), unless the
user set a thread count: emulators run side by side (forked tuner workers, ``pytest -n``,
servers), and BLAS threads spinning on every core made them starve one another."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import json, multiprocessing as mp
import numpy  # noqa: F401  (loads the BLAS library)
from threadpoolctl import threadpool_info
def blas():
    return sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
before = blas()
from edgetvm.target.emulator import Emulator
Emulator()
def child(q):
    q.put(blas())
q = mp.get_context("fork").Queue()
p = mp.get_context("fork").Process(target=child, args=(q,))
p.start(); p.join()
print(json.dumps([before, blas(), q.get()]))
"""


def _probe(env_extra: dict) -> tuple:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
    return tuple(json.loads(out))       # BLAS threads before, after an Emulator, forked


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="BLAS has one thread anyway")
def test_an_emulator_limits_blas_to_one_thread_and_forked_workers_inherit_it():
    before, after, forked = _probe({})
    assert before and max(before) > 1          # the library's default: a thread per core
    assert after == [1] and forked == [1]


def test_a_thread_count_the_user_set_is_kept():
    before, after, forked = _probe({"OPENBLAS_NUM_THREADS": "2"})
    assert after == before == forked == [2]
