"""``asyncrl-prepare model|data``: build the local models and the prompt parquet files.

    asyncrl-prepare model --name tiny --out artifacts/models/tiny
    asyncrl-prepare data --task arithmetic --out artifacts/data/arithmetic \\
        --tokenizer artifacts/models/tiny

The tiny model's warm start trains on the arithmetic *training* split that
``prepare data --task arithmetic`` writes with the same seed, and measures its accuracy on
the validation split: the two commands agree as long as ``--data-seed`` equals ``--seed``
of ``data`` (both default to 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

from asyncrl.cli import setup_logging
from asyncrl.prepare.data_command import prepare_data

log = logging.getLogger("asyncrl.prepare")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncrl-prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="build a local Qwen2-architecture model (HF format)")
    m.add_argument(
        "--name",
        choices=["tiny", "small"],
        default="tiny",
        help="tiny: ~0.3M parameters (tests, demo); small: ~24M (benchmarks)",
    )
    m.add_argument("--out", type=Path, required=True, help="output model directory")
    m.add_argument("--force", action="store_true", help="replace a model already in --out")
    m.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    m.add_argument(
        "--warm-start",
        choices=["auto", "on", "off"],
        default="auto",
        help="supervised warm start on the arithmetic task (auto: tiny only)",
    )
    m.add_argument(
        "--data-seed",
        type=int,
        default=0,
        help="seed of the arithmetic split used by the warm start",
    )
    m.add_argument(
        "--flatten",
        action="store_true",
        help="the demo's warm start: train until the model mostly knows the answers, then "
        "flatten its logits to --target-accuracy (default: stop training early there)",
    )
    m.add_argument(
        "--task",
        choices=["arithmetic", "calculator"],
        default="arithmetic",
        help="what the warm start teaches: arithmetic answers, or calculator episodes "
        "(a tool call, then the answer: the agent demo's model)",
    )
    m.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="supervised steps (with --flatten, or --task calculator); default 800",
    )
    m.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        help="validation sampling accuracy to stop at, default 0.2 (or, with --flatten, "
        "the sampling accuracy on training prompts to flatten to, default 0.25)",
    )
    m.add_argument(
        "--max-accuracy",
        type=float,
        default=0.35,
        help="never keep a warm start above this accuracy",
    )
    m.add_argument(
        "--max-operand",
        type=int,
        default=None,
        help="arithmetic warm start: largest operand, default 9 (match `data --max-operand`)",
    )
    m.add_argument(
        "--ops",
        default=None,
        help="arithmetic warm start: operators, default + (match `data --ops`)",
    )
    m.add_argument(
        "--n-val",
        type=int,
        default=None,
        help="held-out rows the warm start never trains on (match `data --n-val`)",
    )
    d = sub.add_parser("data", help="write train/val parquet in veRL's schema")
    d.add_argument(
        "--task", choices=["arithmetic", "calculator", "countdown"], default="arithmetic"
    )
    d.add_argument("--out", type=Path, required=True, help="output directory")
    d.add_argument("--seed", type=int, default=0, help="generation seed")
    d.add_argument("--n-train", type=int, default=None, help="training rows (task default)")
    d.add_argument("--n-val", type=int, default=None, help="validation rows (task default)")
    d.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="model directory whose chat template measures prompt length",
    )
    d.add_argument(
        "--max-prompt-length",
        type=int,
        default=None,
        help="drop prompts longer than this many tokens (needs --tokenizer)",
    )
    d.add_argument(
        "--max-operand", type=int, default=None, help="arithmetic: largest operand (default 9)"
    )
    d.add_argument("--ops", default=None, help="arithmetic: operators, e.g. '+-*' (default +)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    k = sub.add_parser(
        "keys",
        help="write the run's CURVE keys: a server pair, one pair per role, and one folder "
        "per role with what a node of that role needs",
    )
    k.add_argument(
        "--out", required=True, help="directory (give each node only its role's DIR/<role>/)"
    )
    k.add_argument(
        "--force",
        action="store_true",
        help="replace keys already there (nodes holding the old ones are then refused)",
    )
    return p


def prepare_keys(args: argparse.Namespace) -> dict:
    from asyncrl.net.security import KEY_ROLES, write_keys

    out = Path(args.out)
    if (out / "server.key").exists() and not args.force:
        raise ValueError(
            f"{out} holds keys already: nodes given them would be refused once replaced; "
            "give another --out, or --force to replace them"
        )
    files = write_keys(out)
    return {
        "keys_dir": str(out),
        "files": sorted(str(f.relative_to(out)) for f in files),
        "nodes": {role: str(out / role) for role in KEY_ROLES},
        "use": f"endpoints.auth=curve endpoints.keys_dir={out} (on a node: its role's folder)",
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        run = {"model": prepare_model, "data": prepare_data, "keys": prepare_keys}[args.command]
        report = run(args)
    except (ValueError, KeyError) as e:
        sys.stderr.write(f"asyncrl-prepare {args.command}: {e}\n")
        return 2
    print(json.dumps(report, indent=2))
    return 0


def prepare_model(args: argparse.Namespace) -> dict:
    """Build the model, warm-start it if asked, save it and its report.

    Built in ``<out>.partial`` and renamed to ``<out>`` once complete: the warm start takes
    minutes on a busy machine, and a build cut short must not leave a folder that looks
    like a model (its untrained weights would be trained on). A rebuild replaces both."""
    from asyncrl.prepare.model import build_model, save_model

    out = Path(args.out)
    _warm_start_options(args)
    if out.is_dir() and not (out / "config.json").exists() and any(out.iterdir()):
        # The build replaces --out whole: a folder of models or checkpoints given as the
        # place to put one (as ``data --out`` is) was deleted without a word.
        raise ValueError(
            f"--out {out} holds files and no model: the build replaces the folder whole, "
            f"so give an empty or new folder (say, {out / args.name})"
        )
    if (out / "config.json").exists() and not args.force:
        # A rebuild without the same flags (say, --flatten left out) replaced the demo's
        # model without a word, and the demo, which only looks for the folder, trained it.
        raise ValueError(
            f"{out} holds a model already ({_built(out)}); give another --out, or --force to replace it"
        )
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model, tok = build_model(args.name, partial, seed=args.seed)
    report: dict = {
        "name": args.name,
        "path": str(out),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if args.warm_start == "on" or (args.warm_start == "auto" and args.name == "tiny"):
        warm = _agent_warm_start if args.task == "calculator" else _warm_start
        report["warm_start"] = warm(model, tok, args)
        save_model(model, tok, partial)
    (partial / "prepare_report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return report


def _warm_start_options(args: argparse.Namespace) -> None:
    """Resolve the warm start's data flags in ``args``, refusing those its task does not
    read: the calculator's ignored ``--max-operand`` and ``--ops`` without a word, and its
    ``--n-val`` too, so that ``data --n-val 100`` held out rows the model trained on."""
    if args.sft_steps is not None and args.sft_steps < 1:  # 0 was read as the default, 800
        raise ValueError(f"--sft-steps must be >= 1, got {args.sft_steps}")
    if args.task == "calculator":
        flags = (("--max-operand", args.max_operand), ("--ops", args.ops))
        if given := [flag for flag, value in flags if value is not None]:
            raise ValueError(
                f"{' and '.join(given)} apply to the arithmetic warm start only: leave "
                "them out with --task calculator"
            )
        return
    args.max_operand = 9 if args.max_operand is None else args.max_operand
    args.ops = "+" if args.ops is None else args.ops


def _built(out: Path) -> str:
    """What ``out``'s ``prepare_report.json`` says was built, in a few words."""
    try:
        report = json.loads((out / "prepare_report.json").read_text())
    except (OSError, ValueError):
        return "not built by asyncrl-prepare"
    name, warm = report.get("name", "?"), report.get("warm_start")
    if not warm:
        return f"{name}, no warm start"
    shape = "flattened" if "logit_divisor" in warm else f"{warm.get('steps', '?')} warm-start steps"
    return f"{name}, {warm.get('task', '?')} warm start, {shape}"


