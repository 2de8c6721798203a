"""The buffer's process reuses the memory of freed batch replies instead of faulting fresh
pages in for every batch (``buffer.memory.reuse_freed_memory``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a child process: the setting is process-wide and must not change pytest's own malloc.
CHILD = """
import resource, sys
import numpy as np
from asyncrl.wire.codec import _joined
from buffer.memory import reuse_freed_memory

# A batch of 16 groups of 8 x (128 prompt + 1024 response tokens): three frames, each
# joined from 16 arrays and alive together until zmq has sent them (bench_transport's shape).
prompts = [np.ones(8 * 128, np.int32) for _ in range(16)]
responses = [np.ones(8 * 1024, np.int32) for _ in range(16)]
logprobs = [np.ones(8 * 1024, np.float32) for _ in range(16)]


def faults(n=50):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        frames = [_joined(prompts), _joined(responses), _joined(logprobs)]
        del frames
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


faults(5)  # warm up
default = faults()
assert reuse_freed_memory()
faults(5)
reused = faults()
print(default, reused)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_batch_replies_reuse_freed_memory():
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True
    )
    default, reused = (int(x) for x in out.stdout.split())
    # 50 batches of 2.1 MB, about 530 pages each: by default a good part of every batch
    # is mapped fresh (11200 faults here), after the call next to none.
    assert default > 50 * 100, (default, reused)
    assert reused < default / 10, (default, reused)


GC_CHILD = """
import gc, time
from buffer.core import ReplayBuffer
from buffer.memory import COLLECT_EVERY_S, collect_on_schedule
from buffer.service import BufferService

assert gc.isenabled()
assert collect_on_schedule() == COLLECT_EVERY_S
assert not gc.isenabled()


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


gc.collect()
cycles = [Node() for _ in range(1000)]
del cycles
leaked = sum(isinstance(o, Node) for o in gc.get_objects())
service = BufferService(
    ReplayBuffer(batch_size=1, capacity_groups=8, max_policy_lag=1), collect_every_s=0.05
).start()
deadline = time.monotonic() + 30
runs = 0.0
while time.monotonic() < deadline:
    runs = service.metrics().get("buffer/gc_runs", 0.0)  # counted once the run is done
    if runs >= 1 and not any(isinstance(o, Node) for o in gc.get_objects()):
        break
    time.sleep(0.05)
left = sum(isinstance(o, Node) for o in gc.get_objects())
service.stop()
print(leaked, left, runs)
"""


def test_the_buffers_process_collects_garbage_on_its_own_schedule():
    """With the automatic collector off (as the buffer's process runs), cyclic garbage
    stays until the service loop's scheduled collection frees it."""
    out = subprocess.run(
        [sys.executable, "-c", GC_CHILD], capture_output=True, text=True, timeout=120, check=True
    )
    leaked, left, runs = (float(x) for x in out.stdout.split())
    assert leaked == 1000  # nothing freed them on allocation counts
    assert left == 0 and runs >= 1
