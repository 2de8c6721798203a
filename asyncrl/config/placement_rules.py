"""Cross-field rules of where and how the roles run: the endpoints (ports, the host, who
may reach it), the launch table (niceness, CPUs and GPUs per role) and the GPU counts
(:mod:`asyncrl.config.rules` holds the training ones and calls these).

Pure functions of a validated :class:`Config`; each problem names the fix.
"""

from __future__ import annotations

from asyncrl.config.schema import Config


def placement_problems(cfg: Config) -> list[str]:
    """Every problem of the endpoints and the launch table, at once."""
    return _endpoint_problems(cfg) + _launch_problems(cfg)


def _endpoint_problems(cfg: Config) -> list[str]:
    from asyncrl.net.security import exposure_problem, loopback

    ports = cfg.endpoints.model_dump(include={"tasks", "trajectories", "batches", "control"})
    ports["sync_store"] = cfg.endpoints.sync_store
    seen: dict[int, str] = {}
    out = []
    if (why := _host_problem(cfg.endpoints.host)) is not None or (
        why := exposure_problem(cfg.endpoints)
    ) is not None:
        out.append(why)
    oe = cfg.rollout.openai_endpoint
    if oe.enable and not (loopback(oe.host) or cfg.endpoints.insecure):
        # Here, not at the server: there it was found after the engine had loaded.
        out.append(
            f"rollout.openai_endpoint.host={oe.host} serves a network without "
            "authentication: anyone who reaches it adds training data. Keep it on 127.0.0.1 "
            "behind an authenticating proxy, or on a private network you trust set "
            "endpoints.insecure=true"
        )
    if cfg.endpoints.auth == "curve" and not cfg.endpoints.keys_dir:
        out.append(
            "endpoints.auth=curve needs endpoints.keys_dir: create the keys with "
            "asyncrl-prepare keys --out DIR and set endpoints.keys_dir=DIR"
        )
    for name, port in ports.items():
        if port in seen:
            out.append(f"endpoints.{name}={port} is also endpoints.{seen[port]}; give each its own")
        seen[port] = name
    return out


def _host_problem(host: str) -> str | None:
    """``endpoints.host`` is where the coordinator, the buffer and the sync store listen
    and also the address every other role dials (servers are told to sync from it), so it
    must be one address the others reach; and the sockets speak IPv4."""
    import ipaddress

    try:
        ip = ipaddress.ip_address("0.0.0.0" if host == "*" else host.strip("[]"))
    except ValueError:  # a host name (or ipc://): resolved where it is used
        return None
    if ip.is_unspecified:
        return (
            f"endpoints.host={host} is the address every role dials and the servers sync "
            "from, not only where the learner and the buffer listen: give the address of "
            "the learner's machine that the others reach (e.g. 10.0.0.5), or 127.0.0.1 on one "
            "machine"
        )
    if ip.version == 6:
        return (
            f"endpoints.host={host} is an IPv6 address, which the run's sockets do not speak: "
            "give an IPv4 address, or a host name that resolves to one"
        )
    return None


def _unknown_roles(key: str, table: dict) -> list[str]:
    unknown = set(table) - {"learner", "rollout", "buffer"}
    if not unknown:
        return []
    return [f"launch.{key} has unknown roles {sorted(unknown)}; use learner, rollout, buffer"]


def _nice_problems(cfg: Config) -> list[str]:
    table = cfg.launch.nice or {}
    out = []
    if table and cfg.launch.backend == "ray":
        out.append(
            "launch.nice applies to the local launcher; under Ray, give the roles cores of "
            "their own (launch.ray.learner_cpus, rollout_cpus) or drop launch.nice"
        )
    out += _unknown_roles("nice", table)
    for role, value in table.items():
        values = value if isinstance(value, list) else [value]
        if isinstance(value, list) and role != "rollout":
            out.append(f"launch.nice.{role}={value} is a list; give one number, e.g. 10")
        if role == "rollout" and isinstance(value, list) and len(value) != cfg.rollout.num_servers:
            out.append(
                f"launch.nice.rollout lists {len(value)} servers but rollout.num_servers="
                f"{cfg.rollout.num_servers}; give one value per server, or one number for all"
            )
        if any(not 0 <= v <= 19 for v in values):
            out.append(
                f"launch.nice.{role}={value} is outside 0-19 (a negative niceness needs "
                "privileges); lower the others instead"
            )
    return out


def _gpu_count_problems(cfg: Config) -> list[str]:
    """A role sees only the GPUs ``launch.gpus`` lists for it: the learner needs one per
    rank (``trainer.nproc``), a rollout server one per tensor-parallel rank."""
    gpus = cfg.launch.gpus or {}
    out = []
    learner = gpus.get("learner")
    nproc = cfg.trainer.nproc
    if learner is not None and cfg.trainer.device == "cuda" and len(learner) < nproc:
        out.append(
            f"trainer.nproc={nproc} (veRL's trainer.n_gpus_per_node sets it: the learner's "
            f"ranks only) but launch.gpus.learner={learner} lists {len(learner)} GPU(s): rank "
            f"{len(learner)} would find no device; list one GPU per rank"
        )
    tp = cfg.rollout.tensor_model_parallel_size
    # On CPU vLLM binds each tensor-parallel rank to cores of its own.
    kind, table = ("gpus", gpus) if cfg.trainer.device == "cuda" else ("cpus", cfg.launch.cpus)
    for i, ids in enumerate((table or {}).get("rollout") or []):
        if isinstance(ids, list) and len(ids) < tp:
            unit = "GPU(s)" if kind == "gpus" else "core(s)"
            out.append(
                f"rollout.tensor_model_parallel_size={tp} but launch.{kind}.rollout[{i}]={ids} "
                f"lists {len(ids)} {unit}; list {tp} per server"
            )
    return out


def _launch_problems(cfg: Config) -> list[str]:
    out = []
    for kind in ("cpus", "gpus"):
        table = getattr(cfg.launch, kind)
        if not table:
            continue
        out += _unknown_roles(kind, table)
        for role, ids in table.items():  # rollout: one list per server; others: one list
            nested = role == "rollout"
            if not all(isinstance(x, list) == nested for x in ids):
                example = "[[1], [2]], one list per server" if nested else "[0]"
                out.append(f"launch.{kind}.{role}={ids} has the wrong shape; write e.g. {example}")
        per_server = table.get("rollout")
        if per_server is not None and len(per_server) != cfg.rollout.num_servers:
            out.append(
                f"launch.{kind}.rollout lists {len(per_server)} servers but "
                f"rollout.num_servers={cfg.rollout.num_servers}; give one list per server"
            )
    out += _gpu_count_problems(cfg)
    out += _nice_problems(cfg)
    if cfg.trainer.device == "cpu" and cfg.model.dtype != "float32":
        out.append(
            f"model.dtype={cfg.model.dtype} on trainer.device=cpu: the CPU stack is checked in "
            "float32 only; set model.dtype=float32"
        )
    return out
