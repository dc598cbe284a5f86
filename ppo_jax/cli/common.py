"""One pattern for every entry point: an absl app with a locked `--config` file and a `--workdir`,
library logging quietened, and every configuration error reported as one `error:` line (exit 2).

The config is locked, so a misspelled override fails instead of being silently ignored.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

from ppo_jax.cli import preflight as preflight_lib
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
    """JAX's and Orbax's INFO lines would bury the progress bars (unless --verbose or --verbosity).
    (transformers' import advice is silenced for the whole package, in `ppo_jax/__init__.py`.)"""
    if not (VERBOSE.value or flags.FLAGS["verbosity"].present):
        logging.set_verbosity(logging.WARNING)


_HELP = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def wants_help(argv: Sequence[str]) -> bool:
    return any(a in _HELP for a in argv[1:])


def preflight(argv: Sequence[str], *, what: str, schema: type | None, default_config: str | None,
              takes_workdir: bool) -> None:
    """--help (config tree, exit 0), a missing config file and misspelled overrides (one line, exit 2),
    before absl parses anything."""
    args = list(argv[1:])
    spec = preflight_lib.flag_value(args, "config") or default_config
    help_asked = wants_help(argv)
    if spec is None:
        if help_asked:
            print(f"{what} run: --config=FILE is required (e.g. configs/ppo_toy.py); "
                  f"`--config=FILE --help` lists every field of FILE with its value and meaning.")
            sys.exit(0)
        return  # absl says --config is required
    try:
        config = preflight_lib.load_config(spec)
        if not help_asked:
            preflight_lib.check_overrides(args, config)
    except ConfigError as e:
        fail(str(e))
    if help_asked:
        print(preflight_lib.help_text(config, schema, what=what, config_spec=spec, takes_workdir=takes_workdir))
        extra = [f for module, defined in flags.FLAGS.flags_by_module_dict().items()  # the command's own (plan's)
                 if not any(lib in module for lib in ("absl", "ml_collections", "orbax"))
                 for f in defined if f.name not in ("config", "workdir", "verbose")]
        if extra:
            print("\nOther flags:\n" + "\n".join(f"  --{f.name}: {f.help} (default: {f.default!r})" for f in extra))
        sys.exit(0)


def config_command(run: Callable[[Any, str | None], str | None], *, what: str, schema: type | None = None,
                   default_config: str | None = None, workdir: str | None | bool = None, argv=None) -> None:
    """Runs `run(config, workdir)` as a command line program and prints the line it returns.

    schema: the settings dataclass the config is read into (its field comments are the --help text).
    default_config: config file used without --config (None: --config is required). workdir: the
    default workdir (None: --workdir is required; False: the command takes no workdir).
    """
    preflight(sys.argv if argv is None else argv, what=what, schema=schema, default_config=default_config,
              takes_workdir=workdir is not False)
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
