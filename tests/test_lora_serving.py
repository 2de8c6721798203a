"""Pushed LoRA adapters on the real CPU vLLM (``sync.lora: adapter``): the learner's adapter
tensors travel over a real gloo group, the engine serves each version as a vLLM adapter, its
logprobs equal the learner's merged weights' (1e-4) for successive versions, a request that
started on an older adapter finishes on it, and old adapters are released."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config import load_config
from learner import lora
from learner.fsdp import full_state
from learner.trainer import Trainer
from rollout_servers.adapters import AdapterVersions, engine_lora_rank
from tests.helpers import LoopThread
from tests.standins.weights import EngineSender
from tests.test_checkpoint import BATCHES

TEMPERATURE = 0.7
PROMPT = [258, 84, 82, 68, 81, 198, 18, 10, 20, 28, 256, 198, 258, 64]
RANK, ALPHA = 4, 8


@pytest.fixture(scope="module")
def rig(tiny_model, single_rank, tmp_path_factory):
    from rollout_servers.engine import RolloutEngine
    from rollout_servers.engine_config import engine_args

    cfg = load_config(
        None,
        [
            f"model.path={tiny_model}",
            "actor.ppo_mini_batch_size=1",
            "actor.optim.lr=3e-2",
            f"model.lora_rank={RANK}",
            f"model.lora_alpha={ALPHA}",
        ],
    )
    trainer = Trainer(cfg)
    adapters = AdapterVersions(tmp_path_factory.mktemp("adapters"), keep=2, rank=RANK, alpha=ALPHA)
    args = engine_args(
        str(tiny_model), max_model_len=512, max_lora_rank=engine_lora_rank(RANK), max_loras=3
    )
    loop = LoopThread()
    engine = loop.run(RolloutEngine.start(args, adapters=adapters))
    yield loop, engine, trainer, EngineSender(), tiny_model
    engine.shutdown()


def merged_model(trainer, path):
    """An HF model holding the trainer's weights with its adapters merged (float32)."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.load_state_dict(lora.merged(full_state(trainer.model), ALPHA / RANK), strict=False)
    return model


def hf_logprobs(model, tokens):
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1]
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def params(max_tokens, seed):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=TEMPERATURE, max_tokens=max_tokens, logprobs=0, seed=seed, ignore_eos=True
    )


def start_requests(loop, engine, seeds, max_tokens, tag):
    """Start one request per seed; return once vLLM has produced output for each (none
    finished), so a push now lands while they run."""
    sampling: set[str] = set()
    real = engine.llm.generate

    def spied(prompt, sp, request_id, **kw):
        async def outputs():
            async for out in real(prompt, sp, request_id=request_id, **kw):
                sampling.add(request_id)
                yield out

        return outputs()

    async def start():
        tasks = [
            asyncio.ensure_future(engine.generate(PROMPT, params(max_tokens, s), f"{tag}-{s}"))
            for s in seeds
        ]
        deadline = time.monotonic() + 60
        while len(sampling) < len(tasks) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return tasks

    engine.llm.generate = spied
    try:
        tasks = loop.run(start())
    finally:
        engine.llm.generate = real
    assert len(sampling) == len(seeds), f"only {sorted(sampling)} sampled within 60 s"
    assert not any(t.done() for t in tasks), "requests finished before the push; lengthen them"
    return tasks


def gather(loop, tasks):
    async def finish():
        return await asyncio.gather(*tasks)

    return loop.run(finish())


