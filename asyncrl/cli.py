"""Shared command-line handling of the role commands.

Every role command takes a config file first and dotted overrides after it, the way veRL
users type them: ``asyncrl-learner configs/cpu_demo.yaml actor.optim.lr=1e-5``. Parsing and
validation happen here, before any heavy import, so ``--help`` is instant and a bad config
fails before a model loads.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from asyncrl.config import Config, ConfigError, field_reference, load_config

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

log = logging.getLogger(__name__)


#: Hydra's flags that name the config to load (veRL's recipe scripts pass them).
HYDRA_CONFIG_FLAGS = ("--config-path", "--config-name", "--config-dir", "-cp", "-cn", "-cd")


def role_parser(
    prog: str,
    description: str,
    groups: Iterable[str] | None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.ArgumentParser:
    """An argparse parser whose help lists the config keys of ``groups`` (None: all);
    ``extra(parser)`` adds a role's own options."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (override any as group.key=value):\n" + field_reference(groups),
    )
    parser.add_argument(
        "config",
        nargs="?",  # required, but checked by hand: parse_intermixed_args names the wrong one
        help="run config YAML (e.g. configs/cpu_demo.yaml); left out, key=value overrides "
        "alone set the run, as a veRL command line does",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. rollout.n=8"
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,  # logging's names, in any case (a bad one was a traceback)
        choices=LOG_LEVELS,
        help="logging level (default INFO)",
    )
    if extra is not None:
        extra(parser)
    return parser


def parse_role_args(
    prog: str,
    description: str,
    groups: Iterable[str] | None = None,
    argv: Sequence[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
    needs: Iterable[str] = (),
) -> tuple[Config, argparse.Namespace]:
    """Parse argv, set up logging, load and validate the config, check the files the role
    ``needs`` (see :func:`asyncrl.config.inputs.input_problems`); exit 2 on a bad config or
    a missing file (a supervisor does not restart a role that exited 2)."""
    from asyncrl.config.inputs import input_problems

    parser = role_parser(prog, description, groups, extra)
    given = list(sys.argv[1:] if argv is None else argv)
    if hydra := [a for a in given if a.split("=", 1)[0] in HYDRA_CONFIG_FLAGS]:
        parser.error(
            f"{hydra[0]}: Hydra's config search is not used here; pass the recipe's YAML "
            "as the first argument instead (CONFIG_PATH/CONFIG_NAME.yaml key=value ...)"
        )
    args = parser.parse_intermixed_args(given)
    if args.config is None:
        parser.error("give a config file (e.g. configs/cpu_demo.yaml) or key=value overrides")
    setup_logging(args.log_level)
    first = args.config
    if ("=" in first or first.startswith("~")) and not Path(first).is_file():  # overrides only
        args.config, args.overrides = None, [first, *args.overrides]
    try:
        cfg = load_config(args.config, args.overrides)
        if problems := input_problems(cfg, needs):
            raise ConfigError(problems)
    except ConfigError as e:
        sys.stderr.write(f"{prog}: {e}\n")
        raise SystemExit(2) from None
    return cfg, args


def setup_logging(level: str = "INFO") -> None:
    """One format for every role: time, level, logger name, message."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
