"""The whole RLHF pipeline, offline, on a laptop CPU: SFT -> reward model -> PPO in a synthetic world.

    python -m ppo_jax.demo [--workdir=runs/demo] [--config=configs/demo.py] [--config.ppo.ppo.kl_coef=0.02 ...]

1. SFT: a tiny GPT-2 learns the world's language from a corpus of prompt/response pairs of mixed quality.
2. Preferences: the SFT policy answers each training prompt twice; the hidden gold reward
   (`ppo_jax.demo.world`) labels the pair with Bradley-Terry noise. Validation pairs (held-out prompts)
   are labelled by the gold reward itself, so validation accuracy is accuracy against gold.
3. Reward model: Bradley-Terry on those pairs, from the SFT transformer, normalised so the SFT
   policy's samples score mean 0, std 1.
4. PPO against the reward model with a KL leash to the SFT policy. Every few iterations the policy
   answers held-out prompts and the gold reward - which PPO never sees - judges the answers.
5. With --config.run_dpo=True: DPO from the SFT policy on the same preference pairs (no reward model),
   its final policy judged like PPO's (same prompts, sampling keys, gold reward, KL to the SFT policy).
6. With --config.run_distill=True: a wider teacher SFT'd on gold-best answers, and on-policy
   distillation of the SFT policy toward it with PPO's budget, judged like PPO's
   (`ppo_jax.demo.distill_stages`).

Everything lands in the workdir: per-stage metrics (JSONL + TensorBoard), Orbax checkpoints, Hugging
Face exports, the preference data, PPO samples, before/after samples, PNG plots and summary.json.

This module: the workdir, the stages in order (`ppo_jax.demo.stages`), the summary, the command line.
The config is converted once, here (`DemoSettings.from_config`); the fields: `ppo_jax.demo.settings`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import jax

from ppo_jax.cli.common import config_command
from ppo_jax.config import to_dict
from ppo_jax.demo import default_config
from ppo_jax.demo.distill_stages import train_distill, train_teacher
from ppo_jax.demo.evaluator import EvalPoint
from ppo_jax.demo.plots import plot_ppo, plot_supervised
from ppo_jax.demo.settings import DemoSettings
from ppo_jax.demo.stages import DPOResult, PPOResult, sample_preferences, train_dpo, train_ppo, train_reward_model, train_sft

DEFAULT_WORKDIR = os.path.join("runs", "demo")
MARKER = ".ppo_jax_demo"  # marks a directory the demo may clear and rewrite
STAGE_DIRS = ("sft", "preferences", "reward_model", "ppo", "dpo", "teacher", "distill", "plots")
STAGE_FILES = ("samples_before_after.jsonl", "summary.json", "wandb_run_id")  # (the W&B files under wandb/ stay: an
# offline run not yet synced is the user's)


@dataclasses.dataclass
class DPOSummary:
    """The DPO stage beside PPO: the same held-out prompts, sampling keys and measures."""

    gold: float  # mean gold reward of the final DPO policy
    gap_closed: float  # (dpo_gold - sft_gold) / (best_gold - sft_gold)
    kl: float  # KL(DPO policy || SFT), nats per response
    rm_score: float  # mean reward-model score of its answers (DPO never saw the reward model)
    val_accuracy: float  # DPO's implicit-reward accuracy on the gold-labelled validation pairs


def dpo_summary(dpo: DPOResult, sft_gold: float, best_gold: float) -> DPOSummary:
    val = [r for r in dpo.history if "eval/rewards/accuracies" in r][-1]["eval/rewards/accuracies"]
    return DPOSummary(gold=dpo.final.gold, gap_closed=(dpo.final.gold - sft_gold) / (best_gold - sft_gold),
                      kl=dpo.final.kl, rm_score=dpo.final.rm_score, val_accuracy=float(val))


@dataclasses.dataclass
class DistillSummary:
    """The distillation stages beside PPO: the teacher, and the student on PPO's prompts and sampling keys."""

    teacher_gold: float  # mean gold reward of the teacher's own answers
    teacher_gap_closed: float  # (teacher_gold - sft_gold) / (best_gold - sft_gold)
    gold: float  # mean gold reward of the final distilled policy
    gap_closed: float  # (gold - sft_gold) / (best_gold - sft_gold)
    kl: float  # KL(distilled policy || SFT), nats per response
    teacher_kl: float  # the last iteration's reverse KL to the teacher (objective/teacher_kl), nats per response
    max_rollout_kl: float  # the largest training-rollout KL to the SFT policy


