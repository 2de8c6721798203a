"""``asyncrl-rollout CONFIG [overrides] [--server-id ID]``: one vLLM rollout server.

The config is parsed and validated before vLLM is imported, so ``--help`` is instant and a
bad config fails at once. Exits 0 when the coordinator ends the run, 3 when the coordinator
cannot be reached within ``launch.start_timeout_s``.

SIGTERM (or Ctrl-C) is how a server leaves for good (scale-down): it stops taking tasks,
tells the coordinator it leaves (its unacknowledged tasks are dealt to other servers at
once), shuts its engine down and exits 0, so ``asyncrl-launch`` does not restart it. Before
the engine is up there is nothing to leave: it stops the engine processes started so far
and exits 0 at once.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.cli import parse_role_args
from asyncrl.config import run_dir
from asyncrl.config.inputs import MODEL, REWARD
from asyncrl.launch import startup
from asyncrl.launch.restart_policy import CONFIG_ERROR
from asyncrl.net import security
from asyncrl.net.taken import exit_if_taken, exit_unless_free

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.rewards import RewardPool
    from rollout_servers.engine import RolloutEngine

# The groups whose keys a server reads (its --help lists them): algorithm and staleness it
# must share with the learner, buffer.max_message_mb bounds its pushes, and
# launch.start_timeout_s how long it waits for the coordinator.
GROUPS = (
    "model",
    "data",
    "rollout",
    "reward",
    "algorithm",
    "staleness",
    "buffer",
    "control",
    "sync",
    "endpoints",
    "trainer",
    "launch",
)
STOP_LINGER_S = 2.0  # how long pushed groups may take to leave once the server stops

log = logging.getLogger("rollout_servers")


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server-id",
        default=None,
        help="stable name of this server (default rollout-<host>-<pid>); a "
        "restarted server should reuse its name",
    )


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_role_args(
        "asyncrl-rollout",
        "Generate, score and stream groups with a vLLM engine.",
        GROUPS,
        argv,
        _options,
        needs=(MODEL, REWARD),
    )
    server_id = args.server_id or f"rollout-{socket.gethostname()}-{os.getpid()}"
    security.configure(cfg.endpoints, "rollout")
    startup.mark(run_dir(cfg), server_id, "started")
    if cfg.trainer.device == "cpu":  # vLLM on CPU claims most of RAM unless told otherwise
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.rollout.cpu_kvcache_space_gb))
        # On CPU, vLLM's engine core would start its one worker as a third process, which
        # imports torch, transformers and vLLM all over again: the worker inside the engine
        # core made an engine ready in 14 s instead of 20 s on 2 cores, generating as fast.
        # (With tensor parallelism the workers are processes whatever this says.)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for sig in (signal.SIGTERM, signal.SIGINT):  # until serve() installs its own
        signal.signal(sig, _stop_while_starting)
    oe = cfg.rollout.openai_endpoint  # the one port a server listens at, if configured
    listens = {"rollout.openai_endpoint.port": (oe.host, oe.port)} if oe.enable and oe.port else {}
    exit_unless_free(server_id, listens)  # before the engine loads (a predecessor may end)
    with exit_if_taken(server_id, listens):
        return asyncio.run(serve(cfg, server_id))


def _stop_while_starting(signum: int, frame: object) -> None:
    """SIGTERM/SIGINT while the engine starts (before serve() installs its own handler):
    nothing to leave yet. The engine start is a blocking call, so stop the engine processes
    started so far and exit 0 right here."""
    import multiprocessing

    log.info("stopped by signal %d while starting: exiting", signum)
    for child in multiprocessing.active_children():  # vLLM's engine core
        child.kill()
    logging.shutdown()
    os._exit(0)


def eager_engine(cfg: Config) -> bool:
    """``rollout.enforce_eager`` resolved: ``auto`` skips compilation on CPU (vLLM captures
    no graphs there, and compiling costs start-up a small model never earns back) and for
    short runs (under 100 learner steps), where it could not pay back either."""
    setting = cfg.rollout.enforce_eager
    if setting != "auto":
        return bool(setting)
    steps = cfg.trainer.total_training_steps
    return cfg.trainer.device == "cpu" or (steps is not None and steps < 100)


def inline_engine(cfg: Config) -> bool:
    """``rollout.inline_engine`` resolved: ``auto`` runs vLLM's engine core in the server's
    process on CPU with one worker (there the two processes share a core, and handing
    every step's outputs between them costs more than it frees) and in keep mode, the only
    one the inline engine has."""
    ro = cfg.rollout
    if ro.inline_engine != "auto":
        return bool(ro.inline_engine)
    return (
        cfg.trainer.device == "cpu"
        and ro.tensor_model_parallel_size == 1
        and ro.sync_mode == "keep"
    )


def engine_sequences(cfg: Config) -> int:
    """vLLM's ``max_num_seqs``: the responses the server keeps in flight, and one more, the
    post-sync probe's (without it, the probe queued behind them until one finished). A
    validation group larger than the free slots is dealt alone (``val_kwargs.n`` above
    ``rollout.n``: the server asked for groups of ``rollout.n``), so the responses in
    flight may pass ``rollout.max_inflight`` by the difference."""
    ro = cfg.rollout
    return ro.max_inflight + max(ro.val_kwargs.n - ro.n, 0) + 1


async def _start_engine(cfg: Config, server_id: str) -> tuple[RolloutEngine, bool]:
    """Start vLLM; returns the engine and whether requests may be seeded (on CPU only when
    a step's token budget holds every sequence whole)."""
    from rollout_servers.engine import RolloutEngine
    from rollout_servers.engine_config import cpu_token_budget, engine_args
    from rollout_servers.vllm_check import require

    inline = inline_engine(cfg)
    require(inline=inline)  # an untested vLLM without the APIs used here: exit 2, naming the fix
    ro = cfg.rollout
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    seqs = engine_sequences(cfg)
    budget, seeded = None, True
    if cfg.trainer.device == "cpu":
        budget = cpu_token_budget(seqs, max_len)
        seeded = budget is not None
        if not seeded:
            log.warning(
                "per-request seeds are off on CPU for %d sequences of %d tokens: vLLM's "
                "CPU sampler cannot seed chunked prefills",
                ro.max_inflight,
                max_len,
            )
    args = engine_args(
        cfg.model.path,
        dtype=cfg.model.dtype,
        max_model_len=max_len,
        max_num_batched_tokens=budget,
        seed=cfg.trainer.seed,
        tensor_parallel_size=ro.tensor_model_parallel_size,
        gpu_memory_utilization=ro.gpu_memory_utilization,
        enforce_eager=eager_engine(cfg),
        max_num_seqs=seqs,
        hf_overrides=cfg.model.override_config,
        **_lora_args(cfg),
    )
    adapters = _adapters(cfg, server_id)
    engine = await RolloutEngine.start(
        args, sync_mode=ro.sync_mode, adapters=adapters, inline=inline
    )
    return engine, seeded


def _lora_args(cfg: Config) -> dict[str, int]:
    """Engine arguments for pushed adapters (``sync.lora: adapter``): vLLM's rank that
    holds ``model.lora_rank``, and room in a batch for every version a request may still
    run on (``max_policy_lag + 1``) plus the newest."""
    from rollout_servers.adapters import engine_lora_rank

    if not (cfg.model.lora_rank and cfg.sync.lora == "adapter"):
        return {}
    return {
        "max_lora_rank": engine_lora_rank(cfg.model.lora_rank),
        "max_loras": cfg.staleness.max_policy_lag + 2,
    }


def _adapters(cfg: Config, server_id: str) -> Any:
    """The adapter versions of a server with pushed adapters (None otherwise); their files
    in a temporary folder of this run's server (:func:`adapter_folder`)."""
    from rollout_servers.adapters import AdapterVersions

    if not (cfg.model.lora_rank and cfg.sync.lora == "adapter"):
        return None
    root = adapter_folder(cfg, server_id)
    m = cfg.model
    return AdapterVersions(
        root, keep=cfg.staleness.max_policy_lag + 1, rank=m.lora_rank, alpha=m.lora_alpha
    )


def adapter_folder(cfg: Config, server_id: str) -> str:
    """The folder of the pushed adapters of ``server_id`` in this run, emptied: named by the
    run and the server, so that a server killed uncleanly (its folder left behind, up to
    ``max_policy_lag + 1`` adapters) has it emptied by its restart, not one more left."""
    run = hashlib.sha256(str(run_dir(cfg).resolve()).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", server_id)
    root = Path(tempfile.gettempdir()) / f"asyncrl-adapters-{run}-{name}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return str(root)


def reward_pool(cfg: Config) -> RewardPool:
    """The server's scorer processes, as ``reward.*`` sets them; raises ValueError (one line
    naming the fix) when the scorer does not load, or not within ``startup_timeout_s``."""
    from asyncrl.rewards import RewardPool

    r = cfg.reward
    custom = r.custom_reward_function
    return RewardPool(
        num_workers=r.num_workers,
        timeout_s=r.timeout_s,
        custom_path=custom.path,
        custom_name=custom.name,
        custom_kwargs=custom.reward_kwargs,
        startup_timeout_s=r.startup_timeout_s,
        max_memory_mb=r.max_memory_mb,
        reward_manager=r.reward_manager,
    )


async def serve(cfg: Config, server_id: str) -> int:
    """Start the engine and the server's helpers, run until the run ends, clean up."""
    from transformers import AutoTokenizer

    from asyncrl.control.client import CoordinatorClient
    from asyncrl.net.transport import TrajectoryPusher, config_endpoint, mebibytes
    from rollout_servers.affinity import cpus_from_env, pin_tree
    from rollout_servers.server import RolloutServer

    try:  # before the engine: a scorer that does not load fails every restart the same way
        pool = reward_pool(cfg)
    except ValueError as e:  # a missing function, a file that fails to import
        log.error("cannot start: %s", e)
        return CONFIG_ERROR
    try:  # the tools too: a tool config that does not load (a class not found, a constructor
        tools = _tools(cfg)  # that raises) fails every restart the same way
    except ValueError as e:
        pool.close()
        log.error("cannot start: %s", e)
        return CONFIG_ERROR
    try:
        engine, seeded = await _start_engine(cfg, server_id)
    except BaseException:
        pool.close()
        if tools is not None:
            tools.close()
        raise
    startup.mark(run_dir(cfg), server_id, "engine_ready")
    cpus = cpus_from_env()
    if cpus is not None:  # started on every core for its start-up; now onto its own
        pin_tree(cpus)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    pusher = TrajectoryPusher(
        config_endpoint(cfg.endpoints, "trajectories"),
        max_message_bytes=mebibytes(cfg.buffer.max_message_mb),
    )
    client = CoordinatorClient.from_config(
        cfg,
        server_id,
        engine_world_size=cfg.rollout.tensor_model_parallel_size,
        address=f"{socket.gethostname()} pid {os.getpid()}",
    )
    agent = _agent(cfg, engine, tok, seeded, tools)
    endpoint = _endpoint(cfg, server_id, engine, tok, client, pusher, seeded)
    server = RolloutServer(
        cfg,
        server_id,
        engine,
        tok,
        pool,
        pusher,
        client,
        seeded=seeded,
        agent=agent,
        endpoint=endpoint,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop taking tasks, leave, exit 0
        loop.add_signal_handler(sig, server.stop)
    try:
        with startup.startup_heap_frozen():
            code = await server.run()
    finally:
        await _leave_and_close(client, pusher)
        pool.close()
        if tools is not None:
            tools.close()
        try:
            engine.shutdown()
        finally:  # also when the engine's shutdown fails
            if engine.adapters is not None:
                shutil.rmtree(engine.adapters.root, ignore_errors=True)
    log.info("%s exits %d: %s", server_id, code, server.snapshot())
    return code


async def _leave_and_close(client: Any, pusher: Any) -> None:
    """Tell the coordinator this server leaves (unless it is gone, or the server never
    registered: nothing to leave), then close the client and the pusher.

    The leave runs on a thread of its own: pushes blocked by a buffer that does not read
    hold asyncio's default executor, and free its threads only when the pusher closes, so a
    leave queued behind them would wait for good (the server hung until killed, its Leave
    never sent)."""
    if client.registered is not None and not client.gone.is_set():
        with ThreadPoolExecutor(1, thread_name_prefix="leave") as own:
            await asyncio.get_running_loop().run_in_executor(own, client.leave, "stopped")
    client.close()
    # Groups still queued for a buffer that is gone too (the run ends) cannot leave; a
    # live one takes them in far less. (The default 10 s made a stopped server overrun
    # the launcher's 15 s grace, then SIGKILL.) One lost is dealt again (an audit). Blocked
    # pushes give up within a second of the close.
    pusher.close(linger_s=STOP_LINGER_S)


def _endpoint(
    cfg: Config, server_id: str, engine: Any, tok: Any, client: Any, pusher: Any, seeded: bool
) -> Any:
    """The OpenAI-compatible endpoint when ``rollout.openai_endpoint.enable`` (else None)."""
    from rollout_servers.groups import SamplingSettings
    from rollout_servers.openai_api import OpenAIEndpoint

    oe = cfg.rollout.openai_endpoint
    if not oe.enable:
        return None
    settings = SamplingSettings.from_config(cfg, seeded=seeded)
    return OpenAIEndpoint(cfg, server_id, engine, tok, client, pusher, settings)


def _tools(cfg: Config) -> Any:
    """The tool workers when ``rollout.multi_turn.enable`` names a tool config, else None.
    Raises ValueError (one line naming the fix) for a tool config that does not load, or not
    within ``tool_startup_timeout_s``."""
    from asyncrl.tools import ToolPool

    mt = cfg.rollout.multi_turn
    if not (mt.enable and mt.tool_config_path):
        return None
    return ToolPool(
        mt.tool_config_path,
        num_workers=mt.tool_workers,
        timeout_s=mt.tool_timeout_s,
        max_response_length=mt.max_tool_response_length,
        truncate_side=mt.tool_response_truncate_side,
        startup_timeout_s=mt.tool_startup_timeout_s,
        max_memory_mb=mt.tool_max_memory_mb,
    )


def _agent(cfg: Config, engine: Any, tok: Any, seeded: bool, tools: Any) -> Any:
    """The episode runner when ``rollout.multi_turn.enable`` (else None), calling
    ``tools`` (:func:`_tools`)."""
    from rollout_servers.agent import AgentRunner, AgentSettings
    from rollout_servers.groups import SamplingSettings

    if not cfg.rollout.multi_turn.enable:
        return None
    settings = SamplingSettings.from_config(cfg, seeded=seeded)
    return AgentRunner(AgentSettings.from_config(cfg), settings, engine, tok, tools)


if __name__ == "__main__":
    raise SystemExit(main())
