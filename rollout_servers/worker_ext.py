"""vLLM worker extension: receive weights from the learner inside every vLLM worker.

vLLM adds these methods to each of its workers (``worker_extension_cls``); the rollout
server calls them with ``AsyncLLM.collective_rpc("wsync_...")``. The names carry a
``wsync_`` prefix because the worker has methods of its own (``update_weights``,
``reload_weights``, ...). The groups and the transfer are :mod:`asyncrl.sync.groups` and
:mod:`asyncrl.sync.weights`, the same code
the learner sends with; loading uses the model runner's in-place ``reload_weights``
(``model.load_weights`` after start-up fails on the CPU build).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import msgspec

from asyncrl.sync.adapter import save_peft_adapter
from asyncrl.sync.groups import form_group, given_up, open_store, release_group
from asyncrl.sync.plan import WeightPlan
from asyncrl.sync.weights import BroadcastAbandoned, receive_weights
from rollout_servers.sync_progress import WorkerProgress

#: Starts the error of a sync that failed after the engine's weights were partly replaced:
#: the engine cannot generate any more and its server must be restarted.
PARTLY_LOADED = "weights partly loaded"

log = logging.getLogger(__name__)

#: vLLM's in-place reload names each layer that received no weights in this logger.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ExpectedReloadGaps(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for the layers a push never carries by
    design; every other layer's warning passes, since a push that misses real weights must
    be heard.

    - ``RotaryEmbedding``: its cos/sin cache is computed from the config, not loaded; the
      reload puts the same values back.
    - ``ParallelLMHead`` of a tied-embedding model (``tied``): the checkpoint has no head of
      its own, and :meth:`WeightSyncExtension._wsync_retie_embeddings` ties it to the new
      embedding right after.

    Without it every push printed both warnings in every worker (in a 120-step run of the
    demo, 60 pushes: 120 lines per server).
    """

    def __init__(self) -> None:
        super().__init__()
        self.tied = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not isinstance(record.args, tuple):
            return True
        layer = record.args[0] if record.args else None
        return not (layer == "RotaryEmbedding" or (layer == "ParallelLMHead" and self.tied))


_RELOAD_GAPS = ExpectedReloadGaps()
logging.getLogger(RELOAD_LOGGER).addFilter(_RELOAD_GAPS)  # this module loads in each worker


class WeightSyncExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``self.rank``,
    ``self.model_runner``, ``self.device``)."""

    # What the worker class this is mixed into provides (declared for type checkers).
    rank: int
    device: Any
    model_runner: Any

    def wsync_join(
        self,
        host: str,
        port: int,
        generation: str,
        rank_offset: int,
        world_size: int,
        backend: str,
        timeout_s: float,
    ) -> int:
        """Join sync group ``generation`` as rank ``rank_offset + worker rank``; blocks until
        every member (the learner is rank 0) has joined. Returns this worker's group rank."""
        # A fresh store client for every group: after a learner restart the store at the
        # same address is a new one, and an old connection to it is broken.
        self.wsync_leave()  # the group before, if any: replaced
        self._wsync_store = open_store(host, port, is_host=False, timeout_s=timeout_s)
        rank = rank_offset + self.rank
        self._wsync_group = form_group(
            self._wsync_store, generation, rank, world_size, backend=backend, timeout_s=timeout_s
        )
        self._wsync_generation = generation
        return rank

    def wsync_record_progress(self, folder: str) -> None:
        """Record from now on how many buckets each receive has got, in ``folder``: the
        engine tells a slow push from a stuck worker by it (:mod:`rollout_servers.sync_progress`)."""
        self._wsync_progress = WorkerProgress(folder, self.rank)

    def _wsync_stream(self, group: Any, plan: WeightPlan, timeout_s: float) -> Any:
        """The received tensors (:func:`receive_weights`), each bucket recorded as it arrives.
        A wait ends at once when the learner gives the send up (a member was lost mid-send):
        the group is then held aside, not dropped, since dropping it would wait here for the
        receive still posted on it until its timeout."""
        progress = getattr(self, "_wsync_progress", None)
        if progress is not None:
            progress(0)  # the receive has begun
        device = self._wsync_device()
        assert self._wsync_generation is not None  # joined: the group is its
        abandon = given_up(self._wsync_store, self._wsync_generation)
        try:
            yield from receive_weights(
                group, plan, timeout_s=timeout_s, device=device, on_bucket=progress, abandon=abandon
            )
        except BroadcastAbandoned:
            release_group(group, busy_s=timeout_s)
            self._wsync_group = self._wsync_generation = None
            raise

    def wsync_receive(
        self, plan: WeightPlan | dict[str, Any], timeout_s: float
    ) -> dict[str, float]:
        """Receive one broadcast into the model's weights, in place. Returns
        ``{"tensors", "seconds"}``.

        ``plan`` arrives as plain data when vLLM's engine runs in a process of its own (its
        RPC encodes msgpack and decodes it untyped): it is read back into a
        :class:`WeightPlan`, validated."""
        group = getattr(self, "_wsync_group", None)
        if group is None:
            raise RuntimeError("wsync_receive before wsync_join: join a sync group first")
        if not isinstance(plan, WeightPlan):
            plan = msgspec.convert(plan, WeightPlan)
        start = time.monotonic()
        count = 0

        def weights():
            nonlocal count
            for name, tensor in self._wsync_stream(group, plan, timeout_s):
                count += 1
                yield name, tensor

        stream = weights()
        # The first bucket arrives before any weight is touched: a sync that fails at its
        # start (a member died, the learner gave up) leaves the engine's weights intact.
        first = next(stream, None)
        _RELOAD_GAPS.tied = self._wsync_tied()
        try:
            loaded = itertools.chain([first] if first is not None else [], stream)
            self.model_runner.reload_weights(weights_iterator=loaded)
        except Exception as e:  # half the layers may hold nothing now: unusable
            raise RuntimeError(f"{PARTLY_LOADED}: {e}") from e
        self._wsync_retie_embeddings()
        return {"tensors": float(count), "seconds": time.monotonic() - start}

    def wsync_receive_adapter(
        self,
        plan: WeightPlan | dict[str, Any],
        timeout_s: float,
        out_dir: str,
        rank: int,
        alpha: float,
    ) -> dict[str, float]:
        """Receive one broadcast of LoRA adapter tensors and write them to ``out_dir`` in
        peft's format (the first worker writes; every worker takes part in the broadcast),
        for the server to load with ``add_lora``. The engine's own weights are untouched.
        Returns ``{"tensors", "seconds"}``."""
        group = getattr(self, "_wsync_group", None)
        if group is None:
            raise RuntimeError("wsync_receive_adapter before wsync_join: join a sync group first")
        if not isinstance(plan, WeightPlan):
            plan = msgspec.convert(plan, WeightPlan)
        start = time.monotonic()
        stream = self._wsync_stream(group, plan, timeout_s)
        # Copies: the received tensors are views of a bucket the next receive reuses.
        tensors = {name: tensor.to("cpu", copy=True) for name, tensor in stream}
        if self.rank == 0:
            save_peft_adapter(out_dir, tensors, rank=rank, alpha=alpha)
        return {"tensors": float(len(tensors)), "seconds": time.monotonic() - start}

    def _wsync_device(self) -> Any:
        """Where a broadcast lands: the worker's GPU under NCCL, else the CPU."""
        return "cpu" if str(self.device) == "cpu" else self.device

    def _wsync_tied(self) -> bool:
        """Whether the model ties its output head to its input embedding."""
        hf_config = self.model_runner.model_config.hf_config
        return bool(getattr(hf_config, "tie_word_embeddings", False))

    def _wsync_retie_embeddings(self) -> None:
        """Re-tie the output head to the input embedding of a tied-embedding model.

        The in-place reload materialises each layer's weights anew, which unties the head
        from the embedding; the checkpoint has no head weight of its own, so the head would
        keep the old policy's values (vLLM warns "ParallelLMHead: Failed to load weights").
        The head gets the embedding's new tensor back, then its weight processing is re-run
        (on CPU it pre-packs the matrix for the GEMM kernel). Both are sharded alike under
        tensor parallelism, so this is exact shard by shard.
        """
        if not self._wsync_tied():
            return
        modules = dict(self.model_runner.get_model().named_modules())
        head, embed = modules.get("lm_head"), modules.get("model.embed_tokens")
        if head is None or embed is None or not hasattr(head, "quant_method"):
            return
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)

    def wsync_leave(self) -> None:
        """Forget the current group (after a failed sync, or before re-forming): aborted,
        so a broadcast still posted on it ends (:func:`release_group`)."""
        release_group(getattr(self, "_wsync_group", None))
        self._wsync_group = None
        self._wsync_generation = None
