"""The KV cache's saved form: an in-flight rollout's engine state is saved by tree path with its cache
(`checkpoint.trees.host_arrays_by_path`); one saved before keys and values shared one array
(`KVCache.k` and `KVCache.v`, until 2026-11-29) still resumes."""

import jax
import numpy as np
import pytest

from ppo_jax.checkpoint import trees
from ppo_jax.checkpoint.errors import CheckpointMismatchError
from ppo_jax.models import KVCache, ModelConfig, init_cache
from ppo_jax.models.cache import split_cache, with_joined_kv

CONFIG = ModelConfig(arch="llama", vocab_size=64, hidden_size=16, num_layers=3, num_heads=4, num_kv_heads=2,
                     max_position_embeddings=32)
ROWS, SLOTS = 2, 5


def _abstract_state():
    """An engine state's caches: the stacked one (the prefill's, the scanned decode's) and one per
    layer (the unrolled decode's)."""
    cache = init_cache(CONFIG, ROWS, SLOTS)
    return jax.eval_shape(lambda: {"stacked": cache, "layers": split_cache(cache)})


def test_a_cache_saved_as_separate_keys_and_values_is_read_back_whole():
    rng = np.random.default_rng(0)
    layers, heads, dh = CONFIG.num_layers, CONFIG.kv_heads, CONFIG.dim_per_head
    old = {"['stacked'].k": rng.normal(size=(layers, ROWS, heads, SLOTS, dh)).astype(np.float32),
           "['stacked'].v": rng.normal(size=(layers, ROWS, heads, SLOTS, dh)).astype(np.float32),
           "['stacked'].index": np.int32(3)}
    for i in range(layers):
        old[f"['layers'][{i}].k"] = rng.normal(size=(ROWS, heads, SLOTS, dh)).astype(np.float32)
        old[f"['layers'][{i}].v"] = rng.normal(size=(ROWS, heads, SLOTS, dh)).astype(np.float32)
        old[f"['layers'][{i}].index"] = np.int32(3)
    state = trees.tree_from_host_arrays(with_joined_kv(old), _abstract_state(), np.asarray, what="a saved run")
    assert isinstance(state["stacked"], KVCache)
    np.testing.assert_array_equal(state["stacked"].k, old["['stacked'].k"])
    np.testing.assert_array_equal(state["stacked"].v, old["['stacked'].v"])
    for i, layer in enumerate(state["layers"]):
        np.testing.assert_array_equal(layer.k, old[f"['layers'][{i}].k"])
        np.testing.assert_array_equal(layer.v, old[f"['layers'][{i}].v"])


def test_a_cache_saved_whole_passes_unchanged_and_a_missing_half_is_refused():
    cache = init_cache(CONFIG, ROWS, SLOTS)
    saved = trees.host_arrays_by_path({"stacked": cache, "layers": split_cache(cache)})
    assert with_joined_kv(saved).keys() == saved.keys()
    half = {name: a for name, a in saved.items() if name != "['stacked'].kv"}
    half["['stacked'].k"] = np.zeros((CONFIG.num_layers, ROWS, CONFIG.kv_heads, SLOTS, CONFIG.dim_per_head), np.float32)
    with pytest.raises(CheckpointMismatchError, match=r"\['stacked'\]\.kv saved as None"):
        trees.tree_from_host_arrays(with_joined_kv(half), _abstract_state(), np.asarray, what="a saved run")
