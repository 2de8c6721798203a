"""``asyncrl-prepare data``: a task's prompt parquet files, each flag checked first (one
that cannot be honoured is a ValueError naming it: one line and exit 2 from
:func:`asyncrl.prepare.main.main`), prompts over ``--max-prompt-length`` tokens dropped."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger("asyncrl.prepare")


def prepare_data(args: argparse.Namespace) -> dict:
    """Generate the task's parquet files, dropping prompts longer than the limit. A flag
    that cannot be honoured is a ValueError naming it (one line, exit 2)."""
    from asyncrl.tasks import prepare_task_data

    options = _task_options(args)
    count = None
    limit = args.max_prompt_length
    if args.tokenizer is not None:
        count = _prompt_token_counter(args.tokenizer)
    elif limit is not None:
        raise ValueError("--max-prompt-length needs --tokenizer <model dir> to count tokens")
    _make_out_dir(args.out)
    report = prepare_task_data(
        args.task,
        args.out,
        n_train=args.n_train,
        n_val=args.n_val,
        seed=args.seed,
        count_prompt_tokens=count,
        max_prompt_length=limit,
        **options,
    )
    for split in ("train", "val"):
        if report[split]["filtered"] and not report[split]["written"]:
            log.warning(
                "%s: every one of its %d prompts is longer than --max-prompt-length=%d "
                "tokens, so it holds no rows: raise --max-prompt-length",
                report[split]["path"],
                report[split]["filtered"],
                limit,
            )
    return report


def _task_options(args: argparse.Namespace) -> dict:
    """The generator's options from the flags, refusing counts below 0 and flags the task
    does not read (they were ignored without a word)."""
    for flag, value in (("--n-train", args.n_train), ("--n-val", args.n_val)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0 (rows to write), got {value}")
    if args.n_train == 0 and args.n_val == 0:  # parquet's own words named an internal argument
        raise ValueError("--n-train 0 and --n-val 0 write no rows: ask for at least one")
    if args.max_prompt_length is not None and args.max_prompt_length < 1:
        raise ValueError(f"--max-prompt-length must be >= 1 token, got {args.max_prompt_length}")
    arithmetic = {"max_operand": args.max_operand, "ops": args.ops}
    if args.task != "arithmetic":
        given = [f"--{k.replace('_', '-')}" for k, v in arithmetic.items() if v is not None]
        if given:
            verb, them = ("apply", "them") if len(given) > 1 else ("applies", "it")
            raise ValueError(
                f"{' and '.join(given)} {verb} to --task arithmetic only: leave {them} out "
                f"for --task {args.task}"
            )
        return {}
    if args.max_operand is not None and args.max_operand < 0:
        raise ValueError(f"--max-operand must be >= 0, got {args.max_operand}")
    return {
        "max_operand": 9 if args.max_operand is None else args.max_operand,
        "ops": tuple("+" if args.ops is None else args.ops),
    }


def _make_out_dir(out: Path) -> None:
    """``--out`` made a directory up front: a file there, or a folder that cannot be made,
    is the flag's fault, said in one line (it was a traceback)."""
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"--out {out} is a file: give a directory for train.parquet and val.parquet"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot make this directory ({e.strerror or e})") from None


def _prompt_token_counter(model_dir: Path):
    from transformers import AutoTokenizer

    from asyncrl.prepare.tokenizer import chat_prompt_ids

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir.expanduser()))
    except (OSError, ValueError) as e:  # no such folder, or no tokenizer files in it
        if not model_dir.expanduser().exists():  # nor a model id in the local HF cache
            missing = f"--tokenizer {model_dir} does not exist: give the model's directory"
            raise ValueError(missing) from None
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(
            f"--tokenizer {model_dir}: no tokenizer loads from it ({reason}): give the model's "
            "directory"
        ) from None

    def count(messages: list[dict]) -> int:
        return len(chat_prompt_ids(tok, messages))

    return count
