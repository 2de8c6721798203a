"""PPO with a critic on the tiny model: 2 learner ranks equal 1, a resume restores the
critic exactly, only the actor is pushed, and critic warmup holds the actor back."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.config import Config, load_config
from learner import fsdp
from learner.checkpoint import REWARD_KL_KEY, STATE_FILE
from learner.critic import value_head
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
BATCHES = [synthetic_batch(s) for s in range(3)]
# Per-step metrics that depend on the critic: compared between runs.
CRITIC_KEYS = ("critic/vf_loss", "critic/vf_explained_var", "critic/vpred_mean", "loss/total")


def make_cfg(model_dir, *extra: str) -> Config:
    """GAE with discounting, two mini-batches per step for actor and critic, the KL penalty
    in the reward (an adaptive coefficient: state a resume must restore) and a critic
    learning rate high enough that its values move in a few steps."""
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            "algorithm.adv_estimator=gae",
            "algorithm.gamma=0.99",
            "algorithm.lam=0.95",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.kl_coef=0.05",
            "algorithm.kl_ctrl.horizon=50",
            "data.max_response_length=12",
            "actor.ppo_mini_batch_size=2",
            "actor.ppo_max_token_len_per_gpu=48",
            "critic.optim.lr=3e-3",
            "critic.ppo_max_token_len_per_gpu=64",
            "critic.cliprange_value=0.2",
            *extra,
        ],
    )


def critic_gradients(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """record_gradients for the critic's optimizer."""
    assert trainer.critic is not None
    proxy = type("P", (), {"model": trainer.critic.model, "optimizer": trainer.critic.optimizer})
    return record_gradients(proxy)  # type: ignore[arg-type]


def _worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    trainer = Trainer(make_cfg(model_dir))
    grads, cgrads = record_gradients(trainer), critic_gradients(trainer)
    metrics = [trainer.train_step(b, TEMPERATURE) for b in BATCHES]
    assert trainer.critic is not None
    critic_state = fsdp.full_state(trainer.critic.model)
    if rank == 0:
        result = {
            "metrics": metrics,
            "critic": critic_state,
            "grads": grads[0],
            "critic_grads": cgrads[1],
        }
        torch.save(result, Path(out_dir) / "result.pt")
    leave_ranks()


def test_two_ranks_match_one_rank(tiny_model, single_rank, tmp_path):
    ctx = start_ranks(_worker, 2, free_port(), str(tiny_model), str(tmp_path))
    one = Trainer(make_cfg(tiny_model))
    assert one.critic is not None
    grads, cgrads = record_gradients(one), critic_gradients(one)
    metrics = [one.train_step(b, TEMPERATURE) for b in BATCHES]
    critic_state = fsdp.full_state(one.critic.model)
    join_ranks(ctx)
    two = torch.load(tmp_path / "result.pt")

    for m in metrics:
        assert m["actor/updates"] == 2 and m["critic/skipped_updates"] == 0
    assert metrics[-1]["critic/vpred_mean"] != 0  # the values moved off the zero head
    tol = float32_tolerance(one, BATCHES[0])
    # The first actor update sees the same per-token advantages on both (GAE over the
    # gathered values); the critic's second update starts from weights one update apart,
    # where rounding has not yet been amplified by more than Adam's first step.
    assert_gradients_match(two["grads"], grads[0], tol)
    assert_gradients_match(two["critic_grads"], cgrads[1], 1e-3)
    for key in CRITIC_KEYS:
        got, expected = [m[key] for m in two["metrics"]], [m[key] for m in metrics]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=key)
    diff = max((critic_state[k] - two["critic"][k]).abs().max().item() for k in critic_state)
    log.info("critic 1 vs 2 ranks: max weight diff %.3g", diff)
    assert diff < 1e-4


def test_resume_restores_the_critic_exactly(tiny_model, single_rank, tmp_path):
    straight = Trainer(make_cfg(tiny_model))
    expected = [straight.train_step(b, TEMPERATURE) for b in BATCHES]
    assert straight.critic is not None
    expected_critic = fsdp.full_state(straight.critic.model)

    first = Trainer(make_cfg(tiny_model))
    for b in BATCHES[:2]:
        first.train_step(b, TEMPERATURE)
    assert first.critic is not None
    saved_critic = fsdp.full_state(first.critic.model)
    assert first.reward_kl is not None
    saved_kl = first.reward_kl.ctrl.value
    assert saved_kl != 0.05  # the adaptive coefficient moved
    path = first.save(tmp_path)

    resumed = Trainer(make_cfg(tiny_model))
    resumed.load(path)
    critic = resumed.critic
    assert critic is not None
    for k, v in fsdp.full_state(critic.model).items():
        assert torch.equal(v, saved_critic[k]), k
    assert resumed.reward_kl is not None and resumed.reward_kl.ctrl.value == saved_kl
    # A checkpoint written before the trainer held the coefficient kept it with the critic.
    state_file = path / STATE_FILE
    meta = json.loads(state_file.read_text())
    meta["critic"]["kl_coef"] = meta["extra"].pop(REWARD_KL_KEY)
    state_file.write_text(json.dumps(meta))
    older = Trainer(make_cfg(tiny_model))
    older.load(path)
    assert older.reward_kl is not None and older.reward_kl.ctrl.value == saved_kl
    assert critic.scheduler.state_dict() == first.critic.scheduler.state_dict()
    got = resumed.train_step(BATCHES[2], TEMPERATURE)
    for key in (*CRITIC_KEYS, "critic/grad_norm", "critic/lr"):
        assert got[key] == pytest.approx(expected[2][key], rel=1e-6, abs=1e-9), key
    for k, v in fsdp.full_state(critic.model).items():
        torch.testing.assert_close(v, expected_critic[k], rtol=0, atol=1e-7)


