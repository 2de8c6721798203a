"""veRL's own scripts and files, read as veRL reads them: what a command line with no
config file runs on (the device, the dtype, the number of steps), veRL's null for unset,
its Hydra entries, and the refusals and warnings that name the fix."""

from __future__ import annotations

import logging

import pytest
import yaml

from asyncrl.config import ConfigError, load_config

# The shape of DAPO's and GRPO's example command lines: veRL's spelling, no file of ours.
SCRIPT = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "trainer.n_gpus_per_node=8",
]


def _warnings(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


def test_a_verl_command_line_is_told_it_would_run_on_the_cpu(caplog):
    """veRL's default device is cuda; here it is cpu, where n_gpus_per_node=8 is 8 CPU
    ranks in float32. The default-gap warning names the device first, with the fix."""
    with caplog.at_level(logging.WARNING, logger="asyncrl.config.load"):
        cfg = load_config(None, SCRIPT)
    assert cfg.trainer.device == "cpu" and cfg.trainer.nproc == 8
    (line,) = [m for m in _warnings(caplog) if "written for veRL" in m]
    assert "trainer.device='cpu' (veRL: 'cuda')" in line
    assert "(e.g. trainer.device=cuda); on the CPU, trainer.n_gpus_per_node=8 is 8 CPU ranks" in (
        line
    )
    assert not [m for m in _warnings(caplog) if "model.dtype" in m]  # float32 is right on CPU


def test_a_verl_command_line_on_cuda_is_told_what_dtype_verl_generates_in(caplog):
    """model.dtype is the rollout engines' dtype (and the pushed weights'); the learner
    computes in bfloat16 on CUDA whatever it says. veRL's rollout runs bfloat16."""
    with caplog.at_level(logging.WARNING, logger="asyncrl.config.load"):
        load_config(None, [*SCRIPT, "trainer.device=cuda"])
    (line,) = [m for m in _warnings(caplog) if "model.dtype" in m]
    assert line.startswith("trainer.device=cuda with model.dtype left at float32")
    assert line.endswith("set model.dtype=bfloat16 to run as veRL does")
    assert not [m for m in _warnings(caplog) if "trainer.device='cpu'" in m]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl.config.load"):
        load_config(None, [*SCRIPT, "trainer.device=cuda", "model.dtype=bfloat16"])
        load_config(None, ["trainer.device=cuda"])  # our spelling: our defaults, no word
    assert not [m for m in _warnings(caplog) if "model.dtype" in m]


def test_verls_null_micro_batch_is_unset(tmp_path, caplog):
    """DAPO's test_dapo_7b.sh writes actor.ppo_micro_batch_size=null, veRL's deprecated key
    at its unset value: it overwrote the file's per-GPU size with None (and failed), reset
    the log-prob one, and a file in veRL's layout holding both got a spurious warning."""
    ours = tmp_path / "ours.yaml"
    ours.write_text(
        "actor:\n  ppo_micro_batch_size_per_gpu: 4\n  use_dynamic_bsz: false\n"
        "rollout:\n  log_prob_micro_batch_size_per_gpu: 3\n"
    )
    nulls = [
        "actor_rollout_ref.actor.ppo_micro_batch_size=null",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size=null",
        "actor_rollout_ref.ref.log_prob_micro_batch_size=null",
        "critic.ppo_micro_batch_size=null",
    ]
    cfg = load_config(ours, nulls)
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 4
    assert cfg.rollout.log_prob_micro_batch_size_per_gpu == 3
    verl = tmp_path / "verl.yaml"
    verl.write_text(
        yaml.safe_dump(
            {
                "actor_rollout_ref": {
                    "actor": {"ppo_micro_batch_size": None, "ppo_micro_batch_size_per_gpu": 4},
                    "rollout": {
                        "log_prob_micro_batch_size": None,
                        "log_prob_micro_batch_size_per_gpu": 2,
                    },
                }
            }
        )
    )
    with caplog.at_level(logging.WARNING):
        cfg = load_config(verl)
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 4
    assert cfg.rollout.log_prob_micro_batch_size_per_gpu == 2
    assert not [m for m in _warnings(caplog) if "not applied" in m]
    # a number still divides over the learner's ranks, as veRL does
    cfg = load_config(None, ["actor_rollout_ref.actor.ppo_micro_batch_size=8", "trainer.nproc=2"])
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 4


VERL_LAYOUT = """\
hydra:
  searchpath:
    - file://verl/trainer/config
defaults:
  - ppo_trainer
  - _self_
actor_rollout_ref:
  actor:
    _target_: verl.workers.config.FSDPActorConfig
    ppo_mini_batch_size: 8
    optim:
      _target_: verl.workers.config.FSDPOptimizerConfig
      lr: 1.0e-06
  rollout:
    _target_: verl.workers.config.RolloutConfig
    name: vllm
    val_kwargs:
      _target_: verl.workers.config.SamplingConfig
      temperature: 0
algorithm:
  _target_: verl.trainer.config.AlgoConfig
  adv_estimator: grpo
  kl_ctrl:
    _target_: verl.trainer.config.KLControlConfig
    kl_coef: 0.0
  filter_groups:
    _target_: verl.trainer.config.FilterGroupsConfig
    enable: false
    metric: null
    max_num_gen_batches: 0
"""


def test_verls_own_yaml_layout_loads(tmp_path, caplog):
    """``_target_`` entries (veRL's dataclass names), a recipe file's ``hydra:`` and
    ``defaults:``, and FilterGroupsConfig's metric null with the filter off: all refused
    before (an unknown key, "did you mean target_kl"; a metric that must be text)."""
    path = tmp_path / "verl.yaml"
    path.write_text(VERL_LAYOUT)
    with caplog.at_level(logging.INFO, logger="asyncrl.config.load"):
        cfg = load_config(path)
    assert cfg.actor.optim.lr == 1e-6 and cfg.rollout.val_kwargs.temperature == 0
    assert cfg.algorithm.filter_groups.metric == "acc"  # unset: the filter is off anyway
    (note,) = [r.getMessage() for r in caplog.records if "Hydra entries" in r.getMessage()]
    assert "(hydra:, defaults:, 7 _target_ entries)" in note
    # a recipe file with no actor_rollout_ref group is written for veRL all the same
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("defaults:\n  - ppo_trainer\n  - _self_\ndata:\n  train_batch_size: 32\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl.config.load"):
        load_config(recipe)
    assert [m for m in _warnings(caplog) if "written for veRL" in m]


def test_the_group_filter_on_with_a_null_metric_is_refused_in_one_line(tmp_path):
    """veRL then fails at its first batch (it reads the values under a metric named None)."""
    path = tmp_path / "verl.yaml"
    path.write_text(VERL_LAYOUT)
    with pytest.raises(ConfigError) as err:
        load_config(path, ["algorithm.filter_groups.enable=true"])
    (line,) = err.value.problems
    assert line.startswith("algorithm.filter_groups.enable=true with ")
    assert line.endswith("set algorithm.filter_groups.metric=acc")
    with pytest.raises(ConfigError, match="metric=acc"):  # Hydra's yes reads as true
        load_config(
            None, ["algorithm.filter_groups.enable=yes", "algorithm.filter_groups.metric=null"]
        )
    cfg = load_config(
        path, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"]
    )
    assert cfg.algorithm.filter_groups.enable


def test_global_profiler_keys_have_no_effect(caplog):
    with caplog.at_level(logging.INFO, logger="asyncrl.config.load"):
        cfg = load_config(
            None,
            [
                "global_profiler.tool=null",
                "global_profiler.steps=[1,2]",
                "global_profiler.global_tool_config.nsys.worker_nsight_options.capture-range=x",
            ],
        )
    assert cfg == load_config(None)
    notes = [r.getMessage() for r in caplog.records if "global_profiler." in r.getMessage()]
    assert len(notes) == 3 and all("profiler hooks are not built" in n for n in notes)


def test_chat_template_arguments_are_refused_with_the_way_to_the_same_prompts():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["+data.apply_chat_template_kwargs.enable_thinking=False"])
    (line,) = err.value.problems
    assert "edit the template in model.path's tokenizer_config.json" in line
    assert "write the prompts already rendered with them" in line


