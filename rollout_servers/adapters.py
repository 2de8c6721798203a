"""The LoRA adapter versions a rollout server holds in vLLM (``sync.lora: adapter``).

Each push of the learner's adapters becomes a vLLM LoRA adapter of its own, named after
the policy version (``policy-v<version>-<n>``, vLLM id ``n``, the count of adapters loaded), read
from a peft directory the engine's worker wrote. New requests take the current version; a
request keeps the adapter it started with until it finishes, so its tokens all carry that
version and its behaviour logprobs describe one policy (unless it is moved, below). A
version is released (unloaded from vLLM, its files deleted) once it is neither current nor among the ``keep`` newest and
no request uses it any more; ``keep`` is ``max_policy_lag + 1`` by default, the versions a
request may still be sampling from while it is fresh enough to train.

A request still running on a version that falls out of the ``keep`` newest is moved: it is
aborted and goes on, from the tokens it has, on the current adapter (its tokens keep the
versions they were sampled under). Left running, such requests held vLLM's ``max_loras``
places in a batch with adapters whose groups are too stale to train, and a new version's
requests (and the post-sync probe) waited until they ended.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: vLLM's allowed ``max_lora_rank`` values (``vllm.config.lora.MaxLoRARanks``, 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_lora_rank(rank: int) -> int:
    """The smallest rank vLLM allows that holds adapters of ``rank`` (a smaller adapter is
    padded by vLLM); an error naming the limit above the largest."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"model.lora_rank={rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}: "
        "lower model.lora_rank or push merged weights (sync.lora=merged)"
    )


@dataclass
class _Loaded:
    version: int
    request: Any  # vllm.lora.request.LoRARequest
    path: Path
    users: set[str] = field(default_factory=set)  # the vLLM request ids running on it


class AdapterVersions:
    """Which adapters are loaded, which is current, and how many requests use each. Runs
    on the engine's event loop (not thread-safe).

    Adapters are keyed by a load counter, not by version: a learner that restarted from an
    older checkpoint pushes a version number again with other weights, and the requests
    still on the first copy must keep it.
    """

    def __init__(self, root: str | Path, *, keep: int, rank: int, alpha: float):
        self.root = Path(root)
        self.keep = max(1, keep)
        self.rank, self.alpha = rank, alpha  # written into each adapter's config
        self.current: int | None = None  # a key of _loaded
        self._loaded: dict[int, _Loaded] = {}
        self._next_id = 1  # vLLM's LoRA ids start at 1
        self._moved: set[str] = set()  # request ids aborted to go on on the current adapter
        self._abort_failed: set[str] = set()  # of those, the ones whose abort raised

    def path_for(self, version: int) -> Path:
        """Where the next adapter's files go (the worker writes them there)."""
        return self.root / f"v{version}-{self._next_id}"

    @property
    def versions(self) -> list[int]:
        """The policy versions of the adapters loaded now, oldest first."""
        return [self._loaded[k].version for k in sorted(self._loaded)]

    @property
    def version(self) -> int | None:
        """The current adapter's policy version (None before the first)."""
        return None if self.current is None else self._loaded[self.current].version

    async def activate(self, llm: Any, version: int) -> None:
        """Load the adapter written to :meth:`path_for` ``(version)`` into vLLM and make it
        current for new requests; release adapters nobody needs any more. When vLLM refuses
        the adapter, its files are deleted and the error raised."""
        from vllm.lora.request import LoRARequest

        key, path = self._next_id, self.path_for(version)
        request = LoRARequest(f"policy-v{version}-{key}", key, str(path))
        try:
            await llm.add_lora(request)
        except Exception:  # a cancel leaves the engine core loading it: kept
            # Never loaded, so never pruned: its files would stay on disk until the server
            # exits, one folder (the adapter's size) per failed load of a new version.
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._next_id += 1
        self._loaded[key] = _Loaded(version, request, path)
        self.current = key
        await self.move_stale(llm)
        await self.prune(llm)

    def _past_kept(self) -> list[int]:
        """The adapters, oldest first, neither current nor among the ``keep`` newest."""
        newest = sorted(self._loaded, reverse=True)[: self.keep]
        return [k for k in sorted(self._loaded) if k not in newest and k != self.current]

    async def move_stale(self, llm: Any) -> None:
        """Abort the requests running on adapters past the kept ones (their :meth:`moved`
        says so, and they go on on the current adapter). An abort that raises fails no
        push: the new adapter serves all the same. vLLM ends the requests before it tells
        the engine core (the step that raises), so they still read as moved; any that
        still run are aborted again at the next adapter."""
        running = [rid for key in self._past_kept() for rid in self._loaded[key].users]
        stale = [rid for rid in running if rid not in self._moved or rid in self._abort_failed]
        if stale:
            self._moved.update(stale)
            self._abort_failed.difference_update(stale)
            try:
                await llm.abort(stale)
            except Exception as e:
                self._abort_failed.update(stale)
                log.warning(
                    "aborting %d request(s) on an adapter past the kept ones failed (%s): "
                    "those still running are aborted again at the next adapter",
                    len(stale),
                    e,
                )

    def moved(self, request_id: str) -> bool:
        """Whether request ``request_id`` was aborted by :meth:`move_stale` (asked once,
        when it has ended)."""
        self._abort_failed.discard(request_id)
        if request_id in self._moved:
            self._moved.discard(request_id)
            return True
        return False

    def acquire(self, request_id: str) -> tuple[int, int, Any] | None:
        """``(key, version, LoRARequest)`` for request ``request_id``, counted as a user until
        :meth:`release` ``(key, request_id)``; None before the first adapter (the base model serves)."""
        if self.current is None:
            return None
        a = self._loaded[self.current]
        a.users.add(request_id)
        return self.current, a.version, a.request

    def release(self, key: int, request_id: str) -> None:
        """Request ``request_id`` on adapter ``key`` ended (unloading waits for the next
        activation)."""
        a = self._loaded.get(key)
        if a is not None:
            a.users.discard(request_id)

    def current_request(self) -> Any | None:
        """The current adapter's ``LoRARequest`` (None before the first adapter)."""
        return None if self.current is None else self._loaded[self.current].request

    async def prune(self, llm: Any) -> None:
        """Unload adapters older than the ``keep`` newest that no request uses."""
        for key in self._past_kept():
            a = self._loaded[key]
            if a.users:
                continue
            del self._loaded[key]
            try:
                await llm.remove_lora(key)
            except Exception as e:  # evicted by vLLM already: nothing to unload
                log.debug("adapter %s not unloaded: %s", a.request.lora_name, e)
            shutil.rmtree(a.path, ignore_errors=True)