def _warm_start(model, tok, args: argparse.Namespace) -> dict:
    """Train until the model mostly knows the answers, then flatten its logits so that it
    samples them only a quarter of the time (see :mod:`asyncrl.prepare.warmstart`)."""
    from asyncrl.prepare.warmstart import flatten, sampling_accuracy, supervised, warm_start
    from asyncrl.tasks import arithmetic

    train, val = arithmetic.generate(
        seed=args.data_seed, max_operand=args.max_operand, ops=tuple(args.ops), n_val=args.n_val
    )

    def examples(rows: list[dict]) -> list:
        gt = [r["reward_model"]["ground_truth"] for r in rows]
        return [(r["prompt"], str(g), g) for r, g in zip(rows, gt, strict=True)]

    tr, va, score = examples(train), examples(val), arithmetic.compute_score
    if not args.flatten:  # stop the supervised run as soon as the target is reached
        target = 0.2 if args.target_accuracy is None else args.target_accuracy
        result = warm_start(
            model,
            tok,
            tr,
            va,
            score,
            target_accuracy=target,
            max_accuracy=args.max_accuracy,
            seed=args.seed,
        )
        log.info(
            "warm start: %d steps, validation sampling accuracy %.3f (temperature 1)",
            result.steps,
            result.val_accuracy,
        )
        return {
            "task": "arithmetic",
            "data_seed": args.data_seed,
            "max_operand": args.max_operand,
            "ops": args.ops,
            "n_val": len(val),
            "steps": result.steps,
            "val_sampling_accuracy": result.val_accuracy,
            "history": result.history,
        }
    # Fixed budget, then the logit divisor is calibrated on training prompts: the
    # validation prompts are only measured, so the demo's validation stays held out.
    steps = 800 if args.sft_steps is None else args.sft_steps
    loss = supervised(model, tok, tr, steps=steps, seed=args.seed)
    greedy = sampling_accuracy(model, tok, va, score, temperature=0)
    tau, train_accuracy = flatten(
        model,
        lambda: sampling_accuracy(model, tok, tr, score, seed=args.seed),
        target_accuracy=0.25 if args.target_accuracy is None else args.target_accuracy,
        max_accuracy=args.max_accuracy,
    )
    accuracy = sampling_accuracy(model, tok, va, score, seed=args.seed + 1)
    log.info(
        "warm start: %d supervised steps (loss %.4f, validation greedy accuracy %.3f), "
        "logits / %.2f: sampling accuracy %.3f on training prompts, %.3f on validation",
        steps,
        loss,
        greedy,
        tau,
        train_accuracy,
        accuracy,
    )
    return {
        "task": "arithmetic",
        "data_seed": args.data_seed,
        "max_operand": args.max_operand,
        "ops": args.ops,
        "n_val": len(val),
        "steps": steps,
        "sft_loss": loss,
        "val_greedy_accuracy": greedy,
        "logit_divisor": tau,
        "train_sampling_accuracy": train_accuracy,
        "val_sampling_accuracy": accuracy,
    }


