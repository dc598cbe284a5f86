"""One pattern for every entry point: an absl app with a locked `--config` file and a `--workdir`,
library logging quietened, and every configuration error reported as one `error:` line (exit 2).

The config is locked, so a misspelled override fails instead of being silently ignored.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

from ppo_jax.config import ConfigError
from ppo_jax.checkpoint import CheckpointError

# What a user can fix from the message alone: no traceback for these.
USER_ERRORS = (ConfigError, CheckpointError, ValueError, KeyError, FileNotFoundError, FileExistsError)


VERBOSE = flags.DEFINE_bool("verbose", False, "library INFO logs and full tracebacks on the terminal")


def fail(message: str, *, code: int = 2, cause: BaseException | None = None) -> None:
    """One `error:` line and exit `code` (2: bad input; 1: a failure while running). With --verbose
    the traceback of `cause` is printed first."""
    if cause is not None and VERBOSE.value:
        traceback.print_exception(cause)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def quiet_logging() -> None:
    """JAX's and Orbax's INFO lines would bury the progress bars (unless --verbose or --verbosity)."""
    if not (VERBOSE.value or flags.FLAGS["verbosity"].present):
        logging.set_verbosity(logging.WARNING)


def config_command(run: Callable[[Any, str | None], str | None], *, what: str, default_config: str | None = None,
                   workdir: str | None | bool = None, argv=None) -> None:
    """Runs `run(config, workdir)` as a command line program and prints the line it returns.

    default_config: config file used without --config (None: --config is required). workdir: the
    default workdir (None: --workdir is required; False: the command takes no workdir).
    """
    config_flag = config_flags.DEFINE_config_file(
        "config", default_config, f"{what} config file (a Python file with get_config())", lock_config=True)
    workdir_flag = None
    if workdir is not False:
        workdir_flag = flags.DEFINE_string("workdir", workdir, "directory for metrics, checkpoints and outputs")
    required = (["config"] if default_config is None else []) + (["workdir"] if workdir is None else [])
    flags.mark_flags_as_required(required)

    def main(args):
        if len(args) > 1:
            raise app.UsageError(f"unexpected arguments {args[1:]}")
        quiet_logging()
        try:
            message = run(config_flag.value, workdir_flag.value if workdir_flag is not None else None)
        except USER_ERRORS as e:
            fail(str(e))
        if message:
            print(message)

    app.run(main, argv=argv)
