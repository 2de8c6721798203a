"""Tests marked ``gpu`` (skipped without CUDA; ``make gpu-check`` runs them): the CUDA vLLM
has every API the rollout server uses, and the learner's process group on CUDA is NCCL with
gloo beside it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _has_cuda_vllm() -> bool:
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _has_cuda_vllm(), reason="needs the CUDA build of vLLM")
def test_the_cuda_vllm_has_every_api_the_rollout_server_uses():
    import vllm

    from rollout_servers.vllm_check import missing_apis

    assert missing_apis(vllm) == []


def test_the_learner_group_on_cuda_is_nccl_with_gloo_beside_it():
    code = (
        "import torch, torch.distributed as dist\n"
        "from learner.fsdp import init_distributed\n"
        "mesh = init_distributed('cuda')\n"
        "assert 'cuda:nccl' in dist.get_backend_config(), dist.get_backend_config()\n"
        "t = torch.ones(1, device='cuda'); dist.all_reduce(t); c = torch.ones(1); dist.all_reduce(c)\n"
        "assert t.item() == c.item() == 1 and mesh.device_type == 'cuda'\n"
        "dist.destroy_process_group()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
