"""The FSDP2 trainer on the tiny model: 2 ranks match 1 rank, pushed weights are the trained
ones, non-finite updates are skipped, and the importance weights against the real CPU vLLM
are 1 at lag 0 and not 1 at lag 1."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from asyncrl.config import Config, load_config
from learner import fsdp
from learner.rollouts import Rollout
from learner.trainer import Trainer
from tests.helpers import free_port, join_ranks, leave_ranks, rank_env, start_ranks
from tests.trainer_helpers import (
    assert_gradients_match,
    float32_tolerance,
    record_gradients,
    synthetic_batch,
)

log = logging.getLogger(__name__)
TEMPERATURE = 0.7


def make_cfg(model_dir, **actor) -> Config:
    """Small batches: 4 groups of 4 per step, 2 groups per mini-batch, micro-batches of at
    most 48 tokens, KL to the reference and an entropy bonus on (every path in play)."""
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            "data.max_response_length=12",
            "actor.ppo_mini_batch_size=2",
            "actor.ppo_max_token_len_per_gpu=48",
            "actor.use_kl_loss=true",
            "actor.kl_loss_coef=0.01",
            "actor.entropy_coeff=0.001",
            *(f"actor.{k}={v}" for k, v in actor.items()),
        ],
    )


BATCHES = [synthetic_batch(s) for s in range(3)]


def assert_shards_are_slices_of(model, full: dict[str, torch.Tensor]) -> None:
    """Each rank's shard equals its chunk of the gathered full tensor (FSDP2: Shard(0))."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, p in model.named_parameters():
        dim = p.placements[0].dim
        chunks = torch.chunk(full[name], world, dim=dim)
        expected = chunks[rank] if rank < len(chunks) else full[name].narrow(dim, 0, 0)
        local = p.to_local()
        assert torch.equal(local.narrow(dim, 0, expected.shape[dim]), expected), name


def _fsdp_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    trainer = Trainer(make_cfg(model_dir))
    grads = record_gradients(trainer)
    # Every rank builds the same seeded batches (the learner loop shares rank 0's batch
    # with learner.broadcast.share_batch).
    losses = [trainer.train_step(b, TEMPERATURE)["loss/total"] for b in BATCHES]
    pushed = trainer.full_state_for_push()
    full = fsdp.full_state(trainer.model)  # every rank keeps it: for the shard check
    assert_shards_are_slices_of(trainer.model, full)
    # Only rank 0 pushes: the other ranks join each gather and keep nothing of it.
    assert set(pushed) == (set(full) if rank == 0 else set()), rank
    trainer.save(Path(out_dir) / "run")
    if rank == 0:
        result = {"losses": losses, "state": pushed, "first_grads": grads[0]}
        torch.save(result, Path(out_dir) / "result.pt")
    leave_ranks()


def _first_update_worker(
    rank: int, world: int, port: int, model_dir: str, out_dir: str, mode: str
) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    trainer = Trainer(make_cfg(model_dir, loss_agg_mode=mode))
    grads = record_gradients(trainer)
    trainer.train_step(BATCHES[0], TEMPERATURE)
    if rank == 0:
        torch.save(grads[0], Path(out_dir) / "first_grads.pt")
    leave_ranks()


