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
