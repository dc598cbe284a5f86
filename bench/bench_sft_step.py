"""One SFT optimizer step at the demo's shapes: ppo_jax's jitted step against PyTorch eager, one run.

The demo's stage 1 (`DemoSettings.sft_stage()`: GPT-2, 4 layers, d = 128, 4 heads, the
world's 262-token vocabulary; 64 rows of 34 tokens, the response's 24 positions in the loss) is the
largest share of `python -m ppo_jax.demo`'s wall time after PPO. This asks whether ppo_jax's step is
where a PyTorch user's would be on the same CPU:

  * ppo_jax: `supervised.sft.make_train_step` (forward, token-mean NLL, backward, AdamW behind
    global-norm clipping, the demo's optimizer settings), jitted with the state donated;
  * PyTorch: `transformers.GPT2LMHeadModel` of the same config, `loss.backward()`,
    `clip_grad_norm_`, `torch.optim.AdamW.step()`, torch's default threads.

Both sides see the same random tokens. Each round times --steps steps of one side, then the other, in
two long-lived processes (rounds alternate, so machine load hits both alike); compile and warm-up
steps are left out. Prints each side's median ms per step and the ratio.

    python bench/bench_sft_step.py                  # 3 rounds x 20 steps
    python bench/bench_sft_step.py --rounds 1 --steps 3   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROWS, LENGTH, PROMPT = 64, 34, 10


def batch_arrays(vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens, mask, loss_mask [ROWS, LENGTH]: random ids, every position real, the response's in the loss."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, vocab, (ROWS, LENGTH)).astype(np.int32)
    mask = np.ones((ROWS, LENGTH), np.int32)
    loss_mask = np.zeros((ROWS, LENGTH), np.int32)
    loss_mask[:, PROMPT:] = 1
    return tokens, mask, loss_mask


def demo_sft_settings():
    """The demo's SFT stage settings, as `python -m ppo_jax.demo` runs them."""
    from ppo_jax.demo.settings import DemoSettings, get_config

    return DemoSettings.from_config(get_config()).sft_stage()


def jax_stepper():
    """() -> one ppo_jax SFT step, blocked on its metrics."""
    import jax
    import jax.numpy as jnp

    from ppo_jax.data.tokenization import SFTBatch
    from ppo_jax.models import CausalLM, init_params
    from ppo_jax.models.init import boxed_params
    from ppo_jax.optim import make_optimizer
    from ppo_jax.sharding import make_mesh
    from ppo_jax.supervised import sft
    from ppo_jax.supervised.train_state import init_train_state

    s = demo_sft_settings()
    model = CausalLM(s.model.config)
    mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    params, shardings = init_params(model, jax.random.key(0), mesh)
    tx = make_optimizer(s.optim, s.optim.lr, s.train.steps)
    holder = {"state": init_train_state(params, shardings, boxed_params(model), tx, mesh)[0]}
    batch = SFTBatch(*(jnp.asarray(a) for a in batch_arrays(s.model.config.vocab_size)))
    step = jax.jit(sft.make_train_step(model, tx), donate_argnums=0)

    def run():
        holder["state"], metrics = step(holder["state"], None, batch)
        jax.block_until_ready(metrics)

    return run


def torch_stepper():
    """() -> one PyTorch step of the same model and data."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    s = demo_sft_settings()
    c = s.model.config
    model = GPT2LMHeadModel(GPT2Config(vocab_size=c.vocab_size, n_embd=c.hidden_size, n_layer=c.num_layers,
                                       n_head=c.num_heads, n_positions=c.max_position_embeddings,
                                       bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id))
    opt = torch.optim.AdamW(model.parameters(), lr=s.optim.lr, weight_decay=s.optim.weight_decay)
    tokens, _, loss_mask = batch_arrays(c.vocab_size)
    ids = torch.tensor(tokens, dtype=torch.long)
    labels = ids.clone()
    labels[torch.tensor(loss_mask) == 0] = -100

    def run():
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.optim.max_grad_norm)
        opt.step()
        opt.zero_grad()

    return run


def worker(side: str) -> None:
    """Reads a step count per line on stdin, answers the mean seconds per step as JSON."""
    run = jax_stepper() if side == "jax" else torch_stepper()
    for _ in range(3):  # compile, warm-up
        run()
    print(json.dumps({"ready": side}), flush=True)
    for line in sys.stdin:
        steps = int(line)
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        print(json.dumps({"seconds": (time.perf_counter() - t0) / steps}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OMP_WAIT_POLICY": "PASSIVE"}
    procs = {side: subprocess.Popen([sys.executable, __file__, "--worker", side], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, env=env) for side in ("torch", "jax")}
    for proc in procs.values():
        json.loads(proc.stdout.readline())
    times: dict[str, list[float]] = {side: [] for side in procs}
    for _ in range(a.rounds):
        for side, proc in procs.items():
            proc.stdin.write(f"{a.steps}\n")
            proc.stdin.flush()
            times[side].append(json.loads(proc.stdout.readline())["seconds"])
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    medians = {side: statistics.median(t) * 1e3 for side, t in times.items()}
    for side, t in times.items():
        print(f"{side:6s} ms per step: rounds {[round(x * 1e3, 1) for x in t]}, median {medians[side]:.1f}")
    print(f"PyTorch / ppo_jax: {medians['torch'] / medians['jax']:.2f}x")


if __name__ == "__main__":
    main()