@pytest.mark.parametrize(
    ("loggers", "kept"),
    [
        ("['console','tensorboard']", ["console"]),
        ("['swanlab']", ["console"]),
        ("[console,wandb,mlflow]", ["console", "wandb"]),
    ],
)
def test_verls_other_loggers_are_left_out_with_a_warning(loggers, kept, caplog):
    """veRL's Tracking backends not built here: the run's results do not depend on them, and
    metrics.jsonl is written whatever the logger, so the run goes on, told so."""
    with caplog.at_level(logging.WARNING, logger="asyncrl.config.load"):
        cfg = load_config(None, [f"trainer.logger={loggers}"])
    assert cfg.trainer.logger == kept
    (line,) = [m for m in _warnings(caplog) if m.startswith("trainer.logger:")]
    assert "not supported here (the accepted loggers are console, jsonl and wandb)" in line
    with pytest.raises(ConfigError, match="trainer.logger.0: input should be 'console'"):
        load_config(None, ["trainer.logger=[neptune]"])  # neither veRL's nor ours


def test_verls_epochs_without_steps_count_the_steps_from_the_epochs(tmp_path, caplog):
    """A veRL config giving trainer.total_epochs but no total_training_steps ran this
    project's 60 steps (warned once); it means epochs, as in veRL: steps null."""
    with caplog.at_level(logging.INFO, logger="asyncrl.config.load"):
        cfg = load_config(None, [*SCRIPT, "trainer.total_epochs=15"])
    assert cfg.trainer.total_training_steps is None and cfg.trainer.total_epochs == 15
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("trainer.total_epochs=15 given without") for m in messages)
    (line,) = [m for m in messages if "written for veRL" in m]
    assert "total_training_steps" not in line and "total_epochs" not in line
    both = load_config(None, [*SCRIPT, "trainer.total_epochs=15", "trainer.total_training_steps=7"])
    assert both.trainer.total_training_steps == 7
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  rollout:\n    n: 4\ntrainer:\n  total_epochs: 3\n")
    assert load_config(path).trainer.total_training_steps is None
    # our spelling keeps our meaning: the default 60 steps (total_epochs ends it sooner), said so
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="asyncrl.config.load"):
        assert load_config(None, ["trainer.total_epochs=15"]).trainer.total_training_steps == 60
    assert (
        "trainer.total_epochs=15 without trainer.total_training_steps: the run lasts the "
        "default 60 steps, or less where 15 epochs of the data end sooner; set "
        "trainer.total_training_steps=null to train 15 epochs"
    ) in caplog.messages


