"""The demo's figures: PPO curves (proxy, gold, KL), SFT loss / reward-model accuracy, and the KL
sweep. Each returns a matplotlib Figure (a notebook displays it inline) and saves a PNG when given a
path."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ppo_jax.demo.evaluator import EvalPoint
from ppo_jax.figures import panels, save


def plot_ppo(history: Sequence[dict[str, float]], evals: Sequence[EvalPoint], *, best_gold: float,
             kl_bound: float | None, path: str | None = None, title: str = "PPO against a learned reward model"):
    """Three panels against PPO iteration: RM score, gold reward, KL to the SFT reference.
    Saved to `path` (PNG) when given; returns the Figure."""
    steps = np.arange(1, len(history) + 1)
    es = [e.step for e in evals]
    fig, axes = panels(3, (14 / 3, 3.8))
    ax = axes[0]
    ax.plot(steps, [h["objective/model_scores"] for h in history], color="tab:blue", alpha=0.5,
            label="training rollouts")
    ax.plot(es, [e.rm_score for e in evals], "o-", color="tab:blue", label="held-out prompts")
    ax.set_title("reward-model score (proxy)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.plot(es, [e.gold for e in evals], "o-", color="tab:green", label="PPO policy")
    ax.axhline(evals[0].gold, color="gray", ls=":", label="SFT policy")
    ax.axhline(best_gold, color="black", ls="--", label="best achievable")
    ax.set_title("gold reward (hidden, held-out prompts)")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.plot(steps, [h["objective/kl"] for h in history], color="tab:red", alpha=0.5, label="training rollouts")
    ax.plot(es, [e.kl for e in evals], "o-", color="tab:red", label="held-out prompts")
    if kl_bound is not None:
        ax.axhline(kl_bound, color="black", ls="--", label="bound")
    ax.set_title("KL(policy || SFT), nats per response")
    ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("PPO iteration")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    save(fig, path)
    return fig


def plot_supervised(sft_history, rm_history, path: str | None = None):
    """SFT loss and reward-model accuracy against step; saved to `path` when given; returns the Figure."""
    fig, axes = panels(2, (5, 3.6))
    ax = axes[0]
    rows = [r for r in sft_history if "train/loss" in r]
    ax.plot([r["step"] for r in rows], [r["train/loss"] for r in rows], label="train")
    ev = [r for r in sft_history if "eval/loss" in r]
    ax.plot([r["step"] for r in ev], [r["eval/loss"] for r in ev], "o-", label="held out")
    ax.set_title("SFT: response-token NLL")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    ax = axes[1]
    rows = [r for r in rm_history if "train/accuracy" in r]
    ax.plot([r["step"] for r in rows], [r["train/accuracy"] for r in rows], label="train (noisy labels)")
    ev = [r for r in rm_history if "eval/accuracy" in r]
    ax.plot([r["step"] for r in ev], [r["eval/accuracy"] for r in ev], "o-", label="validation (gold labels)")
    ax.axhline(0.5, color="gray", ls=":")
    ax.set_title("reward model: pairwise accuracy")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save(fig, path)
    return fig


def plot_sweep(evals: dict[float, Sequence[EvalPoint]], *, best_gold: float, path: str | None = None):
    """Left: proxy (dashed) and gold (solid) reward against iteration, one colour per KL coefficient.
    Right: both against sqrt(KL to the SFT policy), every evaluation of every run."""
    fig, axes = panels(2, (6, 4.2))
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
    save(fig, path)
    return fig