@pytest.mark.slow  # starts a vLLM engine with LoRA
def test_pushed_adapters_serve_the_learner_s_policy_version_by_version(rig):
    loop, engine, trainer, pusher, path = rig
    trainer.train_step(BATCHES[0], TEMPERATURE)
    v1 = trainer.full_state_for_push()
    assert v1 and all(lora.is_adapter_key(k) for k in v1)  # the adapter alone travels
    stats = pusher.push(loop, engine, v1, version=1)
    assert stats["tensors"] == len(v1)
    # The receive stalls the engine's steps: counted as a sync pause (it read 0)
    assert engine.metrics["rollout/sync_pause_s"] > 0
    models = {1: merged_model(trainer, path)}

    # Long requests on version 1, then version 2 is pushed while they run.
    old = start_requests(loop, engine, range(4), max_tokens=400, tag="v1")
    trainer.train_step(BATCHES[1], TEMPERATURE)
    pusher.push(loop, engine, trainer.full_state_for_push(), version=2)
    assert not any(t.done() for t in old), "the version-1 requests ended before the push"
    models[2] = merged_model(trainer, path)
    new = gather(loop, [engine.generate(PROMPT, params(24, s), f"v2-{s}") for s in range(4)])
    old = gather(loop, old)

    for version, samples in ((1, old), (2, new)):
        for s in samples:
            assert s.version_spans == [(version, len(s.token_ids))], s.version_spans
            gap = (torch.tensor(s.logprobs) - hf_logprobs(models[version], s.token_ids)).abs()
            assert gap.max().item() < 1e-4, (version, gap.max().item())
    # The two versions are different policies, so the check above could fail.
    s = new[0]
    assert (
        hf_logprobs(models[1], s.token_ids) - hf_logprobs(models[2], s.token_ids)
    ).abs().max() > 1e-3

    # The post-sync probe scores under the current adapter.
    probe = loop.run(engine.score([PROMPT + new[0].token_ids[:8]]))
    ids = torch.tensor([PROMPT + new[0].token_ids[:8]])
    with torch.no_grad():
        logp = models[2](input_ids=ids).logits[0, :-1].log_softmax(-1)
    expected = logp.gather(-1, ids[0, 1:, None])[:, 0]
    assert (torch.tensor(probe) - expected).abs().max().item() < 1e-4

    # keep=2: version 1 goes once nobody samples from it and two newer ones exist.
    trainer.train_step(BATCHES[2], TEMPERATURE)
    pusher.push(loop, engine, trainer.full_state_for_push(), version=3)
    assert engine.adapters.versions == [2, 3]


@pytest.mark.slow  # starts a vLLM engine with LoRA
def test_requests_on_an_adapter_past_the_kept_ones_move_and_free_the_batch(rig):
    """Found by a review: a request kept its adapter however many pushes came after it.
    With requests still on three versions (vLLM's ``max_loras`` here), a new version's
    requests, and the post-sync probe, waited until they ended, for groups too stale to
    train. Those past the ``keep`` newest now go on on the current adapter."""
    loop, engine, trainer, pusher, path = rig
    state = trainer.full_state_for_push()
    first = (engine.adapters.version or 0) + 1
    running, moved_before = {}, engine.metrics["rollout/moved_off_stale_adapters"]
    for v in range(first, first + 3):  # long requests on three successive versions
        pusher.push(loop, engine, state, version=v)
        running[v] = start_requests(loop, engine, range(6), max_tokens=480, tag=f"m{v}")
    pusher.push(loop, engine, state, version=first + 3)
    short = gather(loop, [engine.generate(PROMPT, params(8, 0), f"m{first + 3}-short")])
    assert short[0].version_spans == [(first + 3, 8)]
    # The oldest requests still ran: without the move, the short one waited for them.
    assert not all(t.done() for t in running[first]), "the short request waited for the oldest"
    done = {v: gather(loop, tasks) for v, tasks in running.items()}
    # Each request past the kept versions went on where it stopped: 480 tokens, its first
    # piece under its own version, the rest under the current one; the kept ones stayed.
    for v in (first, first + 1):
        for s in done[v]:
            assert len(s.token_ids) == 480 and s.version_spans[0][0] == v, s.version_spans
            assert len(s.version_spans) > 1 and s.resubmissions >= 1, s.version_spans
    assert all(s.version_spans == [(first + 2, 480)] for s in done[first + 2])
    assert engine.metrics["rollout/moved_off_stale_adapters"] - moved_before == 12


def test_a_restarted_server_empties_its_adapter_folder(tmp_path):
    """A server killed uncleanly leaves its pushed adapters behind; its restart (the same
    server id in the same run) empties that folder instead of taking a new one, and
    another server or run has its own."""
    import shutil
    from pathlib import Path

    from rollout_servers.main import adapter_folder

    cfg = load_config(None, [f"trainer.default_local_dir={tmp_path}"])
    other_run = load_config(None, [f"trainer.default_local_dir={tmp_path / 'b'}"])
    folders = [
        Path(adapter_folder(c, sid))
        for c, sid in ((cfg, "rollout-0"), (cfg, "rollout-1"), (other_run, "rollout-0"))
    ]
    try:
        assert len(set(folders)) == 3
        (folders[0] / "v3").mkdir()
        (folders[0] / "v3" / "adapter_model.safetensors").write_bytes(b"x" * 1024)
        assert Path(adapter_folder(cfg, "rollout-0")) == folders[0]  # the restart's
        assert list(folders[0].iterdir()) == []
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