def test_a_verl_layout_file_with_its_actor_on_the_command_line_is_read_as_veRL(tmp_path, caplog):
    """A user's own veRL-layout file without an actor_rollout_ref group (its actor's keys
    come on the command line) was read as this project's: its total_epochs capped the
    default 60 steps and veRL's defaults went unmentioned. A file of this project's groups
    with a veRL override stays this project's."""
    path = tmp_path / "verl.yaml"
    path.write_text("algorithm:\n  adv_estimator: grpo\ntrainer:\n  total_epochs: 3\n")
    with caplog.at_level(logging.INFO, logger="asyncrl.config.load"):
        cfg = load_config(path, SCRIPT[1:])
    assert cfg.trainer.total_training_steps is None and cfg.trainer.total_epochs == 3
    assert [m for m in caplog.messages if "written for veRL" in m]
    ours = tmp_path / "ours.yaml"
    ours.write_text("rollout:\n  n: 4\ntrainer:\n  total_epochs: 3\n")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="asyncrl.config.load"):
        mine = load_config(ours, SCRIPT[1:])
    assert mine.trainer.total_training_steps == 60
    assert not [m for m in caplog.messages if "written for veRL" in m]


def test_the_verl_defaults_warning_names_the_clip_range_gspo_runs_with(caplog):
    """veRL's GSPO switch alone: the range here is GSPO's (3e-4/4e-4), and the warning of
    veRL's defaults names both ends of it against veRL's 0.2/0.2 (it named 0.28, which did
    not run, and left the lower end out)."""
    with caplog.at_level(logging.WARNING, logger="asyncrl.config.load"):
        cfg = load_config(None, [*SCRIPT, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (3e-4, 4e-4)
    (line,) = [m for m in _warnings(caplog) if "written for veRL" in m]
    assert "actor.clip_ratio_low=0.0003 (veRL: 0.2)" in line
    assert "actor.clip_ratio_high=0.0004 (veRL: 0.2)" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl.config.load"):
        load_config(None, SCRIPT)  # without GSPO: the low end is veRL's, the high one not
    (line,) = [m for m in _warnings(caplog) if "written for veRL" in m]
    assert "clip_ratio_low" not in line and "actor.clip_ratio_high=0.28 (veRL: 0.2)" in line
