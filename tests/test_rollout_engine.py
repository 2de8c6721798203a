"""The rollout engine on the real CPU vLLM: pushed weights are what it samples from, and a
request that spans a push carries tokens of both versions, each with the behaviour
logprobs of the weights that produced it (``keep`` and ``abort`` modes)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import LoopThread
from tests.standins.weights import EngineSender

TEMPERATURE = 0.7
PROMPT = [258, 84, 82, 68, 81, 198, 18, 10, 20, 28, 256, 198, 258, 64]  # a chat prompt


class Learner(EngineSender):
    """Reference sender of HF models' weights."""

    def push(self, loop, engine, model, version):  # type: ignore[override]
        tensors = {n: p.detach() for n, p in model.named_parameters()}
        return super().push(loop, engine, tensors, version)


def _perturbed(path, seed, scale=0.05):
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def _hf_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _gap_per_version(sample, models):
    """Max |vLLM - HF| over each version's tokens, HF run with that version's weights."""
    gaps, start = {}, 0
    for version, n in sample.version_spans:
        hf = _hf_logprobs(models[version], PROMPT, sample.token_ids)[start : start + n]
        vl = torch.tensor(sample.logprobs[start : start + n])
        gaps[version] = max(gaps.get(version, 0.0), (vl - hf).abs().max().item())
        start += n
    assert start == len(sample.token_ids)
    return gaps


@pytest.fixture(scope="module", params=["async", "inline"])
def rig(request, tiny_model):
    """The engine as ``AsyncLLM`` (engine core in a child process) and inline (the engine
    core stepped by a thread of this process, :mod:`rollout_servers.inline_llm`)."""
    from rollout_servers.engine import RolloutEngine
    from rollout_servers.engine_config import engine_args

    loop = LoopThread()
    args = engine_args(str(tiny_model), max_model_len=512)
    engine = loop.run(RolloutEngine.start(args, inline=request.param == "inline"))
    models = {0: AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)}
    yield loop, engine, Learner(), models, tiny_model
    engine.shutdown()


def _params(max_tokens, seed, ignore_eos=False):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=-1,
        max_tokens=max_tokens,
        logprobs=0,
        seed=seed,
        ignore_eos=ignore_eos,
    )


def _generate_many(loop, engine, n, max_tokens, ignore_eos=False, tag="r"):
    async def run():
        return await asyncio.gather(
            *[
                engine.generate(PROMPT, _params(max_tokens, seed, ignore_eos), f"{tag}-{seed}")
                for seed in range(n)
            ]
        )

    return loop.run(run())


@pytest.mark.slow  # starts a vLLM engine
def test_pushed_weights_are_sampled_from(rig):
    loop, engine, learner, models, path = rig
    models[1] = _perturbed(path, seed=1)
    before = _generate_many(loop, engine, 8, 12, tag="before")
    # Before the push, vLLM samples from version 0: materially different from version 1.
    gap_to_new = max(
        (torch.tensor(s.logprobs) - _hf_logprobs(models[1], PROMPT, s.token_ids)).abs().max().item()
        for s in before
    )
    assert gap_to_new > 0.1
    assert all(s.version_spans == [(0, len(s.token_ids))] for s in before)
    learner.push(loop, engine, models[1], version=1)
    after = _generate_many(loop, engine, 8, 12, tag="after")
    for s in after:
        assert s.version_spans == [(1, len(s.token_ids))]
        assert _gap_per_version(s, models)[1] < 1e-4


def _long_requests(engine, requests: dict[int, str]) -> list[asyncio.Future]:
    """One 480-token request per ``{seed: request_id}``, started."""
    return [
        asyncio.ensure_future(
            engine.generate(PROMPT, _params(480, seed, ignore_eos=True), request_id)
        )
        for seed, request_id in requests.items()
    ]


