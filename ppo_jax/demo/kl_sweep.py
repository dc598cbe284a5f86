"""Reward-model over-optimisation: one SFT model and one reward model, PPO with several KL coefficients.

    python -m ppo_jax.demo.kl_sweep [--workdir=runs/kl_sweep] [--kl_coefs=0,0.01,0.03,0.1]
                                    [--config=configs/demo.py] [--config.ppo.train.iterations=150 ...]

The demo's stages 1-3 run once; stage 4 runs once per coefficient (`ppo.ppo.kl_coef`), each from the
same SFT policy against the same reward model, evaluated by the hidden gold reward on the same held-out
prompts. The plot (`ppo_jax.demo.plots.plot_sweep`) shows the proxy (reward model) and the gold reward
against iteration and against sqrt(KL) (the x-axis of Gao et al., "Scaling laws for reward model
overoptimization"): with a loose leash the proxy keeps climbing while the gold reward turns down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Sequence

from absl import flags

from ppo_jax.cli.common import config_command
from ppo_jax.config import ConfigError
from ppo_jax.demo import default_config
from ppo_jax.demo.pipeline import prepare_workdir, rm_val_accuracy
from ppo_jax.demo.plots import plot_sweep
from ppo_jax.demo.settings import DemoSettings
from ppo_jax.demo.stages import PPOResult, sample_preferences, train_ppo, train_reward_model, train_sft

DEFAULT_WORKDIR = os.path.join("runs", "kl_sweep")
DEFAULT_KL_COEFS = ("0", "0.01", "0.03", "0.1")

__all__ = ["run_sweep", "plot_sweep", "main"]


def run_sweep(config, workdir: str, kl_coefs: Sequence[float], *, mesh=None,
              log=print) -> dict[float, PPOResult]:
    """Stages 1-3 once, then PPO per KL coefficient into <workdir>/ppo_kl<coef>/. Writes sweep.json and
    plots/kl_sweep.png; returns {coef: PPOResult}. config: a demo ConfigDict or `DemoSettings`."""
    settings = DemoSettings.from_config(config)
    world = settings.world
    prepare_workdir(workdir)
    t0 = time.perf_counter()
    log("[sweep] SFT, preferences, reward model (once)")
    sft = train_sft(settings, workdir, mesh)
    train_pairs, val_pairs = sample_preferences(settings, sft.hf_dir, workdir, mesh)
    rm = train_reward_model(settings, sft.hf_dir, train_pairs, val_pairs, workdir, mesh)
    accuracy = rm_val_accuracy(rm.history)
    log(f"[sweep] reward model validation accuracy {accuracy:.1%}")
    results: dict[float, PPOResult] = {}
    for coef in kl_coefs:
        log(f"[sweep] PPO with kl_coef={coef:g}")
        run_dir = os.path.join(workdir, f"ppo_kl{coef:g}")
        shutil.rmtree(run_dir, ignore_errors=True)  # a stale checkpoint there would be resumed
        os.makedirs(run_dir)
        results[float(coef)] = train_ppo(settings.with_kl_coef(coef), sft.hf_dir, rm.hf_dir, run_dir, mesh)
        last = results[float(coef)].evals[-1]
        log(f"[sweep]   gold {last.gold:+.3f}, RM score {last.rm_score:+.2f}, KL {last.kl:.2f}")
    summary = {"rm_val_accuracy": accuracy, "best_gold": world.best_gold, "seconds": time.perf_counter() - t0,
               "runs": {f"{c:g}": [dataclasses.asdict(e) for e in r.evals] for c, r in results.items()}}
    with open(os.path.join(workdir, "sweep.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if settings.plots:
        plot_sweep({c: r.evals for c, r in results.items()}, best_gold=world.best_gold,
                   path=os.path.join(workdir, "plots", "kl_sweep.png"))
    return results


def parse_kl_coefs(values: Sequence[str]) -> list[float]:
    try:
        coefs = [float(c) for c in values]
    except ValueError:
        raise ConfigError(f"--kl_coefs={','.join(values)}: use comma-separated numbers") from None
    if not coefs or min(coefs) < 0:
        raise ConfigError("--kl_coefs needs at least one coefficient, all >= 0")
    return coefs


def main(argv=None) -> None:
    """`python -m ppo_jax.demo.kl_sweep`; without --config: the built-in full demo."""
    coefs_flag = flags.DEFINE_list("kl_coefs", list(DEFAULT_KL_COEFS), "KL coefficients to sweep")

    def sweep(config, workdir: str) -> str:
        coefs = parse_kl_coefs(coefs_flag.value)  # before anything trains
        run_sweep(config, workdir, coefs)
        return f"done: {len(coefs)} PPO runs; {os.path.join(workdir, 'sweep.json')}"

    config_command(sweep, schema=DemoSettings, what="demo", default_config=default_config.__file__,
                   workdir=DEFAULT_WORKDIR, argv=argv)


if __name__ == "__main__":
    main()
