"""Ordered, bounded parallelism over a file's sections."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

__all__ = ["threads", "run_ordered"]


def threads(n: int | None) -> int:
    """Worker threads: ``n``, else ``$KVCODEC_THREADS``, else the CPU count."""
    if n is None:
        n = int(os.environ.get("KVCODEC_THREADS", "0")) or (os.cpu_count() or 1)
    return max(1, n)


def run_ordered(jobs, work, n_threads, consume, progress=None, prepare=None) -> None:
    """Run ``work(job, prepared)`` in a bounded window of threads, in order.

    ``prepare(job)`` runs in the calling thread (file reads: file objects are
    not thread-safe); ``consume(job, result)`` also runs there, in job order.
    At most ``2 * threads`` jobs are in flight, which bounds memory.
    """
    prepare = prepare or (lambda job: None)
    n = threads(n_threads)

    def done(job, result):
        consume(job, result)
        if progress:
            progress(1)

    if n == 1 or len(jobs) < 2:
        for job in jobs:
            done(job, work(job, prepare(job)))
        return
    with ThreadPoolExecutor(n) as ex:
        window = []
        for job in jobs:
            window.append((job, ex.submit(work, job, prepare(job))))
            if len(window) >= 2 * n:
                j, f = window.pop(0)
                done(j, f.result())
        for j, f in window:
            done(j, f.result())
