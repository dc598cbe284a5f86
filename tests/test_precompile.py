"""compute.precompile (rl/precompile.py): the programs compiled side by side ahead of the first
iteration are the programs it runs, so that iteration lowers and compiles none of them again."""

import jax
import numpy as np
import pytest
from conftest import make_test_mesh
from tiny_configs import tiny_config

from ppo_jax.config import ConfigError
from ppo_jax.rl import precompile, remat_choice
from ppo_jax.rl.trainer import PPOTrainer

LORA = {"policy.lora.rank": 4, "policy.lora.alpha": 8.0, "value.lora.rank": 4, "value.lora.alpha": 8.0}
LAYOUTS = {
    "one_device": ((1, 1, 1), {}),
    "mesh2x2x2": ((2, 2, 2), {}),
    "lora_mesh1x2x4": ((1, 2, 4), LORA),
    # the sampler on 4 devices of its own, scoring there; bf16 copies of the fp32 weights
    "disaggregated_scoring": ((4, 1, 1), {"roles.sampler_devices": 4, "roles.sampler_mesh": (1, 2, 2),
                                          "roles.scoring": "sampler", "policy.dtype": "bfloat16"}),
    "lora_disaggregated_merged": ((4, 1, 1), {**LORA, "roles.sampler_devices": 4, "roles.sampler_mesh": (1, 2, 2),
                                              "roles.lora_sync": "merged"}),
    "continuous_off_policy": ((1, 1, 1), {"rollout.engine": "continuous", "rollout.off_policy_steps": 1,
                                          "ppo.off_policy_ratio": "truncated_is"}),
}


class Lowerings:
    """The names of the programs jax lowers while it listens (a lowering is what a call whose program
    is not compiled does first; a persistent-cache hit still lowers)."""

    def __init__(self):
        self.names: list[str] = []
        self.on = False
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event: str, secs: float, **kwargs) -> None:
        if self.on and event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            self.names.append(kwargs.get("fun_name", "?"))

    def during(self, fn) -> list[str]:
        """The names lowered while `fn()` runs."""
        self.names, self.on = [], True
        try:
            fn()
        finally:
            self.on = False
        return self.names


@pytest.fixture(scope="module")
def lowerings():
    return Lowerings()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_first_iteration_lowers_none_of_the_programs_compiled_ahead(layout, lowerings, tmp_path):
    shape, overrides = LAYOUTS[layout]
    apart = "roles.sampler_devices" in overrides  # the trainer splits the devices itself
    trainer = PPOTrainer(tiny_config(**{"train.iterations": 2, "compute.precompile": "on", "mesh.shape": shape,
                                        **overrides}), str(tmp_path), mesh=None if apart else make_test_mesh(shape))
    ahead = lowerings.during(trainer.compile_ahead)
    report = trainer.compile_report
    scored_outside = overrides.get("roles.scoring") == "sampler"
    assert sorted(report.seconds) == sorted(["sampler", "experience", "update"] + ["scoring"] * scored_outside)
    assert len(set(ahead)) >= len(report.seconds), ahead
    first = lowerings.during(trainer.run_iteration)
    assert not set(first) & set(ahead), f"lowered ahead and again: {sorted(set(first) & set(ahead))}"
    assert trainer.trace_counts == {"experience": 1, "update": 1} and trainer.sampler.trace_count == 1
    assert trainer.compile_ahead() is None  # once only
    second = lowerings.during(trainer.run_iteration)
    assert not set(second) & set(ahead)
    trainer.close()


def test_a_run_compiled_ahead_trains_as_one_compiled_at_first_call(tmp_path):
    """The same run with compute.precompile on and off: the same metrics, iteration by iteration (the
    programs compiled ahead are the programs, run on the same arrays)."""
    histories = {}
    for setting in ("on", "off"):
        trainer = PPOTrainer(tiny_config(**{"train.iterations": 2, "compute.precompile": setting}),
                             str(tmp_path / setting), mesh=make_test_mesh((1, 1, 1)))
        histories[setting] = trainer.train()
        assert (trainer.compile_report is not None) == (setting == "on")
        trainer.close()
    for on, off in zip(histories["on"], histories["off"]):
        for key in off:
            if not key.startswith(("time/", "perf/")):
                np.testing.assert_array_equal(on[key], off[key], err_msg=key)


def test_partial_rollouts_compile_at_first_call(tmp_path):
    """Segmented decoding runs programs of its own: nothing is compiled ahead for it."""
    trainer = PPOTrainer(tiny_config(**{"train.iterations": 2, "compute.precompile": "on", "rollout.engine": "continuous",
                                        "rollout.partial_rollouts": True, "rollout.off_policy_steps": 1,
                                        "ppo.off_policy_ratio": "truncated_is"}),
                         str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    assert trainer.compile_ahead() is None and trainer.compile_report is None
    trainer.close()


def test_auto_compiles_ahead_off_a_cpu_only():
    assert precompile.applies("auto", "gpu") and precompile.applies("auto", "tpu")
    assert not precompile.applies("auto", "cpu")
    assert precompile.applies("on", "cpu") and not precompile.applies("off", "gpu")
    with pytest.raises(ConfigError, match="compute.precompile='early': use auto, on, off"):
        PPOTrainer(tiny_config(**{"compute.precompile": "early"}), "/nonexistent")


def test_the_remat_choice_ahead_leaves_room_for_the_rollout_and_experience():
    """compute.remat=auto on a GPU chooses the update's remat ahead, before the rollout and the
    experience exist: the memory they will hold is taken from the free memory it is read against."""
    x = jax.ShapeDtypeStruct((256, 256), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    lean = jax.jit(lambda a: (a @ a.T) @ a)  # allocates its [256, 256] fp32 result: 256 KiB
    full = jax.jit(lambda a: a)
    need = remat_choice.allocated_bytes(lean.lower(x).compile())
    held_then = [x] * 4  # 1 MiB, on the same device
    free = int((need + 0.5 * sharding_bytes(held_then)) / remat_choice.MARGIN)  # fits only if they were not counted
    mesh = make_test_mesh((1, 1, 1))
    for held, chosen in (((), "none"), (held_then, "full")):
        update = remat_choice.MemoryChosenUpdate((("none", lean), ("full", full)), free_bytes=lambda: free,
                                                 log=lambda _: None)
        precompile._remat_choice(update, (x,), held, mesh)()
        assert update.chosen == chosen


def sharding_bytes(tree) -> int:
    from ppo_jax import sharding
    return sharding.device_bytes(tree)