def largest_rollout_kl(history: list[dict]) -> tuple[float, int]:
    """The largest objective/kl of a PPO-trainer stage's training rollouts and its row of `history`
    (from 1; (0.0, 0) without any)."""
    kl, row = max(((r["objective/kl"], i + 1) for i, r in enumerate(history) if "objective/kl" in r),
                  default=(0.0, 0))
    return float(kl), int(row)


def distill_summary(teacher_gold: float, distill: PPOResult, sft_gold: float, best_gold: float) -> DistillSummary:
    gap, final = best_gold - sft_gold, distill.evals[-1]
    teacher_kl = [r["objective/teacher_kl"] for r in distill.history if "objective/teacher_kl" in r]
    return DistillSummary(teacher_gold=teacher_gold, teacher_gap_closed=(teacher_gold - sft_gold) / gap,
                          gold=final.gold, gap_closed=(final.gold - sft_gold) / gap, kl=final.kl,
                          teacher_kl=float(teacher_kl[-1]) if teacher_kl else 0.0,
                          max_rollout_kl=largest_rollout_kl(distill.history)[0])


@dataclasses.dataclass
class DemoResult:
    """The summary table's numbers (also written to summary.json)."""

    rm_val_accuracy: float  # reward-model accuracy on validation pairs labelled by the gold reward
    sft_gold: float  # mean gold reward of the SFT policy on the held-out prompts
    ppo_gold: float  # ... of the final PPO policy
    best_gold: float  # the best achievable gold reward
    gap_closed: float  # (ppo_gold - sft_gold) / (best_gold - sft_gold)
    final_kl: float  # KL(final policy || SFT), nats per response, held-out prompts
    kl_bound: float  # targets.kl_bound
    sft_rm_score: float  # mean reward-model score of the SFT policy's answers (normalised: about 0)
    ppo_rm_score: float  # ... of the final policy's answers
    seconds: dict[str, float]  # wall time per stage and in total
    evals: list[EvalPoint]  # every gold evaluation during PPO
    workdir: str
    targets_met: dict[str, bool]  # rm_accuracy, gap_closed, kl
    dpo: DPOSummary | None = None  # the DPO stage's row (with run_dpo)
    distill: DistillSummary | None = None  # the distillation stages' rows (with run_distill)
    # The largest KL to the SFT policy of any iteration's training rollouts (objective/kl, nats per
    # response) and its iteration: a collapse the final evaluation no longer shows (docs/demo.md).
    max_rollout_kl: float = 0.0
    max_rollout_kl_step: int = 0

    def table(self) -> str:
        kl_row = f"final KL to SFT (bound {self.kl_bound:g})"
        rows = [
            ("reward model val accuracy (vs gold)", f"{self.rm_val_accuracy:.1%}",
             self.targets_met["rm_accuracy"]),
            ("gold reward, SFT policy", f"{self.sft_gold:+.3f}", None),
            ("gold reward, PPO policy", f"{self.ppo_gold:+.3f}", None),
            ("gold reward, best achievable", f"{self.best_gold:+.3f}", None),
            ("share of the gap closed by PPO", f"{self.gap_closed:.1%}", self.targets_met["gap_closed"]),
            ("RM score, SFT -> PPO", f"{self.sft_rm_score:+.2f} -> {self.ppo_rm_score:+.2f}", None),
            (kl_row, f"{self.final_kl:.2f} nats", self.targets_met["kl"]),
            ("largest training-rollout KL", f"{self.max_rollout_kl:.2f} nats (iteration {self.max_rollout_kl_step})",
             None),
            ("wall time", " + ".join(f"{k} {v:.0f}s" for k, v in self.seconds.items() if k != "total")
             + f" = {self.seconds['total']:.0f}s", None),
        ]
        if self.dpo is not None:  # each DPO row under its PPO counterpart
            d = self.dpo
            under = {
                "reward model val accuracy (vs gold)": ("DPO implicit-reward val accuracy (vs gold)",
                                                        f"{d.val_accuracy:.1%}"),
                "gold reward, PPO policy": ("gold reward, DPO policy", f"{d.gold:+.3f}"),
                "share of the gap closed by PPO": ("share of the gap closed by DPO", f"{d.gap_closed:.1%}"),
                "RM score, SFT -> PPO": ("RM score, SFT -> DPO", f"{self.sft_rm_score:+.2f} -> {d.rm_score:+.2f}"),
                kl_row: ("final KL to SFT, DPO", f"{d.kl:.2f} nats"),
            }
            rows = [r for row in rows for r in ([row, (*under[row[0]], None)] if row[0] in under else [row])]
        if self.distill is not None:
            d = self.distill
            rows[-1:-1] = [
                ("gold reward, distillation teacher", f"{d.teacher_gold:+.3f} ({d.teacher_gap_closed:.1%} of the gap)",
                 None),
                ("gold reward, distilled policy", f"{d.gold:+.3f}", None),
                ("share of the gap closed by distillation", f"{d.gap_closed:.1%}", None),
                ("final KL to SFT, distilled", f"{d.kl:.2f} nats (to the teacher {d.teacher_kl:.2f})", None),
            ]
        width = max(len(r[0]) for r in rows)
        lines = []
        for name, value, ok in rows:
            mark = "" if ok is None else ("  ok" if ok else "  MISSED")
            lines.append(f"  {name:<{width}}  {value}{mark}")
        return "\n".join(lines)