@pytest.mark.parametrize(
    "mode", ["seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_every_aggregation_mode_gives_two_ranks_the_gradient_of_one(
    tiny_model, single_rank, tmp_path, mode
):
    """The first update's gradient of a global mini-batch, with its dropped rows, NaN
    behaviour token and micro-batches of unequal token counts, does not depend on how
    many ranks hold it, for every veRL aggregation (the test above checks token-mean):
    each mode's normaliser is the mini-batch's, not a rank's or a micro-batch's."""
    ctx = start_ranks(_first_update_worker, 2, free_port(), str(tiny_model), str(tmp_path), mode)
    one = Trainer(make_cfg(tiny_model, loss_agg_mode=mode))
    grads = record_gradients(one)
    one.train_step(BATCHES[0], TEMPERATURE)
    join_ranks(ctx)
    two = torch.load(tmp_path / "first_grads.pt")
    assert_gradients_match(two, grads[0], float32_tolerance(one, BATCHES[0]))


def test_two_ranks_match_one_rank(tiny_model, single_rank, tmp_path):
    ctx = start_ranks(_fsdp_worker, 2, free_port(), str(tiny_model), str(tmp_path))
    # Meanwhile, the same global batches on one rank in this process.
    one = Trainer(make_cfg(tiny_model))
    grads = record_gradients(one)
    initial = one.full_state_for_push()
    metrics = [one.train_step(b, TEMPERATURE) for b in BATCHES]
    final = one.full_state_for_push()
    assert_shards_are_slices_of(one.model, final)
    join_ranks(ctx)
    two = torch.load(tmp_path / "result.pt")

    for m in metrics:
        assert m["batch/dropped_length_mismatch"] == 1
        assert m["importance/nonfinite_dropped"] == 1
        assert m["actor/updates"] == 2 and m["actor/skipped_updates"] == 0
    moved = max((final[k] - initial[k]).abs().max().item() for k in final)
    diff = max((final[k] - two["state"][k]).abs().max().item() for k in final)
    log.info("FSDP 1 vs 2 ranks: weights moved %.3g, max diff %.3g", moved, diff)
    assert moved > 1e-3
    # The final weights, after 6 updates: Adam turns rounding in near-zero gradients into
    # moves of up to lr per update (see record_gradients), so a few elements may differ by
    # that much; but only a few. A real difference between the two (a rank's data left out,
    # a wrong reduction) moves most elements apart.
    lr, updates = one.cfg.actor.optim.lr, sum(m["actor/updates"] for m in metrics)
    total = sum(v.numel() for v in final.values())
    apart = sum(int(((final[k] - two["state"][k]).abs() > 0.01 * lr).sum()) for k in final)
    log.info("elements apart by more than lr/100: %d of %d (lr %g)", apart, total, lr)
    assert diff <= 2 * lr * updates
    assert apart <= 0.01 * total, f"{apart} of {total} weights differ by more than lr/100"
    # The first update starts from the same weights on both: its gradient of the global
    # mini-batch must not depend on which rank holds which sequences. (Later weights differ
    # by what Adam made of the rounding, see record_gradients, so they are not compared.)
    assert_gradients_match(two["first_grads"], grads[0], float32_tolerance(one, BATCHES[0]))
    # The losses move with the weights only at first order in those differences, which sit
    # where the gradient is near zero: far inside this loose bound.
    torch.testing.assert_close(
        two["losses"], [m["loss/total"] for m in metrics], rtol=1e-4, atol=1e-6
    )

    # The 2-rank checkpoint loads on 1 rank (DCP re-shards) with the same weights.
    resumed = Trainer(make_cfg(tiny_model))
    resumed.load(tmp_path / "run" / "checkpoints" / "step_3")
    assert resumed.step == 3
    for k, v in resumed.full_state_for_push().items():
        assert torch.equal(v, two["state"][k]), k


def test_pushed_weights_load_into_transformers(tiny_model, single_rank):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(make_cfg(tiny_model))
    trainer.train_step(BATCHES[0], TEMPERATURE)
    pushed = trainer.full_state_for_push()
    assert "lm_head.weight" not in pushed  # tied: sent once, as in the HF checkpoint
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(pushed, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    batch = BATCHES[1][:4]
    ours = trainer.compute_logprobs(batch, TEMPERATURE)
    for r, lp in zip(batch, ours, strict=True):
        ids = torch.tensor([list(r.prompt_ids) + list(r.response_ids)])
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1] / TEMPERATURE
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response_ids)[:, None])
        torch.testing.assert_close(lp, ref[:, 0], atol=1e-5, rtol=0)


