"""The rollout server's vLLM engine: generation with per-token policy versions, and weight
updates while requests are in flight.

:class:`RolloutEngine` wraps one ``AsyncLLM`` (in-process client; vLLM runs its engine core
and workers in child processes), or on CPU an :class:`~rollout_servers.inline_llm.InlineLLM`
(the engine core stepped by a thread of this process). Two things make it more than a thin wrapper:

- Every response knows which policy version produced each token (``version_spans``).
  vLLM labels output tokens with the weight version set by ``update_weight_version``; we
  set it at every sync.
- A weight sync does not wait for requests to finish. ``rollout.sync_mode``:
  ``keep`` freezes in-flight requests, drops their KV cache (so the prefix is recomputed
  under the new weights: the behaviour logprobs of later tokens are exactly the new
  policy's), loads the weights and resumes them; ``abort`` aborts them and
  :meth:`RolloutEngine.generate` re-submits each with its generated prefix appended to the
  prompt and a seed of its own (:func:`~rollout_servers.samples.piece_params`), stitching the pieces into one
  response.
- With pushed LoRA adapters (``sync.lora: adapter``) a sync does not pause at all: the
  adapter loads as a new vLLM adapter (:mod:`rollout_servers.adapters`), new requests take
  it, and a request in flight finishes on the adapter it started with (or, once that one
  falls out of the newest kept, on the current one).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from rollout_servers.samples import Sample, piece_params, sampled_logprob, version_spans_of
from rollout_servers.sync_progress import ProgressWatch, WorkerStuck, unless_stuck
from rollout_servers.worker_ext import PARTLY_LOADED

#: What an engine counts, sent in its server's heartbeats and summed in every step's record.
ENGINE_METRICS = (
    "rollout/sync_pause_s",
    "rollout/resubmitted",
    "rollout/moved_off_stale_adapters",  # sync.lora adapter: see adapters.py
)

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs

    from asyncrl.sync.plan import WeightPlan
    from rollout_servers.adapters import AdapterVersions

log = logging.getLogger(__name__)


class SyncJoin(NamedTuple):
    """Where and as whom to join a new weight-sync group before receiving into it: the
    learner's sync store, the group's generation, this engine's first rank (the learner is
    rank 0) and the group's size and backend. A tuple in the order the workers'
    ``wsync_join`` takes its arguments."""

    host: str
    port: int
    generation: str
    rank_offset: int
    world_size: int
    backend: str


class RolloutEngine:
    """Generation and weight loading on one vLLM engine. All methods run on the event loop
    that created the engine."""

    def __init__(
        self,
        llm: Any,
        sync_mode: str = "keep",
        version: int = 0,
        adapters: AdapterVersions | None = None,
    ) -> None:
        if sync_mode not in ("keep", "abort"):
            raise ValueError(f"sync_mode must be keep or abort, got {sync_mode!r}")
        self.llm: Any = llm  # AsyncLLM or InlineLLM; None once shut down
        # sync.lora: adapter: pushes are LoRA adapters served beside the base weights
        self.adapters = adapters
        self.sync_mode = sync_mode
        self.version = version
        self._serial = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._aborts = 0  # syncs in abort mode so far: a request aborted by one re-submits
        self.partial = False  # a sync broke off mid-load: paused until a whole one
        self._synced = asyncio.Condition()  # notified when a sync ends, loaded or failed
        self._synced_through = 0  # the highest version a sync ended at, loaded or failed
        # rollout/sync_pause_s: the pause clock (paused_s) as each sync ended
        self.metrics: dict[str, float] = dict.fromkeys(ENGINE_METRICS, 0.0)
        self._paused_total = 0.0  # seconds generation was paused for syncs, ended pauses
        self._paused_since: float | None = None  # the pause in progress (held while partial)
        self.stuck = ""  # a worker call that never ended: the engine is of no more use
        self.progress: ProgressWatch | None = None  # where workers record their receives

    @classmethod
    async def start(
        cls,
        args: AsyncEngineArgs,
        sync_mode: str = "keep",
        version: int = 0,
        adapters: AdapterVersions | None = None,
        inline: bool = False,
    ) -> RolloutEngine:
        """Start vLLM from :func:`~rollout_servers.engine_config.engine_args` (~20-30 s on
        2 CPU cores): ``AsyncLLM``, or with ``inline`` its engine core in this process
        (:mod:`rollout_servers.inline_llm`)."""
        if inline:
            if sync_mode != "keep":
                raise ValueError("the inline engine needs sync_mode keep (abort needs AsyncLLM)")
            from rollout_servers.inline_llm import InlineLLM

            llm: Any = InlineLLM.from_engine_args(args)
        else:
            from vllm.v1.engine.async_llm import AsyncLLM

            llm = AsyncLLM.from_engine_args(args)
        engine = cls(llm, sync_mode, version, adapters)
        await llm.update_weight_version(str(version))
        await engine.watch_workers()
        return engine

    async def watch_workers(self) -> None:
        """Have the workers record how far each receive has got, so that a slow push is
        told from a stuck worker (:mod:`rollout_servers.sync_progress`)."""
        self.progress = ProgressWatch()
        await self.llm.collective_rpc("wsync_record_progress", args=(self.progress.folder,))

    def shutdown(self) -> None:
        """Stop vLLM's engine core and workers, and free the engine now.

        ``AsyncLLM`` shuts itself down again when it is freed. Left to the interpreter's
        exit, that second call finds vLLM's module globals already gone and prints a
        ``TypeError`` traceback as the server exits; freed here, it finds nothing left to do.
        """
        llm, self.llm = self.llm, None
        if self.progress is not None:
            self.progress.close()
        if llm is None:  # shut down before
            return
        llm.shutdown()
        del llm
        gc.collect()  # the engine sits in reference cycles (its output handler, its loop)

    @property
    def errored(self) -> bool:
        """Whether vLLM's engine has died, or a worker is stuck in a sync call
        (:attr:`stuck`): then no request or sync can succeed here."""
        return bool(self.stuck or getattr(self.llm, "errored", False))

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> Sample:
        """Sample one response to ``prompt_ids`` (``params.n`` must be 1: groups are
        separate requests with their own seeds). Re-submits with the generated prefix when a
        sync in ``abort`` mode interrupts it."""
        if self.adapters is not None:
            return await self._generate_on_adapter(prompt_ids, params, request_id)
        sample = Sample(start_version=self.version, temperature=float(params.temperature))
        max_tokens = params.max_tokens
        if max_tokens is None:  # a resubmission needs to know what is left of the budget
            raise ValueError("RolloutEngine.generate needs params.max_tokens")
        while True:
            await self._resumed.wait()
            aborts_before, version_before = self._aborts, self.version
            piece = piece_params(params, sample.resubmissions, max_tokens - len(sample.token_ids))
            self._serial += 1
            rid = f"{request_id}#{sample.resubmissions}" if sample.resubmissions else request_id
            final = None
            prompt = {"prompt_token_ids": prompt_ids + sample.token_ids}
            async for out in self.llm.generate(prompt, piece, request_id=rid):
                final = out
            done, ids, logprobs = _piece(final, rid)
            sample.extend(ids, logprobs, version_spans_of(done, len(ids), version_before))
            interrupted = done.finish_reason == "abort" and self._aborts != aborts_before
            if not interrupted:
                _refuse_cut_short(done.finish_reason, rid)
            if not interrupted or len(sample.token_ids) >= max_tokens:
                sample.finish_reason = done.finish_reason or "length"
                if interrupted:
                    sample.finish_reason = "length"
                return sample
            sample.resubmissions += 1
            self.metrics["rollout/resubmitted"] += 1

    async def _generate_on_adapter(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> Sample:
        """:meth:`generate` with pushed adapters: the request runs on the adapter current at
        its start (no pause), so every token has its version. One whose adapter falls out
        of the newest kept is moved (:meth:`AdapterVersions.move_stale`): it goes on from
        its tokens on the current adapter, as a new piece."""
        assert self.adapters is not None
        max_tokens = params.max_tokens
        if max_tokens is None:  # a moved request needs to know what is left of the budget
            raise ValueError("RolloutEngine.generate needs params.max_tokens")
        sample: Sample | None = None
        while True:
            pieces = sample.resubmissions if sample is not None else 0
            rid = f"{request_id}#{pieces}" if pieces else request_id
            held = self.adapters.acquire(rid)
            key, version, lora = held if held is not None else (None, self.version, None)
            if sample is None:
                sample = Sample(start_version=version, temperature=float(params.temperature))
            piece = piece_params(params, pieces, max_tokens - len(sample.token_ids))
            self._serial += 1
            final = None
            try:
                prompt = {"prompt_token_ids": prompt_ids + sample.token_ids}
                async for out in self.llm.generate(
                    prompt, piece, request_id=rid, lora_request=lora
                ):
                    final = out
            finally:
                if key is not None:
                    self.adapters.release(key, rid)
            moved = self.adapters.moved(rid)
            done, ids, logprobs = _piece(final, rid)
            sample.extend(ids, logprobs, [(version, len(ids))] if ids else [])
            interrupted = moved and done.finish_reason == "abort"
            if not interrupted:
                _refuse_cut_short(done.finish_reason, rid)
            if not interrupted or len(sample.token_ids) >= max_tokens:
                sample.finish_reason = "length" if interrupted else done.finish_reason or "length"
                return sample
            sample.resubmissions += 1
            self.metrics["rollout/resubmitted"] += 1
            self.metrics["rollout/moved_off_stale_adapters"] += 1

    async def score(self, sequences: list[list[int]]) -> list[float]:
        """Teacher-forced logprobs of each sequence's tokens after its first, under the
        weights loaded now, at temperature 1 (vLLM's prompt logprobs), concatenated: the
        post-sync probe (:mod:`asyncrl.sync.probe`)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out: list[float] = []
        for i, ids in enumerate(sequences):
            self._serial += 1
            final = None
            rid = f"probe-{self.version}-{i}-{self._serial}"
            lora = self.adapters.current_request() if self.adapters is not None else None
            async for result in self.llm.generate(
                {"prompt_token_ids": ids}, params, request_id=rid, lora_request=lora
            ):
                final = result
            if final is None or final.prompt_logprobs is None:
                raise RuntimeError(f"vLLM returned no prompt logprobs for probe {rid}")
            positions = final.prompt_logprobs[1:]  # the first token has none
            out += [sampled_logprob(d, t) for d, t in zip(positions, ids[1:], strict=True)]
        return out

    async def sync_weights(
        self,
        version: int,
        plan: WeightPlan,
        *,
        join: SyncJoin | None = None,
        timeout_s: float = 120.0,
    ) -> dict[str, float]:
        """Pause, receive the broadcast into every worker, label new tokens ``version``,
        resume. ``join`` joins a new sync group first. Waits for the learner's broadcast (bounded by
        ``timeout_s``); on failure generation resumes under the old weights (not on partly
        loaded ones, nor behind a stuck worker) and the error propagates (the caller
        re-registers and catches up). Either way it wakes :meth:`reach`."""
        try:
            if self.adapters is not None:
                return await self._sync_adapter(version, plan, join=join, timeout_s=timeout_s)
            return await self._sync_full(version, plan, join=join, timeout_s=timeout_s)
        except Exception:
            if not self.stuck:  # a leave would queue behind the stuck call
                await self._leave_group(min(10.0, max(1.0, timeout_s)))
            raise
        finally:
            # A load below the versions synced before (a catch-up down: a learner restarted
            # from an older checkpoint) starts the count again there: a task dealt for a
            # version above it must wait for that version's load, not pass at once.
            loaded = self.version == version and not self.partial
            self._synced_through = version if loaded else max(self._synced_through, version)
            async with self._synced:
                self._synced.notify_all()

    async def _receive(
        self, plan: WeightPlan, join: SyncJoin | None, timeout_s: float, method: str, *args: Any
    ) -> list[dict[str, float]]:
        """Join (with ``join``) and receive on every worker. Each wait in a worker is
        bounded by ``timeout_s``, so a join still running after four (three waits: the
        store, the members' meeting, the group), or a receive in which no worker has
        received a bucket for two (:mod:`rollout_servers.sync_progress`; without their
        records, after ``timeout_s * (4 + buckets)``), has a worker stuck in it: every later
        call would queue behind it, so the engine counts as dead (:attr:`errored`: the
        server exits 4 and is restarted) and generation is not resumed."""
        if join is not None:
            await self._unless_stuck("wsync_join", (*join, timeout_s), timeout_s, 4 * timeout_s)
        bound = timeout_s * (4 + len(plan.buckets))
        return await self._unless_stuck(
            method, (plan, timeout_s, *args), timeout_s, bound, self.progress
        )

    async def _unless_stuck(
        self,
        method: str,
        args: tuple[Any, ...],
        timeout_s: float,
        bound_s: float,
        progress: ProgressWatch | None = None,
    ) -> Any:
        """The workers' ``method``, counting the engine dead once a worker is stuck in it."""
        call = self.llm.collective_rpc(method, args=args)
        try:
            return await unless_stuck(call, timeout_s, bound_s, progress)
        except WorkerStuck as e:
            self.stuck = f"the workers' {method} {e}: a worker is stuck in it"
            raise RuntimeError(self.stuck) from None

    async def _resume(self) -> None:
        try:
            await self.llm.resume_generation()
        finally:  # a resume that fails must not hold generate or deadlines for good
            self._resumed.set()
            self._pause_ends()

    def _pause_begins(self, at: float) -> None:
        if self._paused_since is None:  # partly loaded weights: still the pause before
            self._paused_since = at

    def _pause_ends(self) -> None:
        self._paused_total = self.paused_s()
        self._paused_since = None

    def paused_s(self) -> float:
        """Seconds generation has been paused for weight syncs so far (a full-weight sync's
        pause, an adapter's receive), the pause in progress included, and the hold of partly
        loaded weights until a whole load: what an agent episode's deadline does not
        count."""
        since = self._paused_since
        return self._paused_total + (time.monotonic() - since if since is not None else 0.0)

    async def _leave_group(self, bound_s: float) -> None:
        """After a failed sync the workers abort their group (``wsync_leave``): under NCCL a
        broadcast still posted on it would otherwise wait for the watchdog, which may end
        the process. The next sync joins a new group anyway. Bounded; best effort."""
        try:
            await asyncio.wait_for(self.llm.collective_rpc("wsync_leave"), bound_s)
        except Exception as e:  # the engine's own failure shows in the next call
            log.debug("leaving the failed sync group: %s", e)

    async def reach(self, version: int, timeout_s: float) -> float:
        """Wait until this engine has loaded ``version``, a sync ends without it, or
        ``timeout_s`` passes; the seconds waited (0 when it holds ``version`` already).

        A task dealt after the learner sent new weights carries their version
        (``Task.dealt_version``): the coordinator opened the admission window at the send,
        before this engine loaded them, so the task waits here rather than start its group
        under the weights before. A sync of ``version`` (or later) that fails ends the
        wait: the group is then generated under the old weights, and the buffer's lag rule
        judges it."""
        if self.version >= version:
            return 0.0
        start = time.monotonic()
        async with self._synced:
            with contextlib.suppress(asyncio.TimeoutError):  # TimeoutError from 3.11 on
                await asyncio.wait_for(
                    # A sync of an older version ending (a catch-up, a push before) does
                    # not end it: that would start the group under weights it was not
                    # dealt for.
                    self._synced.wait_for(
                        lambda: max(self.version, self._synced_through) >= version
                    ),
                    timeout_s,
                )
        return time.monotonic() - start

    async def _sync_full(
        self, version: int, plan: WeightPlan, *, join: SyncJoin | None, timeout_s: float
    ) -> dict[str, float]:
        """:meth:`sync_weights` of the full weights: the engines pause."""
        start = time.monotonic()
        marks: list[float] = []  # paused, received, labelled, resumed
        try:
            # Inside the try: a pause that fails must still resume (the finally), or every
            # generate of the abort mode would wait for _resumed for good.
            self._pause_begins(start)
            if self.sync_mode == "abort":
                self._resumed.clear()
                self._aborts += 1
            # keep: freeze requests and drop their KV cache so they recompute under new
            # weights.
            await self.llm.pause_generation(mode=self.sync_mode, clear_cache=True)
            marks.append(time.monotonic())
            stats = await self._receive(plan, join, timeout_s, "wsync_receive")
            marks.append(time.monotonic())
            await self.llm.reset_prefix_cache()
            await self.llm.update_weight_version(str(version))
            self.version = version
            self.partial = False
            marks.append(time.monotonic())
        except Exception as e:
            # A broadcast that broke off after its first bucket left some layers new and
            # some old: nothing may run on them. Generation stays paused (requests frozen,
            # or waiting to re-submit) until a catch-up loads the weights whole.
            if PARTLY_LOADED in str(e) and not self.partial:
                self.partial = True
                log.warning("weights partly loaded: generation held until a catch-up")
            raise
        finally:
            try:
                if not (self.partial or self.stuck):
                    await self._resume()
            finally:  # counted however the resume went
                marks.append(time.monotonic())
                paused = marks[-1] - start
                # The pause clock: a hold on partly loaded weights is between two attempts
                self.metrics["rollout/sync_pause_s"] = self.paused_s()
        steps = " ".join(f"{b - a:.3f}" for a, b in zip([start, *marks], marks, strict=False))
        log.info(
            "weights of version %d loaded in %.3fs (%s mode; pause/receive/label/resume %s)",
            version,
            paused,
            self.sync_mode,
            steps,
        )
        return {"seconds": paused, **(stats[0] if stats else {})}

    async def _sync_adapter(
        self, version: int, plan: WeightPlan, *, join: SyncJoin | None, timeout_s: float
    ) -> dict[str, float]:
        """:meth:`sync_weights` of a pushed LoRA adapter: requests are not paused (no KV
        cache dropped). The workers receive the broadcast and write the adapter's files,
        vLLM loads it, new requests take it; requests in flight finish on the adapter they
        started with, those on one that falls out of the newest kept on the new one. The receive is a call into the engine, run between its steps: the
        engine steps no request while it lasts."""
        assert self.adapters is not None
        start = time.monotonic()
        path = str(self.adapters.path_for(version))
        rank, alpha = self.adapters.rank, self.adapters.alpha
        self._pause_begins(start)  # the engine steps no request during the receive
        try:
            stats = await self._receive(
                plan, join, timeout_s, "wsync_receive_adapter", path, rank, alpha
            )
        finally:
            if not self.stuck:
                self._pause_ends()
            # Generation stood still: counted as the run summary's sync pause, as a full one
            self.metrics["rollout/sync_pause_s"] = self.paused_s()
        received = time.monotonic()
        await self.adapters.activate(self.llm, version)
        await self.llm.update_weight_version(str(version))
        self.version = version
        took = time.monotonic() - start
        log.info(
            "adapter of version %d loaded in %.3fs (receive %.3f, load %.3f; adapters held: "
            "versions %s)",
            version,
            took,
            received - start,
            took - (received - start),
            self.adapters.versions,
        )
        return {"seconds": took, **(stats[0] if stats else {})}


def _piece(final: Any, request_id: str) -> tuple[Any, list[int], list[float]]:
    """A finished request's output (vLLM's last ``RequestOutput``, None if it gave none),
    its sampled token ids and their behaviour logprobs (NaN where vLLM gave none)."""
    if final is None:
        raise RuntimeError(f"vLLM returned no output for request {request_id}")
    done = final.outputs[0]
    ids = list(done.token_ids)
    positions = done.logprobs if done.logprobs is not None else [None] * len(ids)
    return done, ids, [sampled_logprob(d, t) for d, t in zip(positions, ids, strict=True)]


def _refuse_cut_short(finish_reason: str | None, request_id: str) -> None:
    """A response vLLM aborted (not by a sync of ours) or ended in error is not a sample:
    scored and trained, its cut text would teach the policy as if it had stopped there.
    Raised, it fails its group, which the coordinator deals again."""
    if finish_reason in ("abort", "error"):
        raise RuntimeError(
            f"vLLM ended request {request_id} with finish_reason {finish_reason!r} (not a "
            "weight sync's abort): its group fails and is dealt again"
        )