def test_only_the_actor_is_pushed_and_warmup_holds_it(tiny_model, single_rank):
    """``critic_warmup`` counted as veRL counts it (``critic_warmup <= global_steps``,
    steps from 1): 2 holds the actor back at step 1 only; the review found one step more."""
    trainer = Trainer(make_cfg(tiny_model, "trainer.critic_warmup=2"))
    before = trainer.full_state_for_push()
    assert not any("score" in k for k in before)  # the causal LM's names only
    m = trainer.train_step(BATCHES[0], TEMPERATURE)
    assert m["actor/updates"] == 0 and m["critic/grad_norm"] > 0
    after = trainer.full_state_for_push()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert trainer.scheduler.last_epoch == 0  # the actor's schedule waits for the actor
    m = trainer.train_step(BATCHES[1], TEMPERATURE)
    assert m["actor/updates"] == 2


def test_a_step_with_nothing_to_train_keeps_both_schedules_in_step(tiny_model, single_rank):
    """Found by a review: a step whose whole batch was dropped (every reward NaN) moved
    the actor's schedule during the critic's warmup, and never the critic's."""
    import dataclasses

    trainer = Trainer(make_cfg(tiny_model, "trainer.critic_warmup=3"))
    assert trainer.critic is not None
    nothing = [dataclasses.replace(r, reward=float("nan")) for r in BATCHES[0]]
    m = trainer.train_step(nothing, TEMPERATURE)
    assert m["actor/updates"] == 0 and m["batch/dropped_nonfinite_reward"] >= len(nothing) - 1
    assert (trainer.scheduler.last_epoch, trainer.critic.scheduler.last_epoch) == (0, 1)
    trainer.train_step(BATCHES[1], TEMPERATURE)  # warmup's second step: the critic alone
    trainer.train_step(nothing, TEMPERATURE)  # past the warmup: both move
    assert (trainer.scheduler.last_epoch, trainer.critic.scheduler.last_epoch) == (1, 3)


def test_the_critic_takes_the_actors_epochs_and_aggregation_unless_set(
    tiny_model, single_rank, monkeypatch
):
    """veRL's critic reads ``ppo_epochs`` and ``loss_agg_mode`` from the actor's config
    when its own are left out: a PPO script that sets the actor's trains the critic the
    same way. Before, the critic ran 1 epoch of token-mean whatever the actor said."""
    from learner import critic as critic_module

    modes: list[str] = []
    real_value_loss = critic_module.value_loss

    def value_loss(*args, **kwargs):
        modes.append(kwargs["agg_mode"])
        return real_value_loss(*args, **kwargs)

    monkeypatch.setattr(critic_module, "value_loss", value_loss)
    actor = ["actor.ppo_epochs=2", "actor.loss_agg_mode=seq-mean-token-mean"]
    trainer = Trainer(make_cfg(tiny_model, *actor))
    trainer.train_step(BATCHES[0], TEMPERATURE)
    two_epochs, modes_then = len(modes), set(modes)

    modes.clear()  # the critic's own: one epoch (the same micro-batches), token-mean
    own = ["critic.ppo_epochs=1", "critic.loss_agg_mode=token-mean"]
    trainer = Trainer(make_cfg(tiny_model, *actor, *own))
    trainer.train_step(BATCHES[0], TEMPERATURE)
    assert modes_then == {"seq-mean-token-mean"} and set(modes) == {"token-mean"}
    assert len(modes) > 0 and two_epochs == 2 * len(modes)


def test_the_critic_loads_as_the_actor_does(tiny_model, single_rank):
    """Found by a review: the critic ignored the actor's attention kernel and config
    overrides (and offload, on CUDA), though it reads the actor's micro-batch layout; a
    veRL user is told the critic is placed as the actor is."""
    cfg = make_cfg(
        tiny_model, "model.attn_implementation=eager", "model.override_config={rms_norm_eps: 0.001}"
    )
    trainer = Trainer(cfg)
    assert trainer.critic is not None
    for model in (trainer.model, trainer.critic.model):
        assert model.config._attn_implementation == "eager"
        assert model.config.rms_norm_eps == pytest.approx(1e-3)


