"""Host memory for CPU serving: keep glibc from handing activations back to the OS between batches.

A packed body allocates and frees the same few large activation tensors in every
layer of every batch. With glibc's defaults, blocks over the (dynamic) mmap
threshold are mmapped and unmapped each time, freed heap tops are trimmed, and
the compute thread gets an arena of its own whose heaps shrink too, so each body
pays hundreds of thousands of page faults: measured 0.6M minor faults and
6.1-6.6 s for a 64 x 128 body on the `body` demo shape, against none and 5.4 s
with one arena, the largest fixed mmap threshold (32 MiB) and no trimming, with
packs whose activations stay under that threshold (packing.cpu_pack_tokens).
Freed memory then stays in the process for the next batch, as a CUDA caching
allocator keeps device memory; peak RSS is unchanged.

Python's own collector is tuned too: what start-up leaves alive (the model's modules, the
imports, the JSON tables: ~380k tracked objects on the demo) is frozen, so a full collection,
which requests' allocations trigger now and then, no longer walks it (155 ms -> under 1 ms
on the demo: a pause every thread, the compute thread included, would wait out).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger("logitserve.hostmem")

MMAP_THRESHOLD = 32 << 20      # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def tune_host_malloc() -> bool:
    """One arena, fixed 32 MiB mmap threshold, no trimming; call before threads start. False where not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, 2**31 - 1)))
    if not ok:
        log.warning("mallopt refused a setting; host allocations keep glibc's defaults")
    return ok


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM) in MiB; 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive now to the permanent generation (call when ready to serve)."""
    gc.collect()
    gc.freeze()
    log.debug("froze %d objects alive at start-up", gc.get_freeze_count())