def _agent_warm_start(model, tok, args: argparse.Namespace) -> dict:
    """Train on ideal calculator episodes (a call, then the answer); with ``--flatten``,
    flatten the logits so that sampled episodes succeed about ``--target-accuracy`` of the
    time (default 0.25), measured on training problems."""
    from asyncrl.prepare.agent_warmstart import episode_accuracy, episode_batch
    from asyncrl.prepare.warmstart import flatten, supervised
    from asyncrl.tasks import calculator

    train, val = calculator.generate(seed=args.data_seed, n_val=args.n_val)
    tr, va = (
        [calculator.problem_of(r["prompt"][0]["content"]) for r in rows] for rows in (train, val)
    )
    steps = 800 if args.sft_steps is None else args.sft_steps
    loss = supervised(
        model, tok, tr, steps=steps, batch_size=64, make_batch=episode_batch, seed=args.seed
    )
    greedy = episode_accuracy(model, tok, va, temperature=0)
    report = {"task": "calculator", "data_seed": args.data_seed, "n_val": len(val)}
    report.update(steps=steps, sft_loss=loss)
    report["val_greedy_accuracy"] = greedy
    if args.flatten:
        probe = tr[:64]
        report["logit_divisor"], report["train_sampling_accuracy"] = flatten(
            model,
            lambda: episode_accuracy(model, tok, probe, samples_per_prompt=4, seed=args.seed),
            target_accuracy=0.25 if args.target_accuracy is None else args.target_accuracy,
            max_accuracy=args.max_accuracy,
        )
    report["val_sampling_accuracy"] = episode_accuracy(model, tok, va, seed=args.seed + 1)
    log.info("agent warm start: %s", report)
    return report


if __name__ == "__main__":
    raise SystemExit(main())
