"""Reward-model over-optimisation: one SFT model and one reward model, PPO with several KL coefficients.

    python -m ppo_jax.demo.kl_sweep [--workdir=runs/kl_sweep] [--kl_coefs=0,0.01,0.03,0.1]
                               [--config=configs/demo.py] [--config.ppo.train.iterations=150 ...]

The demo's stages 1-3 run once; stage 4 runs once per coefficient (the config override
`ppo.ppo.kl_coef`), each from the same SFT policy against the same reward model, evaluated by the
hidden gold reward on the same held-out prompts. The plot shows the proxy (reward model) and the gold
reward against iteration and against sqrt(KL) (the x-axis of Gao et al., "Scaling laws for reward model
overoptimization"): with a loose leash the proxy keeps climbing while the gold reward turns down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence

import numpy as np

from ppo_jax.demo import pipeline as demo

DEFAULT_WORKDIR = os.path.join("runs", "kl_sweep")


def run_sweep(config, workdir: str, kl_coefs: Sequence[float], *, mesh=None,
              log=print) -> dict[float, demo.PPOResult]:
    """Stages 1-3 once, then PPO per KL coefficient into <workdir>/ppo_kl<coef>/. Writes sweep.json and
    plots/kl_sweep.png; returns {coef: PPOResult}."""
    world = demo.validate(config)
    demo.prepare_workdir(workdir)
    t0 = time.perf_counter()
    log("[sweep] SFT, preferences, reward model (once)")
    sft = demo.train_sft(config, world, workdir, mesh)
    train_pairs, val_pairs = demo.sample_preferences(config, world, sft.hf_dir, workdir, mesh)
    rm = demo.train_reward_model(config, world, sft.hf_dir, train_pairs, val_pairs, workdir, mesh)
    accuracy = [r for r in rm.history if "eval/accuracy" in r][-1]["eval/accuracy"]
    log(f"[sweep] reward model validation accuracy {accuracy:.1%}")
    results: dict[float, demo.PPOResult] = {}
    for coef in kl_coefs:
        cfg = config.copy_and_resolve_references()
        cfg.ppo.ppo.kl_coef = float(coef)
        log(f"[sweep] PPO with kl_coef={coef:g}")
        run_dir = os.path.join(workdir, f"ppo_kl{coef:g}")
        shutil.rmtree(run_dir, ignore_errors=True)  # a stale checkpoint there would be resumed
        os.makedirs(run_dir)
        results[float(coef)] = demo.train_ppo(cfg, world, sft.hf_dir, rm.hf_dir, run_dir, mesh)
        last = results[float(coef)].evals[-1]
        log(f"[sweep]   gold {last.gold:+.3f}, RM score {last.rm_score:+.2f}, KL {last.kl:.2f}")
    summary = {"rm_val_accuracy": accuracy, "best_gold": world.best_gold, "seconds": time.perf_counter() - t0,
               "runs": {f"{c:g}": [dataclasses.asdict(e) for e in r.evals] for c, r in results.items()}}
    with open(os.path.join(workdir, "sweep.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if config.plots:
        plot_sweep({c: r.evals for c, r in results.items()}, best_gold=world.best_gold,
                   path=os.path.join(workdir, "plots", "kl_sweep.png"))
    return results


def plot_sweep(evals: dict[float, Sequence[demo.EvalPoint]], *, best_gold: float, path: str | None = None):
    """Left: proxy (dashed) and gold (solid) reward against iteration, one colour per KL coefficient.
    Right: both against sqrt(KL to the SFT policy), every evaluation of every run."""
    fig, axes = demo._figure(2, (12, 4.2))
    colors = ["tab:red", "tab:orange", "tab:olive", "tab:green", "tab:blue", "tab:purple", "tab:brown"]
    for (coef, points), color in zip(sorted(evals.items()), colors):
        steps = [e.step for e in points]
        label = f"kl_coef={coef:g}"
        axes[0].plot(steps, [e.gold for e in points], "o-", color=color, label=f"{label}: gold")
        axes[0].plot(steps, [e.rm_score for e in points], "--", color=color, alpha=0.7, label=f"{label}: proxy")
        d = np.sqrt(np.maximum([e.kl for e in points], 0.0))
        axes[1].plot(d, [e.gold for e in points], "o-", color=color, label=f"{label}: gold")
        axes[1].plot(d, [e.rm_score for e in points], "x--", color=color, alpha=0.7, label=f"{label}: proxy")
    for ax in axes:
        ax.axhline(best_gold, color="black", ls=":", lw=1)
        ax.grid(alpha=0.3)
    axes[0].set_xlabel("PPO iteration")
    axes[0].set_ylabel("reward (held-out prompts)")
    axes[0].set_title("gold (solid) and proxy (dashed) against iteration")
    axes[1].set_xlabel("sqrt(KL(policy || SFT))")
    axes[1].set_title("gold and proxy against distance from the SFT policy")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    demo._save(fig, path)
    return fig


def main(argv=None) -> None:
    from absl import app, flags, logging
    from ml_collections import config_flags

    config_flag = config_flags.DEFINE_config_file(
        "config", demo.__file__, "demo config file (get_config()); default: the built-in full demo",
        lock_config=True)
    workdir_flag = flags.DEFINE_string("workdir", DEFAULT_WORKDIR, "directory for every output of the sweep")
    coefs_flag = flags.DEFINE_list("kl_coefs", ["0", "0.01", "0.03", "0.1"], "KL coefficients to sweep")

    def _main(args):
        if len(args) > 1:
            raise app.UsageError(f"unexpected arguments {args[1:]}")
        if not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)
        try:
            coefs = [float(c) for c in coefs_flag.value]
        except ValueError:
            print(f"error: --kl_coefs={','.join(coefs_flag.value)}: use comma-separated numbers", file=sys.stderr)
            sys.exit(2)
        if not coefs or min(coefs) < 0:
            print("error: --kl_coefs needs at least one coefficient, all >= 0", file=sys.stderr)
            sys.exit(2)
        run_sweep(config_flag.value, workdir_flag.value, coefs)

    app.run(_main, argv=argv)


if __name__ == "__main__":
    main()