async def _until(done, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


def _start_sampling(loop, engine, requests: dict[int, str]) -> list[asyncio.Future]:
    """Start one 480-token request per ``{seed: request_id}`` and return once vLLM has
    produced a first output for every one of them, none finished: a push now lands mid-way.
    (No fixed sleep: a slow machine would push before they start, a fast one after they end.)
    """
    if hasattr(engine.llm, "steps"):  # inline: only final outputs; count engine steps
        return _start_sampling_inline(loop, engine, requests)
    sampling: set[str] = set()  # requests vLLM has produced a first output for
    real_generate = engine.llm.generate

    def spied_generate(prompt, params, request_id):
        async def outputs():
            async for out in real_generate(prompt, params, request_id=request_id):
                sampling.add(request_id)
                yield out

        return outputs()

    async def spanning():
        tasks = _long_requests(engine, requests)
        await _until(lambda: len(sampling) >= len(tasks))
        return tasks

    engine.llm.generate = spied_generate
    try:
        tasks = loop.run(spanning())
    finally:
        engine.llm.generate = real_generate
    assert len(sampling) == len(requests), f"only {sorted(sampling)} sampled within 60 s"
    assert not any(t.done() for t in tasks), "requests finished before the push; lengthen them"
    return tasks


def _start_sampling_inline(loop, engine, requests: dict[int, str]) -> list[asyncio.Future]:
    """:func:`_start_sampling` on the inline engine: it yields final outputs only, so wait
    until every request is in flight and the engine has stepped twice since (its commands,
    the requests' admission among them, run before each step)."""

    async def spanning():
        tasks = _long_requests(engine, requests)
        await _until(lambda: engine.llm.in_flight >= len(tasks))
        steps = engine.llm.steps
        await _until(lambda: engine.llm.steps >= steps + 2)
        return tasks

    tasks = loop.run(spanning())
    assert engine.llm.in_flight == len(requests), "requests did not start within 60 s"
    assert not any(t.done() for t in tasks), "requests finished before the push; lengthen them"
    return tasks


def _skip_abort_inline(engine) -> None:
    if hasattr(engine.llm, "steps"):
        pytest.skip("the inline engine pauses in keep mode only (config refuses abort)")


@pytest.mark.slow  # starts a vLLM engine
@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_request_spanning_a_push_carries_both_versions(rig, mode):
    loop, engine, learner, models, path = rig
    if mode == "abort":
        _skip_abort_inline(engine)
    engine.sync_mode = mode
    old = engine.version
    new = old + 1
    models[new] = _perturbed(path, seed=10 + new)

    tasks = _start_sampling(loop, engine, {seed: f"{mode}-{seed}" for seed in range(6)})
    learner.push(loop, engine, models[new], version=new)

    async def finish():
        return await asyncio.gather(*tasks)

    samples = loop.run(finish())
    for s in samples:
        assert len(s.token_ids) == 480 and len(s.logprobs) == 480
        assert [v for v, _ in s.version_spans] == [old, new], s.version_spans
        gaps = _gap_per_version(s, models)
        assert gaps[old] < 1e-4 and gaps[new] < 1e-4, gaps
    if mode == "abort":
        assert all(s.resubmissions == 1 for s in samples)


def test_resubmitted_pieces_draw_fresh_deterministic_seeds():
    """vLLM seeds a fresh generator per request: a piece re-submitted with the request's
    seed would replay the first piece's random draws, so its tokens would not be sampled
    the way their behaviour logprobs say. Each piece gets its own seed, derived from the
    request's seed and the piece number (reproducible runs stay reproducible)."""
    from vllm import SamplingParams

    from rollout_servers.samples import piece_params

    params = SamplingParams(temperature=TEMPERATURE, max_tokens=480, logprobs=0, seed=123)
    pieces = [piece_params(params, piece, 480 - 10 * piece) for piece in range(4)]
    assert pieces[0].seed == 123  # an uninterrupted request samples as it always did
    assert len({p.seed for p in pieces}) == 4
    assert [p.seed for p in pieces] == [piece_params(params, k, 1).seed for k in range(4)]
    assert all(p.seed is not None and 0 <= p.seed < 2**31 for p in pieces)
    assert [p.max_tokens for p in pieces] == [480, 470, 460, 450]
    assert all(p.temperature == TEMPERATURE and p.logprobs == 0 for p in pieces)
    assert params.seed == 123 and params.max_tokens == 480  # the caller's are left alone
    # Other requests' pieces differ too; unseeded requests stay unseeded.
    other = SamplingParams(temperature=TEMPERATURE, max_tokens=480, logprobs=0, seed=124)
    assert piece_params(other, 1, 470).seed not in {p.seed for p in pieces}
    unseeded = SamplingParams(temperature=TEMPERATURE, max_tokens=480, logprobs=0)
    assert piece_params(unseeded, 2, 460).seed is None


@pytest.mark.slow  # starts a vLLM engine
def test_abort_resubmission_samples_with_the_piece_seed(rig):
    """On the real engine: the piece re-submitted after an abort-mode push is exactly what a
    fresh request for the prompt plus the first piece's tokens, under the new weights, gives
    with the piece's derived seed, and not what the request's own seed gives (that stream
    already drew the first piece's tokens)."""
    from rollout_servers.samples import piece_params

    loop, engine, learner, models, path = rig
    _skip_abort_inline(engine)
    engine.sync_mode = "abort"
    old = engine.version
    new = old + 1
    models[new] = _perturbed(path, seed=10 + new)
    seeds = (1000, 1001, 1002, 1003)

    tasks = _start_sampling(loop, engine, {s: f"piece-{s}" for s in seeds})
    learner.push(loop, engine, models[new], version=new)

    async def finish():
        return await asyncio.gather(*tasks)

    samples = loop.run(finish())

    async def replay(seed, prefix, derived):
        params = _params(480 - len(prefix), seed, ignore_eos=True)
        if derived:
            params = piece_params(params, 1, 480 - len(prefix))
        return await engine.generate(PROMPT + prefix, params, f"replay-{seed}-{derived}")

    for seed, s in zip(seeds, samples, strict=True):
        assert s.resubmissions == 1 and s.version_spans[-1][0] == new, s.version_spans
        first = s.version_spans[0][1] if s.version_spans[0][0] == old else 0
        prefix, second = s.token_ids[:first], s.token_ids[first:]
        # The whole second piece: one replayed stream shows wherever the model is unsure.
        assert loop.run(replay(seed, prefix, derived=True)).token_ids == second
        assert loop.run(replay(seed, prefix, derived=False)).token_ids != second


@pytest.mark.slow  # starts a vLLM engine
def test_the_post_sync_probe_scores_the_weights_loaded_last(rig):
    """``score`` (what a server reports after a sync) is the teacher-forced logprobs of the
    probe under the weights pushed last, as the learner computes them (1e-4), and far from
    those of the weights before: a push that did not arrive would show."""
    from asyncrl.sync.probe import probe_ids

    loop, engine, learner, models, path = rig
    new = max(models) + 1
    models[new] = _perturbed(path, seed=new)
    learner.push(loop, engine, models[new], version=new)
    got = torch.tensor(loop.run(engine.score(probe_ids())))

    def hf(model) -> torch.Tensor:
        out = []
        for ids in probe_ids():
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            logp = torch.log_softmax(logits, dim=-1)
            out.append(logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
        return torch.cat(out)

    assert (got - hf(models[new])).abs().max() < 1e-4
    assert (got - hf(models[new - 1])).abs().mean() > 0.01


@pytest.mark.slow  # starts a vLLM engine
def test_a_push_broken_off_mid_load_holds_generation_until_a_whole_load(rig):
    """A push of several buckets whose sender stops after the first (a member died, the
    learner's send failed): the engine's weights are part new, part old. It holds
    generation (a request waits rather than sample from mixed weights) until the catch-up
    (a new group, as the server's catch-up forms one) loads them whole; then it samples
    from the caught-up weights exactly. Last in the module: it leaves the engine in another
    sync group than the rig's sender."""
    import threading

    from asyncrl.sync.groups import form_group
    from asyncrl.sync.plan import WeightPlan, plan_buckets, specs_of
    from asyncrl.sync.weights import send_weights
    from rollout_servers.engine import SyncJoin
    from rollout_servers.worker_ext import PARTLY_LOADED

    loop, engine, _, models, path = rig
    broken, caught_up = max(models) + 1, max(models) + 2
    models[caught_up] = _perturbed(path, seed=caught_up)
    tensors = {n: p.detach() for n, p in models[caught_up].named_parameters()}
    plan = plan_buckets(specs_of(tensors), 1 << 16)  # small buckets: several of them
    assert len(plan.buckets) >= 3
    dying = EngineSender()  # the push's group; it sends the first bucket only

    def send_first_bucket() -> None:
        group = form_group(dying.store, "g1", 0, 2, timeout_s=10)
        send_weights(group, tensors, WeightPlan(plan.buckets[:1]), timeout_s=10)

    sender = threading.Thread(target=send_first_bucket)
    sender.start()
    join = SyncJoin("127.0.0.1", dying.port, "g1", 1, 2, "gloo")
    # (a plain Exception through AsyncLLM's RPC, the worker's RuntimeError inline)
    with pytest.raises(Exception, match=PARTLY_LOADED):  # noqa: B017, PT011
        loop.run(engine.sync_weights(broken, plan, join=join, timeout_s=3))
    sender.join(10)
    assert engine.partial and engine.version < broken
    with pytest.raises(TimeoutError):  # held: nothing samples from the mixed weights
        loop.run(asyncio.wait_for(engine.generate(PROMPT, _params(4, 0), "held"), 2.0))
    Learner().push(loop, engine, models[caught_up], version=caught_up)  # a new group
    assert not engine.partial and engine.version == caught_up
    after = _generate_many(loop, engine, 4, 12, tag="caught-up")
    for s in after:
        assert s.version_spans == [(caught_up, len(s.token_ids))]
        assert _gap_per_version(s, models)[caught_up] < 1e-4


@pytest.mark.slow  # starts a vLLM engine
def test_an_aborted_request_ends_with_its_tokens_so_far(rig):
    """Found by a review: the inline engine (the CPU default) had no ``abort``, so a move
    off a stale adapter (LoRA pushes, rollout_servers/adapters.py) failed the push. Both
    engines end an aborted request with the tokens and logprobs it sampled so far and
    ``finish_reason`` ``abort``, the output the move goes on from."""
    loop, engine, *_ = rig
    llm = engine.llm
    outs: list = []

    async def run() -> None:
        async def consume() -> None:
            prompt = {"prompt_token_ids": PROMPT}
            params = _params(480, 7, ignore_eos=True)
            async for out in llm.generate(prompt, params, request_id="aborted"):
                outs.append(out)

        task = asyncio.ensure_future(consume())
        if hasattr(llm, "steps"):  # inline: only the final output comes
            await _until(lambda: llm.in_flight >= 1)
            steps = llm.steps
            await _until(lambda: llm.steps >= steps + 4)
        else:
            await _until(lambda: bool(outs))
        assert not task.done(), "the request finished before the abort; lengthen it"
        await llm.abort(["aborted"])
        await asyncio.wait_for(task, 30)

    loop.run(run())
    final = outs[-1].outputs[0]
    assert final.finish_reason == "abort"
    assert 0 < len(final.token_ids) < 480
    assert final.logprobs is not None and len(final.logprobs) == len(final.token_ids)