def test_a_checkpoint_without_a_critic_is_refused_naming_the_estimator(
    tiny_model, single_rank, tmp_path
):
    from asyncrl.config import ConfigError
    from asyncrl.config.resumed import settings_of
    from learner.restore import restore

    grpo = load_config(None, [f"model.path={tiny_model}", "actor.ppo_mini_batch_size=2"])
    first = Trainer(grpo)
    first.train_step(BATCHES[0], TEMPERATURE)
    first.save(tmp_path, extra={"settings": settings_of(grpo)})
    cfg = make_cfg(tiny_model, "trainer.resume_mode=auto")
    with pytest.raises(ConfigError) as err:
        restore(cfg, Trainer(cfg), tmp_path)
    (line,) = err.value.problems
    assert "does not fit this model (it holds no critic" in line, line
    assert "algorithm.adv_estimator grpo -> gae" in line and "damaged" not in line, line


def test_a_checkpoint_of_another_critic_is_refused_naming_its_path(
    tiny_model, single_rank, tmp_path
):
    """Found by a review: a resume with a ``critic.model.path`` of another shape failed in
    torch's loader, and the line called the checkpoint damaged and named an earlier one to
    resume, which holds the same critic. The critic is fitted as the actor is."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.config import ConfigError
    from asyncrl.config.resumed import settings_of
    from learner.restore import restore

    shallow = tmp_path / "shallow"  # the tiny model with one layer fewer
    config = AutoConfig.from_pretrained(tiny_model)
    config.num_hidden_layers -= 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    AutoModelForCausalLM.from_config(config).save_pretrained(shallow)
    for f in tiny_model.iterdir():
        if "token" in f.name:
            shutil.copy(f, shallow / f.name)
    first_cfg = make_cfg(tiny_model)
    first = Trainer(first_cfg)
    first.train_step(BATCHES[0], TEMPERATURE)
    run = tmp_path / "run"
    first.save(run, extra={"settings": settings_of(first_cfg)})
    cfg = make_cfg(tiny_model, "trainer.resume_mode=auto", f"critic.model.path={shallow}")
    with pytest.raises(ConfigError) as err:
        restore(cfg, Trainer(cfg), run)
    (line,) = err.value.problems
    assert "its critic: " in line and "damaged" not in line, line
    assert f"critic.model.path None -> {shallow}" in line, line


def test_values_and_proximal_logprobs_are_computed_without_dropout(tiny_model, single_rank):
    """With dropout in the model's config, the no-grad passes (the critic's values, GAE's V
    and the clip's V_old; the actor's proximal logprobs) ran in training mode and drew a
    fresh mask each time: two passes on the same weights differed by up to 1.6 where the
    values reach 2.7. They run in eval mode, as veRL's do; training goes on in train mode."""
    trainer = Trainer(make_cfg(tiny_model, "model.override_config={attention_dropout: 0.5}"))
    critic = trainer.critic
    assert critic is not None and critic.model.config.attention_dropout == 0.5
    with torch.no_grad():  # a head that reads the backbone (it starts at zero)
        weight: Any = value_head(critic.model)[1].weight  # a DTensor
        local = weight.to_local()
        local.copy_(torch.randn(local.shape, generator=torch.Generator().manual_seed(0)))
    kept = [r for r in BATCHES[0] if len(r.response_ids) == len(r.behaviour_logprobs)]
    first, second = critic.values(kept), critic.values(kept)
    assert all(torch.equal(first[i], second[i]) for i in first)
    assert max(float(v.abs().max()) for v in first.values()) > 0.1
    plan = trainer._plan(kept, torch.zeros(len(kept)), TEMPERATURE)
    a, b = (trainer._fixed_logprobs(trainer.model, plan, "proximal") for _ in range(2))
    assert a and all(torch.equal(a[i], b[i]) for i in a)
    assert critic.model.training and trainer.model.training  # back in train mode


def test_a_critic_on_a_model_whose_head_is_called_classifier(single_rank, tmp_path):
    """GPT-2, GPT-NeoX (Pythia), Falcon, Bloom and MPT name their token-classification head
    ``classifier``, not ``score``: the critic failed to load them (AttributeError) where
    GRPO trained them. It loads, its head starts at zero, and a step trains."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=128)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    trainer = Trainer(make_cfg(tmp_path / "gpt2"))
    assert trainer.critic is not None
    name, head = value_head(trainer.critic.model)
    weight: Any = head.weight  # a DTensor
    assert name == "classifier" and weight.shape == (1, 32) and not weight.full_tensor().any()
    m = trainer.train_step(BATCHES[0], TEMPERATURE)
    assert m["actor/updates"] > 0 and m["critic/grad_norm"] > 0