def prepare_workdir(workdir: str, *, marker: str = MARKER, outputs: tuple[str, ...] = STAGE_DIRS + STAGE_FILES,
                    made_by: str = "the demo") -> None:
    """Creates the workdir, or clears a previous run's `outputs` in it (a pipeline of stages starts
    over: a stage finished earlier is not taken as this run's). A non-empty directory without
    `marker` is refused (nothing of the user's is ever deleted)."""
    if os.path.isdir(workdir) and os.listdir(workdir):
        if not os.path.exists(os.path.join(workdir, marker)):
            raise FileExistsError(f"workdir {workdir!r} is not empty and was not made by {made_by}; choose "
                                  f"another --workdir (or an empty directory)")
        for name in outputs:
            path = os.path.join(workdir, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                os.remove(path)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, marker), "w") as f:
        f.write(f"written by {made_by}, which may clear this directory's stage outputs\n")


def rm_val_accuracy(history) -> float:
    """The reward model's last validation accuracy (against gold labels)."""
    return float([r for r in history if "eval/accuracy" in r][-1]["eval/accuracy"])


def run(config, workdir: str = DEFAULT_WORKDIR, *, mesh=None, verbose: bool = True) -> DemoResult:
    """SFT -> preferences -> reward model -> PPO -> plots and summary. Returns the summary numbers.

    config: a demo ConfigDict (`get_config()` and overrides) or `DemoSettings`; converted and
    validated here, once, before anything trains."""
    settings = DemoSettings.from_config(config)
    world = settings.world
    t_start = time.perf_counter()
    if jax.process_index() == 0:
        prepare_workdir(workdir)
    log = print if verbose and jax.process_index() == 0 else (lambda *a, **k: None)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    log(f"ppo_jax demo -> {workdir}  ({jax.device_count()} {jax.default_backend()} device(s)"
        + (f", load average {load[0]:.1f}" if load else "") + ")")
    seconds: dict[str, float] = {}

    n = 4 + settings.run_dpo + 2 * settings.run_distill
    log(f"[1/{n}] SFT: a tiny GPT-2 learns the world's language")
    sft = train_sft(settings, workdir, mesh)
    seconds["sft"] = sft.seconds

    log(f"[2/{n}] preferences: SFT answers, labelled by the hidden gold reward")
    t0 = time.perf_counter()
    train_pairs, val_pairs = sample_preferences(settings, sft.hf_dir, workdir, mesh)
    seconds["preferences"] = time.perf_counter() - t0

    log(f"[3/{n}] reward model: Bradley-Terry on {len(train_pairs)} pairs")
    rm = train_reward_model(settings, sft.hf_dir, train_pairs, val_pairs, workdir, mesh)
    seconds["reward_model"] = rm.seconds
    rm_accuracy = rm_val_accuracy(rm.history)

    log(f"[4/{n}] PPO against the reward model (the gold reward only watches)")
    ppo = train_ppo(settings, sft.hf_dir, rm.hf_dir, workdir, mesh)
    seconds["ppo"] = ppo.seconds

    dpo = None
    if settings.run_dpo:
        log(f"[5/{n}] DPO from the SFT policy on the same {len(train_pairs)} pairs (no reward model)")
        dpo = train_dpo(settings, sft.hf_dir, rm.hf_dir, train_pairs, val_pairs, workdir, mesh)
        seconds["dpo"] = dpo.seconds

    distill = teacher = None
    if settings.run_distill:
        k = 5 + settings.run_dpo
        log(f"[{k}/{n}] teacher: a wider GPT-2 SFT'd on the gold-best answers")
        teacher = train_teacher(settings, workdir, mesh)
        seconds["teacher"] = teacher.stage.seconds
        log(f"[{k + 1}/{n}] on-policy distillation toward the teacher, with PPO's budget (no reward model)")
        distill = train_distill(settings, sft.hf_dir, teacher.stage.hf_dir, workdir, mesh)
        seconds["distill"] = distill.seconds

    t = settings.targets
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "samples_before_after.jsonl"), "w") as f:
            for b, a in zip(ppo.before, ppo.after):
                f.write(json.dumps({"prompt": b["prompt"], "sft_response": b["response"], "sft_gold": b["gold"],
                                    "sft_rm_score": b["rm_score"], "ppo_response": a["response"],
                                    "ppo_gold": a["gold"], "ppo_rm_score": a["rm_score"]}) + "\n")
        if settings.plots:
            t0 = time.perf_counter()
            plot_ppo(ppo.history, ppo.evals, best_gold=world.best_gold, kl_bound=t.kl_bound,
                     path=os.path.join(workdir, "plots", "ppo_curves.png"))
            plot_supervised(sft.history, rm.history, os.path.join(workdir, "plots", "sft_reward_model.png"))
            seconds["plots"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_start

    first, last = ppo.evals[0], ppo.evals[-1]
    max_kl, row = largest_rollout_kl(ppo.history)
    # The history holds the iterations this process ran (a resumed run: the last ones), in order.
    max_kl_step = row + settings.ppo.train.iterations - len(ppo.history) if row else 0
    best = world.best_gold
    gap_closed = (last.gold - first.gold) / (best - first.gold)
    result = DemoResult(
        rm_val_accuracy=rm_accuracy, sft_gold=first.gold, ppo_gold=last.gold, best_gold=best,
        gap_closed=gap_closed, final_kl=last.kl, kl_bound=t.kl_bound, sft_rm_score=first.rm_score,
        ppo_rm_score=last.rm_score, seconds=seconds, evals=ppo.evals, workdir=workdir,
        targets_met={"rm_accuracy": rm_accuracy >= t.rm_accuracy, "gap_closed": gap_closed >= t.gap_closed,
                     "kl": last.kl < t.kl_bound},
        dpo=None if dpo is None else dpo_summary(dpo, first.gold, best),
        distill=None if distill is None else distill_summary(teacher.gold, distill, first.gold, best),
        max_rollout_kl=float(max_kl), max_rollout_kl_step=int(max_kl_step))
    if jax.process_index() == 0:
        summary = {k: v for k, v in dataclasses.asdict(result).items() if k != "evals"}
        summary["load_average_at_start"] = list(load) if load else None
        summary["load_average_at_end"] = list(os.getloadavg()) if load else None
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if settings.wandb.enabled:
            _wandb_summary(settings, workdir, summary, ppo)
    log("\nsummary\n" + result.table())
    log(f"\noutputs: {workdir}/plots/ppo_curves.png, {workdir}/samples_before_after.jsonl, "
        f"{workdir}/summary.json")
    return result


def _wandb_summary(settings: DemoSettings, workdir: str, summary: dict, ppo) -> None:
    """The demo's own W&B run beside its stages' (<name>-summary, same group): summary.json's numbers, the
    before/after answers as a table and the PNG plots as images."""
    from ppo_jax.wandb_run import WandbRun  # lazy: wandb is an optional extra

    run = WandbRun.open(settings.stage_wandb("summary", workdir), workdir, config=to_dict(settings), job_type="summary")
    try:
        run.summary(summary)
        run.table(0, "samples_before_after", [
            {"prompt": b["prompt"], "sft_response": b["response"], "sft_gold": b["gold"], "ppo_response": a["response"],
             "ppo_gold": a["gold"]} for b, a in zip(ppo.before, ppo.after)])
        plots = os.path.join(workdir, "plots")
        if os.path.isdir(plots):
            run.images({f"plots/{os.path.splitext(name)[0]}": os.path.join(plots, name)
                        for name in sorted(os.listdir(plots)) if name.endswith(".png")})
    finally:
        run.finish()


def _command(config, workdir: str) -> None:
    run(config, workdir)  # prints its own progress and summary


def main(argv=None) -> None:
    """The demo's command line (`python -m ppo_jax.demo`, console script `ppo-jax-demo`, both through
    `ppo_jax.demo.__main__`, which first picks the allocator); without --config: the built-in demo."""
    config_command(_command, schema=DemoSettings, what="demo", default_config=default_config.__file__,
                   workdir=DEFAULT_WORKDIR, argv=argv)


if __name__ == "__main__":
    main()
