"""Every test sees 8 fake CPU devices; mesh fixtures cover the shapes DESIGN.md names; the preference
trainers' tests (DPO, reward model) share a word tokenizer, a tiny exported "SFT model" and a tiny config."""

import os
import tempfile

# Must happen before JAX initialises its backends.
# The tiny test programs run for milliseconds but compile for seconds: LLVM's optimisation of the
# CPU kernels is a quarter of a cold suite's time, so tests skip it (the HLO passes -- fusion, layout,
# sharding -- still run, so the programs are the same; values agree with an optimised build to
# rounding). The whole suite from a cold cache on 2 cores: 13:48 instead of 18:09 (2026-11-25).
# XLA's CPU fusion emitters (MLIR) are the other half of a compile: the older elemental emitters
# compile the same fused HLO in half the time (one 2x2x2-mesh trainer iteration from a cold cache:
# 63 s -> 29 s of compiling, 2026-11-28). A run that sets its own level or emitters keeps them;
# subprocesses that compile take TEST_XLA_FLAGS (below) too.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_cpu_use_fusion_emitters" not in _flags:
    _flags += " --xla_cpu_use_fusion_emitters=false"
# For a subprocess whose programs run long enough that XLA's optimisation of the CPU kernels pays (the
# demo's ~1,000 optimizer steps: 3x faster than at -O0), LLVM's -O1: the reduced demo's steps ran as fast
# as at XLA's default -O3 and its compiles took ~16 s less, 68 s against 84 s from a cold cache, with the
# same results to the last digit (docs/benchmarks.md, "The test suite's time", 2026-12-01).
OPTIMISED_TEST_XLA_FLAGS = _flags.strip()
if "xla_backend_optimization_level" not in _flags:
    OPTIMISED_TEST_XLA_FLAGS += " --xla_backend_optimization_level=1"
    _flags += " --xla_backend_optimization_level=0"
TEST_XLA_FLAGS = _flags.strip()  # without a device count: a subprocess names its own
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite builds the same tiny trainers many times over (and in subprocesses): JAX's persistent
# compilation cache, keyed by the program's content, compiles each program once. Halves the suite.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"ppo_jax_tests_xla_cache_{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# glibc as it comes, not `import ppo_jax`'s tuning (ppo_jax/host_memory.py): its one arena keeps XLA's
# large temporaries mapped, which the tests' tiny programs never have, and makes XLA's compile threads
# wait on one lock (the demo's programs compiled ~25 % slower, docs/benchmarks.md, "A cold run's compile").
# The demo fixture, whose 1,000 steps do have them, keeps the tuning; test_host_memory tests it.
os.environ.setdefault("PPO_JAX_HOST_MALLOC", "system")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import worker_crashes  # noqa: E402

# xdist's controller hooks: the test a worker crashed in is rerun alone (tests/worker_crashes.py)
pytest_handlecrashitem = worker_crashes.pytest_handlecrashitem
pytest_terminal_summary = worker_crashes.pytest_terminal_summary

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_finish(session):
    # The command lines' GC settings (cli/common.fewer_gc_passes), once the tests are collected, so
    # that what the imports left (torch, transformers, jax) is frozen out of every later collection:
    # one trainer test 10% faster from a cold cache (55.8 -> 50.8 s), 15% warm (29.5 -> 25 s).
    from ppo_jax.cli.common import fewer_gc_passes

    fewer_gc_passes()

# pytest-xdist (`-n 2`) hands each worker whole files, the slowest first. Its default ("load") sends
# runs of consecutive tests, so a file landed on both workers: a module fixture (the demo's pipeline,
# a trainer the tests read) ran twice, and both compiled the same programs at once. Whole files,
# longest first, leave no worker alone with a long file at the end. The order: each file's seconds
# in a cold-cache run on 2 cores (docs/benchmarks.md, "The test suite's time"; 2026-11-28), those
# over a minute; the others run after them in collection order. Before, the multi-process and
# notebook files (the two longest) were unnamed, so they ran last, together, on a loaded machine;
# the notebook now comes 4th, so that it starts after the multi-process file rather than beside it.
SLOWEST_FILES = (
    "test_multihost.py", "test_roles.py", "test_trainer.py", "test_notebook.py", "test_rollout_kinds.py",
    "test_demo.py", "test_moe.py", "test_reliability.py", "test_multi_turn_trainer.py", "test_accelerators.py",
    "test_partial_rollouts.py", "test_hf.py", "test_router_replay.py", "test_packing.py", "test_lora_ppo.py",
    "test_lora_value.py", "test_off_policy_pipeline.py", "test_guide_hf_models.py", "test_checkpoint_layout.py",
    "test_lost_peer.py", "test_checkpoint.py", "test_sampling.py", "test_lora.py", "test_plan.py",
    "test_continuous.py", "test_sweep.py", "test_compute.py", "test_context_axis.py", "test_dynamic_sampling.py",
    "test_multi_turn_partial.py", "test_reference_dtype.py", "test_cli.py", "test_distillation.py",
    "test_multi_turn_slots.py", "test_multi_turn.py", "test_dpo.py",
)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":  # another --dist chosen on the command line: xdist's own
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SlowestFilesFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node):
            def rank(path):
                name = os.path.basename(path)
                return SLOWEST_FILES.index(name) if name in SLOWEST_FILES else len(SLOWEST_FILES)

            first = min(self.workqueue, key=rank)  # ties: the queue's (collection) order
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

        def remove_node(self, node):
            # A crashed worker's files go back to the queue. xdist (3.8) also re-queues the test it
            # crashed in, already reported as failed: the replacement worker then hung (2026-11-28).
            # So the crashed test is marked done here; worker_crashes runs it again in a process of
            # its own.
            crashitem = super().remove_node(node)
            for scope, unit in list(self.workqueue.items()):
                if crashitem in unit:
                    unit[crashitem] = True
                if all(unit.values()):
                    del self.workqueue[scope]
            return crashitem

    return SlowestFilesFirst(config, log)