def test_non_finite_loss_skips_the_update(tiny_model, single_rank, monkeypatch):
    import learner.trainer as trainer_mod

    trainer = Trainer(make_cfg(tiny_model))
    before = {k: v.clone() for k, v in trainer.full_state_for_push().items()}
    real = trainer_mod.policy_loss

    def poisoned(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(trainer_mod, "policy_loss", poisoned)
    m = trainer.train_step(BATCHES[0], TEMPERATURE)
    assert m["actor/skipped_updates"] == 2 and trainer.step == 1
    assert "actor/grad_norm" not in m  # no applied update: no norm (a 0 read as vanished)
    after = trainer.full_state_for_push()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())
    monkeypatch.setattr(trainer_mod, "policy_loss", real)
    m = trainer.train_step(BATCHES[0], TEMPERATURE)
    assert m["actor/skipped_updates"] == 0 and m["actor/grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in trainer.full_state_for_push().items())


def test_use_kl_loss_at_coefficient_0_logs_the_drift(tiny_model, single_rank):
    """As in veRL, actor.use_kl_loss with kl_loss_coef=0 loads the reference and logs the
    KL to it (actor/ref_kl), which grows once the policy moves; it was a flat 0."""
    seen = {}
    for coef in (0.0, 0.01):  # one mini-batch a step: step 1 runs at the initial weights
        trainer = Trainer(make_cfg(tiny_model, kl_loss_coef=coef, ppo_mini_batch_size=4))
        assert trainer.ref_model is not None
        first = trainer.train_step(BATCHES[0], TEMPERATURE)
        seen[coef] = trainer.train_step(BATCHES[1], TEMPERATURE)["actor/ref_kl"]
        assert first["actor/ref_kl"] == pytest.approx(0.0, abs=1e-6)
    assert seen[0.0] > 1e-3, seen
    # The same quantity as with a penalty: k3's gradient is 0 where policy = reference, so
    # step 1 moves both runs alike (up to the reference pass's rounding, which Adam can turn
    # into +-lr on a parameter whose gradient is near 0).
    assert seen[0.0] == pytest.approx(seen[0.01], rel=1e-2), seen


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_pushed_weights_are_a_copy_that_later_steps_leave_alone(tiny_model, single_rank):
    """Reproduces defect 3 of the dependable-runs issue: on one rank in float32 (no cast,
    no gather) the full weights were the live parameters themselves, so the weights the
    learner keeps for catch-ups changed with every later step, and a catch-up sent newer
    weights under an older version."""
    from torch.distributed.tensor import DTensor

    from learner.fsdp import full_state

    trainer = Trainer(make_cfg(tiny_model))
    pushed = trainer.full_state_for_push()
    kept = {k: v.clone() for k, v in pushed.items()}
    for name, p in trainer.model.named_parameters():
        # Sharded (DTensor) or, after a forward without backward, the root's unsharded ones.
        local = p.to_local() if isinstance(p, DTensor) else p
        assert not _shares_storage(pushed[name], local), name
    trainer.train_step(BATCHES[0], TEMPERATURE)
    assert all(torch.equal(pushed[k], kept[k]) for k in kept)
    now = trainer.full_state_for_push()
    assert any(not torch.equal(now[k], kept[k]) for k in kept)  # the step did move them

    # A module that is not sharded at all: its parameters are plain tensors.
    plain = torch.nn.Linear(3, 2)
    for cast in (None, torch.float32, torch.bfloat16):
        for name, t in full_state(plain, cast).items():
            p = dict(plain.named_parameters())[name]
            assert not _shares_storage(t, p) and torch.equal(t, p.detach().to(t.dtype)), name


# ----------------------------------------------------------------- against real vLLM
class LoopThread:
    """An asyncio loop in a thread for the engine."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="module")
def vllm_rig(tiny_model, single_rank, tmp_path_factory):
    """A trainer at version 0 and a vLLM engine started from the trainer's HF export (which
    is thereby checked to load in vLLM)."""
    from learner.export import export_hf
    from rollout_servers.engine import RolloutEngine
    from rollout_servers.engine_config import engine_args

    trainer = Trainer(make_cfg(tiny_model, ppo_mini_batch_size=4, use_kl_loss=False))
    export = tmp_path_factory.mktemp("export") / "policy"
    export_hf(export, trainer.full_state_for_push(), tiny_model, step=0)
    loop = LoopThread()
    engine = loop.run(RolloutEngine.start(engine_args(str(export), max_model_len=256)))
    yield trainer, loop, engine, export
    engine.shutdown()  # frees the engine client too (RolloutEngine.shutdown)


def vllm_batch(loop, engine, export, seed: int) -> list[Rollout]:
    """4 prompts x 4 samples at temperature 0.7 (full distribution), as rollouts with a
    synthetic reward that varies within groups."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(export))
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": f"{a}+{b}="}],
                add_generation_prompt=True,
                tokenize=False,
            )
        )
        for a, b in [(3, 4), (1, 5), (6, 2), (8, 1)]
    ]

    async def run():
        jobs = []
        for p, prompt in enumerate(prompts):
            for k in range(4):
                params = SamplingParams(
                    temperature=TEMPERATURE,
                    top_p=1.0,
                    top_k=-1,
                    max_tokens=12,
                    logprobs=0,
                    ignore_eos=True,
                    seed=seed * 100 + p * 10 + k,
                )
                jobs.append(engine.generate(prompt, params, f"s{seed}-{p}-{k}"))
        return await asyncio.gather(*jobs)

    samples = loop.run(run())
    return [
        Rollout(
            prompts[i // 4],
            s.token_ids,
            s.logprobs,
            float(sum(s.token_ids) % 3) / 2,
            f"{seed}-{i // 4}",
            s.version_spans,
        )
        for i, s in enumerate(samples)
    ]


@pytest.mark.slow  # starts a vLLM engine
def test_importance_weights_against_vllm(vllm_rig):
    trainer, loop, engine, export = vllm_rig
    batch_a = vllm_batch(loop, engine, export, seed=1)
    batch_b = vllm_batch(loop, engine, export, seed=2)  # also generated by version 0

    # Lag 0: the trainer's logprobs of vLLM's tokens are vLLM's, temperature included.
    ours = trainer.compute_logprobs(batch_a, TEMPERATURE)
    err = max(
        (lp - torch.tensor(r.behaviour_logprobs)).abs().max().item()
        for r, lp in zip(batch_a, ours, strict=True)
    )
    m0 = trainer.train_step(batch_a, TEMPERATURE)  # the weights inside training agree too
    log.info(
        "lag 0: max |p - b| %.3g (in training %.3g), w max %.6f",
        err,
        m0["importance/log_w_abs_max"],
        m0["importance/w_max"],
    )
    assert err < 1e-4
    assert m0["importance/log_w_abs_max"] < 1e-4 and abs(m0["importance/w_max"] - 1) < 1e-4
    assert m0["lag/mean"] == 0 and m0["actor/updates"] == 1

    # Lag 1: one update later, the proximal logprobs are recomputed and differ from vLLM's.
    trainer.policy_version = 1
    m1 = trainer.train_step(batch_b, TEMPERATURE)
    log.info(
        "lag 1: mean |log w| %.3g, max %.3g",
        m1["importance/log_w_abs_mean"],
        m1["importance/log_w_abs_max"],
    )
    assert m1["lag/mean"] == 1
    assert m1["importance/log_w_abs_mean"] > 1e-3


def test_padded_input_and_checkpointing_match_packed(tiny_model, single_rank):
    """Both sequence layouts (padded rows, the CPU's choice, with gradient checkpointing;
    packed rows) give the same step: the same loss and the same gradients, within float32
    rounding (compared after an Adam step, the weights of one element differed by 1.9e-6 on
    an AMD EPYC machine, see record_gradients)."""
    # One mini-batch per step: the loss and the gradients are both taken at the same weights.
    assert not Trainer(make_cfg(tiny_model)).packed  # auto on CPU: SDPA, so padded rows
    packed = Trainer(make_cfg(tiny_model, ppo_mini_batch_size=4, sequence_layout="packed"))
    assert packed.packed  # Qwen2 on transformers takes packed sequences
    cfg = make_cfg(tiny_model, ppo_mini_batch_size=4, sequence_layout="padded")
    cfg.model.enable_gradient_checkpointing = True  # no cross-field rule involves it
    padded = Trainer(cfg)
    ga, gb = record_gradients(packed), record_gradients(padded)
    a = packed.train_step(BATCHES[0], TEMPERATURE)
    b = padded.train_step(BATCHES[0], TEMPERATURE)
    assert a["actor/updates"] == b["actor/updates"] == 1
    assert a["batch/pad_ratio"] == 1.0 and a["learner/packed"] == 1.0
    assert 1.0 < b["batch/pad_ratio"] < 2.0 and b["learner/packed"] == 0.0
    rel = float32_tolerance(packed, BATCHES[0])
    assert b["loss/total"] == pytest.approx(a["loss/total"], rel=rel)
    assert_gradients_match(gb[0], ga[0], rel)


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_trains_per_token_without_a_critic(tiny_model, single_rank, estimator):
    """REINFORCE++'s token advantages reach the loss: the step updates the policy and its
    advantage metrics are those of the whitened token advantages (mean 0 over tokens)."""
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model}",
            f"algorithm.adv_estimator={estimator}",
            "algorithm.gamma=0.95",
            "actor.ppo_mini_batch_size=4",
        ],
    )
    trainer = Trainer(cfg)
    assert trainer.critic is None
    before = {k: v.clone() for k, v in trainer.full_state_for_push().items()}
    metrics = trainer.train_step(BATCHES[0], 1.0)
    after = trainer.full_state_for_push()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert math.isfinite(metrics["loss/pg"]) and metrics["loss/pg"] != 0.0
