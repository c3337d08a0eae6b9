"""Passes run on one OpenMP pool, whichever thread asks for them (docs/serve.md, "One pool of threads").

ggml's CPU backend (OpenMP) keeps a pool of workers per calling thread, and libgomp sleeps at every barrier once
the pools' workers outnumber the cores. So the engine leaves no pool behind on the loading thread
(``loader.release_openmp_threads``), and with slots one decode thread runs every pass. The checks count the
process's threads (/proc/self/status), which hold every pool's workers.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from clover_dev.convert import clover_convert, quantize
from tests.support.tmp import MkTemp

pytestmark = pytest.mark.native  # every test here runs the native build (skipped without it; a failure in CI)

PROMPT = list(range(40, 72))
THREADS = 2  # the engine's threads: a pool holds THREADS - 1 workers besides its calling thread


def os_threads() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


@pytest.fixture(scope="module")
def tiny_q8(tiny_checkpoint: Path, module_tmp: MkTemp) -> Path:
    """Q8_0: on CPUs with AMX its weights are converted in an OpenMP loop at load time."""
    folder = module_tmp("openmp")
    return quantize(clover_convert(tiny_checkpoint, folder / "tiny-f32.gguf", "f32"), folder / "tiny-q8_0.gguf")


def test_the_load_leaves_no_pool_and_a_pass_pool_can_be_released(tiny_q8: Path) -> None:
    """(Other threads of the test process may end meanwhile, never start: so "no more" where none is made.)"""
    from clover_native import loader
    from clover_cpp.model import Model

    loader.llama()
    loader.release_openmp_threads()  # whatever an earlier test on this thread left
    base = os_threads()
    with Model(tiny_q8, n_threads=THREADS) as model:
        assert os_threads() <= base, f"the load left OpenMP workers on the loading thread ({os_threads()} > {base})"
        model.run(PROMPT, mode="ar", max_tokens=2, stop_ids=[])
        after_pass = os_threads()  # the pass made a pool on this thread: the release ends its workers
        assert loader.release_openmp_threads()
        assert after_pass - os_threads() == THREADS - 1


def test_slots_decode_on_one_thread(tiny_q8: Path) -> None:
    """Two slots run from two threads: their passes make one pool (the decode thread's), not one per caller."""
    from clover_native import loader
    from clover_cpp.model import Model

    loader.llama()
    loader.release_openmp_threads()
    with ThreadPoolExecutor(max_workers=2) as pool, Model(tiny_q8, n_threads=THREADS, n_parallel=2) as model:
        barrier = threading.Barrier(2)
        list(pool.map(lambda _: barrier.wait(), (0, 1)))  # both executor threads exist before the count
        base = os_threads()

        def run(i: int) -> list[int]:
            barrier.wait()
            return model.slot(i).run(PROMPT, mode="ar", max_tokens=8, stop_ids=[]).tokens

        assert [len(out) for out in pool.map(run, (0, 1))] == [8, 8]
        grown = os_threads() - base
        assert grown <= THREADS - 1, f"{grown} new threads: a pool per calling thread"
