"""The launcher's environment variables that ``asyncrl-launch --ray`` hands every role.

A role under Ray starts in its node's environment (that of ``ray start`` there), not the
launcher's, while the launcher's checks read the launcher's (W&B's key, say). So the
variables of :data:`FORWARDED_PREFIXES` and :data:`FORWARDED_NAMES` set where the launcher
runs are set for every role too, over the node's own; a variable the launcher plans for a
role itself wins over them. Device ids (``CUDA_VISIBLE_DEVICES`` and the like) are never
forwarded: Ray gives each role the GPUs of its bundle. Pure: no Ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from asyncrl.launch.role_state import Role

#: Forwarded by prefix: W&B (``WANDB_API_KEY``, ``WANDB_MODE``, ...), the Hugging Face hub
#: and caches (``HF_HOME``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``, ...), transformers, and
#: NCCL's network settings (``NCCL_SOCKET_IFNAME``, ``NCCL_IB_HCA``, ...).
FORWARDED_PREFIXES = ("WANDB_", "HF_", "TRANSFORMERS_", "NCCL_")
#: Forwarded by name: the older hub token, gloo's and TensorPipe's network interface.
FORWARDED_NAMES = frozenset({"HUGGING_FACE_HUB_TOKEN", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"})
#: Never forwarded, whatever the lists above say: they name one machine's devices.
NEVER_FORWARDED = frozenset({"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"})


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` (the launcher's) that every role gets."""
    return {
        k: v
        for k, v in environ.items()
        if (k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES) and k not in NEVER_FORWARDED
    }


def forward_env(roles: Iterable[Role], environ: Mapping[str, str]) -> list[str]:
    """Give each of ``roles`` the forwarded variables of ``environ`` (its own planned
    variables win); the names forwarded, sorted (values stay out of logs: keys)."""
    extra = forwarded_env(environ)
    for role in roles:
        role.env = {**extra, **role.env}
    return sorted(extra)