MESH_SHAPES = [(1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]


def make_test_mesh(shape):
    from ppo_jax import sharding

    n = int(np.prod(shape))
    return sharding.make_mesh(shape, jax.devices()[:n])


def varied_rollout(vocab: int, seed: int = 3):
    """A hand-made PPO `Rollout` of the tiny config's shape (32 rows, prompts and responses of 8 slots) with
    varied prompt and response lengths (a response may be empty), as NumPy arrays."""
    from ppo_jax.rl.state import Rollout

    rng = np.random.default_rng(seed)
    lq, lr, b = 8, 8, 32
    q, r = rng.integers(1, lq + 1, b), rng.integers(0, lr + 1, b)
    prompt_mask = (np.arange(lq)[None, :] >= lq - q[:, None]).astype(np.int32)
    mask = (np.arange(lr)[None, :] < r[:, None]).astype(np.int32)
    zeros = np.zeros((b, lr), np.float32)
    return Rollout(prompt_tokens=(rng.integers(1, vocab, (b, lq)) * prompt_mask).astype(np.int32),
                   prompt_mask=prompt_mask, tokens=(rng.integers(1, vocab, (b, lr)) * mask).astype(np.int32),
                   mask=mask, sampler_logprobs=zeros, behaviour_logprobs=zeros, stopped=r < lr,
                   host_scores=rng.standard_normal(b).astype(np.float32))


def train_and_check_nothing_moved(trainer) -> None:
    """DESIGN.md §5, lr = 0 changes nothing: a trainer built with zero learning rates trains and ends
    with its parameters bit for bit as they were, the policy at KL 0 to its reference and ratio 1."""
    before = jax.device_get((trainer.state.policy, trainer.state.value))
    history = trainer.train()
    after = jax.device_get((trainer.state.policy, trainer.state.value))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    for row in history:
        assert row["objective/kl"] == 0.0
        assert abs(row["val/ratio"] - 1.0) < 1e-6
        assert row["policy/approxkl_avg"] < 1e-12


@pytest.fixture
def segment_clocks(monkeypatch):
    """The segment clocks the slot rollouts of this test make, in order (`slot_rollout.SegmentClock`
    filing itself here), for environments that step a multiple of what the rollout measures: slower
    than a segment at any machine load. `scripted_envs.SlowerScripted` reads them too."""
    import scripted_envs

    from ppo_jax.agentic import slot_rollout

    made = []

    class Filed(slot_rollout.SegmentClock):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(slot_rollout, "SegmentClock", Filed)
    monkeypatch.setattr(scripted_envs, "SEGMENT_CLOCKS", made)
    return made


@pytest.fixture(params=MESH_SHAPES, ids=lambda s: "mesh" + "x".join(map(str, s)))
def mesh(request):
    """Each mesh shape in turn (data, fsdp, tensor)."""
    return make_test_mesh(request.param)


@pytest.fixture
def mesh_1():
    return make_test_mesh((1, 1, 1))


@pytest.fixture
def mesh_8():
    return make_test_mesh((2, 2, 2))


# The preference tests' words: prompts of w-words and a "?", answers that say "good" or "bad".
PREFERENCE_WORDS = [f"w{i}" for i in range(40)] + ["good", "bad", "?", "."]


def preference_tokenizer():
    from ppo_jax.data import build_word_tokenizer

    return build_word_tokenizer(PREFERENCE_WORDS)


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    """A tiny causal LM over PREFERENCE_WORDS exported as a Hugging Face directory (the 'SFT model' the
    DPO policy and the reward model start from)."""
    from ppo_jax.models import CausalLM, ModelConfig, hf, init_params

    tok = preference_tokenizer()
    cfg = ModelConfig(vocab_size=48, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=32,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    params, _ = init_params(CausalLM(cfg), jax.random.key(1), make_test_mesh((1, 1, 1)))
    out = tmp_path_factory.mktemp("sft") / "hf"
    hf.export_model(out, cfg, params, kind="causal_lm", tokenizer=tok)
    return str(out)


def tiny_supervised_config(config, model_path="", **overrides):
    """An SFT, DPO or reward-model config (`config`, its defaults) shrunk to sft_dir's model size: 4
    steps of 16 records; overrides as {"section.field": value}."""
    config.model.path = model_path
    config.model.config.vocab_size = 48
    config.model.config.hidden_size = 32
    config.model.config.num_heads = 2
    config.model.config.max_position_embeddings = 32
    config.data.max_prompt_length = 6
    config.data.max_response_length = 8
    config.train.batch_size = 16
    config.train.steps = 4
    config.train.progress = False
    config.train.log_every = 1
    config.optim.lr = 1e-3
    config.optim.warmup_steps = 0
    for key, value in overrides.items():
        section, field = key.split(".")
        config[section][field] = value
    return config
