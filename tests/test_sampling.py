"""Rollout sampler: greedy vs transformers.generate, log-probs vs the training forward, distribution
of the drawn tokens, stop tokens, samples per prompt, meshes, recompiles, bf16 cache, and the
text-in/text-out helper (filler rows, odd batches on split meshes).

References nobody here wrote: transformers' generate (PyTorch) for greedy decoding, and float64 NumPy
softmax / top-k / top-p written plainly below for everything random.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from conftest import make_test_mesh

from ppo_jax import sampling, sharding
from ppo_jax.data import PromptTokenizer, build_word_tokenizer
from ppo_jax.models import CausalLM, ModelConfig, init_params, positions_from_mask
from ppo_jax.sampling import SampleOutput, SamplingConfig, make_sampler, sample, truncation_metrics

BATCH, PROMPT_LEN, NEW = 8, 8, 12
PAD = 255  # a real vocabulary entry, never in STOPS
STOPS = tuple(range(3, 255, 8))  # 32 ids: about 1 in 8 draws stops a row


def _model_and_params(arch="gpt2", vocab=256, embed_scale=7.0):
    """Tiny model; the embedding is scaled up so next-token distributions are far from uniform
    (random init gives near-uniform logits, which would hide any dependence on the logits)."""
    config = ModelConfig(arch=arch, vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2 if arch == "llama" else None, max_position_embeddings=64)
    model = CausalLM(config)
    params, shardings = init_params(model, jax.random.key(0), make_test_mesh((1, 1, 1)))
    embed = params["transformer"]["embed"]
    embed["embedding"] = embed["embedding"] * embed_scale
    return model, params, shardings


def _prompts(batch=BATCH, length=PROMPT_LEN, vocab=256, seed=0):
    """Left-padded prompts [batch, length] with lengths from `length` down to 1 (pad id PAD)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab - 1, (batch, length)).astype(np.int32)
    lengths = np.maximum(length - np.arange(batch) % length, 1)
    mask = (np.arange(length)[None, :] >= length - lengths[:, None]).astype(np.int32)
    return np.where(mask == 1, tokens, PAD if vocab > PAD else 0).astype(np.int32), mask


@pytest.fixture(scope="module")
def gpt2():
    return _model_and_params("gpt2")


_jitted_sample = jax.jit(sample, static_argnames=("model", "config"))


def _run(model, params, config, prompts, key=1):
    tokens, mask = prompts
    return jax.device_get(_jitted_sample(params, tokens, mask, jax.random.key(key), model=model,
                                         config=config))


_forwards = {}


def _forward(model):
    """One jitted training forward per model (params, tokens, positions, mask -> logits [B, T, V])."""
    if model not in _forwards:
        _forwards[model] = jax.jit(lambda p, t, pos, m: model.apply({"params": p}, t, pos, m)[0])
    return _forwards[model]


def _training_logits(model, params, out: SampleOutput) -> np.ndarray:
    """Full forward over prompt + response, as the trainer does: logits predicting each response
    token, [R, N, V] float64."""
    tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = np.concatenate([out.prompt_mask, out.mask], axis=1)
    logits = _forward(model)(params, tokens, positions_from_mask(mask), mask)
    lq = out.prompt_tokens.shape[1]
    return np.asarray(logits, np.float64)[:, lq - 1:-1]


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _allowed_reference(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Boolean [..., V]: tokens top-k then top-p keep, computed plainly in float64."""
    allowed = np.ones(scaled.shape, bool)
    flat_scaled = scaled.reshape(-1, scaled.shape[-1])
    flat_allowed = allowed.reshape(-1, scaled.shape[-1])
    for row, allow in zip(flat_scaled, flat_allowed):
        order = np.argsort(-row, kind="stable")
        if top_k:
            allow[order[top_k:]] = row[order[top_k:]] >= row[order[top_k - 1]]  # ties stay
        probs = np.where(allow, np.exp(row - row.max()), 0.0)
        probs /= probs.sum()
        mass_before = 0.0
        for token in order:
            if not allow[token]:
                continue
            if mass_before >= top_p:
                allow[token] = False
            mass_before += probs[token]
    return flat_allowed.reshape(scaled.shape)


def _gather(x, tokens):
    return np.take_along_axis(x, tokens[..., None], axis=-1)[..., 0]


# --------------------------------------------------------------------------------------------
# Samplings shared by several tests (each config compiles once).

STOP_CONFIG = SamplingConfig(max_new_tokens=NEW, pad_token_id=PAD, stop_token_ids=STOPS, temperature=0.7,
                             num_samples=2)
FREE_CONFIG = dataclasses.replace(STOP_CONFIG, stop_token_ids=())
MIN_CONFIG = dataclasses.replace(STOP_CONFIG, min_new_tokens=4)
TOP_P_CONFIG = dataclasses.replace(STOP_CONFIG, top_p=0.8, temperature=1.3)


@pytest.fixture(scope="module")
def stop_run(gpt2):
    model, params, _ = gpt2
    return _run(model, params, STOP_CONFIG, _prompts())


@pytest.fixture(scope="module")
def free_run(gpt2):
    model, params, _ = gpt2
    return _run(model, params, FREE_CONFIG, _prompts())


@pytest.fixture(scope="module")
def min_run(gpt2):
    model, params, _ = gpt2
    return _run(model, params, MIN_CONFIG, _prompts())


@pytest.fixture(scope="module")
def top_p_run(gpt2):
    model, params, _ = gpt2
    return _run(model, params, TOP_P_CONFIG, _prompts())


def _expected_mask(tokens: np.ndarray, stops) -> np.ndarray:
    """1 up to and including the first stop token of each row (plain loop)."""
    mask = np.zeros(tokens.shape, np.int32)
    for r, row in enumerate(tokens):
        for t, token in enumerate(row):
            mask[r, t] = 1
            if token in stops:
                break
    return mask


# --------------------------------------------------------------------------------------------
# Greedy decoding against transformers.


def _hf_model(arch):
    import torch
    import transformers

    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
                                         attn_implementation="eager")
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      attn_implementation="eager")
    return transformers.LlamaForCausalLM(config).eval()


def _hf_greedy(torch_model, prompts, stops) -> np.ndarray:
    """transformers greedy continuation [B, NEW] (PAD after a row's stop, and after all rows stop)."""
    import torch

    tokens, mask = prompts
    with torch.no_grad():
        generated = torch_model.generate(
            torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False, max_new_tokens=NEW, eos_token_id=list(stops) or None, pad_token_id=PAD)
    response = generated[:, tokens.shape[1]:].numpy()
    return np.pad(response, ((0, 0), (0, NEW - response.shape[1])), constant_values=PAD)


@pytest.mark.parametrize("arch, mesh_shape", [("gpt2", (1, 2, 4)), ("llama", (2, 2, 2))])
def test_greedy_matches_transformers_generate(tmp_path, arch, mesh_shape):
    """Same weights (saved by transformers, read by hf.load_model), left-padded batch, fp32, on a
    sharded mesh: token-identical to generate(do_sample=False), also where stop tokens end rows."""
    from ppo_jax.models import hf

    torch_model = _hf_model(arch)
    torch_model.save_pretrained(tmp_path)
    mesh = make_test_mesh(mesh_shape)
    loaded = hf.load_model(tmp_path, mesh)
    prompts = _prompts()
    # Stop ids: two tokens transformers itself produces mid-response, so some rows do stop.
    free = _hf_greedy(torch_model, prompts, ())
    stops = (int(free[0, NEW // 2]), int(free[3, 2]))
    expected = _hf_greedy(torch_model, prompts, stops)

    config = SamplingConfig(max_new_tokens=NEW, pad_token_id=PAD, stop_token_ids=stops, greedy=True,
                            num_samples=1)
    model = CausalLM(loaded.config)
    sampler = make_sampler(model, config, mesh, jax.tree.map(lambda x: x.sharding, loaded.params))
    out = jax.device_get(sampler(loaded.params, *prompts, jax.random.key(0)))
    np.testing.assert_array_equal(out.tokens, expected)
    np.testing.assert_array_equal(out.mask, _expected_mask(expected, stops))
    assert out.stopped.any() and not out.stopped.all()
    # Rows that did not stop: identical to the stop-free continuation all the way.
    np.testing.assert_array_equal(out.tokens[~out.stopped], free[~out.stopped])


# --------------------------------------------------------------------------------------------
# Log-probs.


@pytest.mark.parametrize("run_name, config", [("stop_run", STOP_CONFIG), ("min_run", MIN_CONFIG),
                                               ("top_p_run", TOP_P_CONFIG)])
def test_logprobs_equal_training_forward(gpt2, request, run_name, config):
    model, params, _ = gpt2
    out = request.getfixturevalue(run_name)
    scaled = _training_logits(model, params, out) / config.temperature
    mask = out.mask.astype(bool)
    expected = np.where(mask, _gather(_log_softmax(scaled), out.tokens), 0.0)
    np.testing.assert_allclose(out.logprobs, expected, atol=1e-5, rtol=0)
    assert np.all(out.logprobs[~mask] == 0) and np.all(out.sampling_logprobs[~mask] == 0)


# Every block option of the one decoder at once: Gemma's embedding scale, (1 + w) norms and post norms,
# query scale, attention and final soft-capping, q/k norms, biases, sliding layers (window 4, shorter
# than prompt + response) mixed with full ones, each kind with its own rope base.
EVERY_OPTION = ModelConfig(
    arch="gemma3_text", vocab_size=256, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=12,
    intermediate_size=48, sliding_window=4, sliding_layers=(True, False, True), rope_theta=1e6,
    rope_local_theta=1e4, qk_norm=True, attention_bias=True, attention_out_bias=True, mlp_bias=True,
    scale_embeddings=True, norm_unit_offset=True, post_norms=True, query_pre_attn_scalar=10,
    attn_logit_softcap=5.0, final_logit_softcap=3.0, tie_word_embeddings=False, max_position_embeddings=64)


@pytest.mark.parametrize("scan_layers, unroll_decode", [(True, False), (True, True), (False, None)])
def test_logprobs_equal_training_forward_with_every_block_option(scan_layers, unroll_decode):
    """The KV-cache decode (scanned or layer by layer) gives the training forward's log-probs on the
    newer families' layers too: rollout log-probs == training log-probs (DESIGN.md section 5)."""
    model = CausalLM(EVERY_OPTION.replace(scan_layers=scan_layers))
    params, _ = init_params(model, jax.random.key(0), make_test_mesh((1, 1, 1)))
    params["transformer"]["embed"]["embedding"] = params["transformer"]["embed"]["embedding"] * 7.0
    config = dataclasses.replace(STOP_CONFIG, unroll_layers=unroll_decode)
    out = _run(model, params, config, _prompts())
    scaled = _training_logits(model, params, out) / config.temperature
    mask = out.mask.astype(bool)
    expected = np.where(mask, _gather(_log_softmax(scaled), out.tokens), 0.0)
    np.testing.assert_allclose(out.logprobs, expected, atol=1e-5, rtol=0)
    assert mask.sum(-1).max() > EVERY_OPTION.sliding_window  # the window cut keys during decode


def test_sampling_logprobs_follow_the_truncated_distribution(gpt2, min_run, top_p_run, stop_run):
    """sampling_logprobs: log-probs renormalised over what top-p / min_new_tokens left allowed."""
    model, params, _ = gpt2
    np.testing.assert_array_equal(stop_run.sampling_logprobs, stop_run.logprobs)  # nothing truncates

    scaled = _training_logits(model, params, top_p_run) / TOP_P_CONFIG.temperature
    allowed = _allowed_reference(scaled, 0, TOP_P_CONFIG.top_p)
    mask = top_p_run.mask.astype(bool)
    assert np.all(_gather(allowed, top_p_run.tokens)[mask]), "a token outside the nucleus was drawn"
    truncated = _log_softmax(np.where(allowed, scaled, -np.inf))
    expected = np.where(mask, _gather(truncated, top_p_run.tokens), 0.0)
    np.testing.assert_allclose(top_p_run.sampling_logprobs, expected, atol=1e-5, rtol=0)
    assert np.all(top_p_run.sampling_logprobs[mask] >= top_p_run.logprobs[mask] - 1e-6)
    assert np.any(allowed.sum(-1)[mask] < 256), "top-p never removed anything: test is vacuous"

    scaled = _training_logits(model, params, min_run) / MIN_CONFIG.temperature
    suppressed = np.zeros(scaled.shape, bool)
    suppressed[:, :MIN_CONFIG.min_new_tokens, list(STOPS)] = True
    truncated = _log_softmax(np.where(suppressed, -np.inf, scaled))
    mask = min_run.mask.astype(bool)
    expected = np.where(mask, _gather(truncated, min_run.tokens), 0.0)
    np.testing.assert_allclose(min_run.sampling_logprobs, expected, atol=1e-5, rtol=0)


def test_truncation_metrics(stop_run, top_p_run):
    untruncated = jax.device_get(truncation_metrics(stop_run.logprobs, stop_run.sampling_logprobs, stop_run.mask))
    assert untruncated["sampling/kept_mass"] == pytest.approx(1.0)
    assert untruncated["sampling/log_ratio"] == pytest.approx(0.0)
    truncated = jax.device_get(truncation_metrics(top_p_run.logprobs, top_p_run.sampling_logprobs, top_p_run.mask))
    mask = top_p_run.mask.astype(bool)
    log_kept = (top_p_run.logprobs - top_p_run.sampling_logprobs)[mask]
    assert truncated["sampling/log_ratio"] == pytest.approx(log_kept.mean(), abs=1e-6)
    assert truncated["sampling/kept_mass"] == pytest.approx(np.exp(log_kept).mean(), abs=1e-6)
    assert TOP_P_CONFIG.top_p - 1e-3 <= truncated["sampling/kept_mass"] < 1.0


# --------------------------------------------------------------------------------------------
# Stop tokens, lengths, samples per prompt.


def test_stop_tokens_mask_and_pad(stop_run):
    out = stop_run
    expected_mask = _expected_mask(out.tokens, STOPS)
    np.testing.assert_array_equal(out.mask, expected_mask)
    np.testing.assert_array_equal(out.lengths, expected_mask.sum(-1))
    assert np.all(out.tokens[out.mask == 0] == PAD)
    last = out.tokens[np.arange(len(out.tokens)), out.lengths - 1]
    np.testing.assert_array_equal(out.stopped, np.isin(last, STOPS))
    # Both kinds of rows occur, so both branches were exercised.
    assert out.stopped.any() and not out.stopped.all()
    assert np.all(out.lengths[~out.stopped] == NEW)
    # Several different stop ids ended rows.
    assert len(set(last[out.stopped].tolist())) >= 2


def test_stopping_only_truncates(stop_run, free_run):
    """Each row's randomness is its own: with stop tokens, a row's tokens are the stop-free row's
    tokens cut after the first stop token."""
    mask = stop_run.mask.astype(bool)
    np.testing.assert_array_equal(stop_run.tokens[mask], free_run.tokens[mask])
    np.testing.assert_array_equal(stop_run.logprobs[mask], free_run.logprobs[mask])


def test_rows_that_never_stop(free_run):
    assert np.all(free_run.mask == 1)
    assert np.all(free_run.lengths == NEW)
    assert not free_run.stopped.any()
    assert np.all(free_run.logprobs < 0)


def test_min_new_tokens(min_run):
    m = MIN_CONFIG.min_new_tokens
    assert not np.isin(min_run.tokens[:, :m], STOPS).any()
    np.testing.assert_array_equal(min_run.mask, _expected_mask(min_run.tokens, STOPS))
    assert np.all(min_run.lengths >= m + 1)
    assert min_run.stopped.any()


def test_samples_per_prompt_are_consecutive_rows(gpt2, stop_run):
    """n samples of B prompts == one sample of each prompt repeated n times (same key, same row)."""
    model, params, _ = gpt2
    tokens, mask = _prompts()
    n = STOP_CONFIG.num_samples
    np.testing.assert_array_equal(stop_run.prompt_tokens, np.repeat(tokens, n, axis=0))
    np.testing.assert_array_equal(stop_run.prompt_mask, np.repeat(mask, n, axis=0))
    single = _run(model, params, dataclasses.replace(STOP_CONFIG, num_samples=1),
                  (np.repeat(tokens, n, axis=0), np.repeat(mask, n, axis=0)))
    np.testing.assert_array_equal(single.tokens, stop_run.tokens)
    np.testing.assert_allclose(single.logprobs, stop_run.logprobs, atol=1e-6)
    # The samples of one prompt differ from each other.
    assert np.any(stop_run.tokens[0::2] != stop_run.tokens[1::2], axis=-1).sum() >= BATCH - 1


# --------------------------------------------------------------------------------------------
# Greedy, top-k, the drawn distribution.


def test_top_k_one_equals_greedy(gpt2):
    model, params, _ = gpt2
    greedy = _run(model, params, dataclasses.replace(FREE_CONFIG, greedy=True), _prompts())
    top1 = _run(model, params, dataclasses.replace(FREE_CONFIG, top_k=1), _prompts(), key=7)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)
    np.testing.assert_allclose(top1.logprobs, greedy.logprobs, atol=1e-6)
    np.testing.assert_array_equal(greedy.sampling_logprobs, 0.0)
    np.testing.assert_allclose(top1.sampling_logprobs, 0.0, atol=1e-6)
    # Greedy picks the argmax of the training forward.
    logits = _training_logits(model, params, greedy)
    np.testing.assert_array_equal(greedy.tokens, logits.argmax(-1))


def test_top_k_keeps_only_the_k_most_likely(gpt2):
    model, params, _ = gpt2
    config = dataclasses.replace(FREE_CONFIG, top_k=5, temperature=1.5)
    out = _run(model, params, config, _prompts())
    scaled = _training_logits(model, params, out) / config.temperature
    allowed = _allowed_reference(scaled, 5, 1.0)
    assert np.all(_gather(allowed, out.tokens))
    truncated = _log_softmax(np.where(allowed, scaled, -np.inf))
    np.testing.assert_allclose(out.sampling_logprobs, _gather(truncated, out.tokens), atol=1e-5, rtol=0)
    # Not always the top token: it really samples among the k.
    assert np.mean(out.tokens != scaled.argmax(-1)) > 0.1


# Frequencies of the first drawn token over many rows, on an 8-token vocabulary. With N draws each
# count is Binomial(N, p); the test passes when Pearson's chi-square statistic over the allowed
# tokens is below its 1 - 1e-6 quantile, and every frequency is within 5.5 binomial standard
# deviations of p (a failure chance of about 4e-8 per token for a correct sampler).
DRAWS = 16384


@pytest.fixture(scope="module")
def llama_vocab8():
    return _model_and_params("llama", vocab=8, embed_scale=1.0)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.7), (4, 0.8)])
def test_first_token_frequencies_match_tempered_softmax(llama_vocab8, top_k, top_p):
    model, params, _ = llama_vocab8
    temperature = 0.8
    tokens = np.array([[0, 1, 5, 2, 6]], np.int32)
    mask = np.array([[0, 1, 1, 1, 1]], np.int32)
    config = SamplingConfig(max_new_tokens=1, pad_token_id=0, temperature=temperature, top_k=top_k,
                            top_p=top_p, num_samples=DRAWS)
    out = _run(model, params, config, (tokens, mask), key=3)
    logits = _forward(model)(params, tokens, positions_from_mask(mask), mask)
    scaled = np.asarray(logits, np.float64)[0, -1] / temperature
    probs = np.exp(_log_softmax(scaled))
    allowed = _allowed_reference(scaled, top_k, top_p)
    expected = np.where(allowed, probs, 0.0) / probs[allowed].sum()
    assert 0.05 < expected.max() < 0.9, f"distribution too flat or too peaked to test: {expected}"

    counts = np.bincount(out.tokens[:, 0], minlength=8)
    assert counts[~allowed].sum() == 0, f"drew disallowed tokens: counts {counts}, allowed {allowed}"
    freq = counts / DRAWS
    bound = 5.5 * np.sqrt(expected * (1 - expected) / DRAWS)
    assert np.all(np.abs(freq - expected) <= bound), (freq, expected, bound)
    chi2 = np.sum((counts[allowed] - DRAWS * expected[allowed]) ** 2 / (DRAWS * expected[allowed]))
    assert chi2 < scipy.stats.chi2.ppf(1 - 1e-6, df=allowed.sum() - 1), (chi2, counts, expected)
    np.testing.assert_allclose(out.logprobs[:, 0], np.log(probs[out.tokens[:, 0]]), atol=1e-5)
    np.testing.assert_allclose(out.sampling_logprobs[:, 0], np.log(expected[out.tokens[:, 0]]), atol=1e-5)


# --------------------------------------------------------------------------------------------
# Meshes and compilation.


def test_same_key_same_tokens_on_every_mesh(gpt2, top_p_run, mesh):
    """Sharded over the mesh, the sampler draws exactly what the unsharded one drew; a second call
    with the same shapes reuses the compiled program."""
    model, params, _ = gpt2
    shardings = _shardings_on(model, mesh)
    params = jax.device_put(params, shardings)
    sampler = make_sampler(model, TOP_P_CONFIG, mesh, shardings)
    tokens, mask = _prompts()
    out = jax.device_get(sampler(params, tokens, mask, jax.random.key(1)))
    np.testing.assert_array_equal(out.tokens, top_p_run.tokens)
    np.testing.assert_array_equal(out.mask, top_p_run.mask)
    np.testing.assert_allclose(out.logprobs, top_p_run.logprobs, atol=1e-5)
    again = sampler(params, tokens[::-1].copy(), mask[::-1].copy(), jax.random.key(2))
    jax.block_until_ready(again)
    assert sampler.trace_count == 1 and sampler.jitted._cache_size() == 1
    assert again.tokens.sharding.spec == jax.sharding.PartitionSpec(sharding.BATCH_AXES)


def test_scanned_and_unrolled_decode_agree(gpt2, stop_run):
    """The decode loop over the stacked layers (the default off CPU) and the per-layer unrolled one
    (the CPU default) are the same computation: same tokens, same log-probs."""
    model, params, _ = gpt2
    runs = {unroll: _run(model, params, dataclasses.replace(STOP_CONFIG, unroll_layers=unroll), _prompts())
            for unroll in (False, True)}
    for out in runs.values():
        np.testing.assert_array_equal(out.tokens, stop_run.tokens)
        np.testing.assert_array_equal(out.mask, stop_run.mask)
        np.testing.assert_allclose(out.logprobs, stop_run.logprobs, atol=1e-6)
    assert stop_run.mask.sum() > BATCH  # responses longer than one token: the decode loop ran


@pytest.mark.parametrize("steps_per_sync", [3, 5, 16])
def test_several_steps_per_stop_test_decode_the_same_responses(gpt2, stop_run, free_run, steps_per_sync):
    """K decode steps per test of "every row stopped" (the loop of known trip count XLA:GPU runs
    without a host round trip): N - 1 = 11 steps is no multiple of 3 or 5, and 16 > 11; rows stop
    early (stop_run), and never (free_run: the last column is written by the last real step, not by a
    step past the end)."""
    model, params, _ = gpt2
    for config, reference in ((STOP_CONFIG, stop_run), (FREE_CONFIG, free_run)):
        out = _run(model, params, dataclasses.replace(config, steps_per_sync=steps_per_sync), _prompts())
        np.testing.assert_array_equal(out.tokens, reference.tokens)
        np.testing.assert_array_equal(out.mask, _expected_mask(out.tokens, config.stop_token_ids))
        np.testing.assert_array_equal(out.stopped, reference.stopped)
        np.testing.assert_array_equal(out.lengths, reference.lengths)
        np.testing.assert_allclose(out.logprobs, reference.logprobs, atol=1e-6)
        np.testing.assert_allclose(out.sampling_logprobs, reference.sampling_logprobs, atol=1e-6)
    assert free_run.mask.all() and stop_run.stopped.any()


def test_one_new_token_is_the_prefill_alone(gpt2, free_run):
    """A sibling sampler with max_new_tokens=1 (`Sampler.with_config`) is the prefill and the first
    token's choice, with no decode loop compiled (the benchmark times it to separate the prefill from
    the loop): the same first token and log-prob as the 12-token sampler."""
    model, params, _ = gpt2
    mesh = make_test_mesh((1, 1, 1))
    full = make_sampler(model, FREE_CONFIG, mesh, _shardings_on(model, mesh))
    first = full.with_config(max_new_tokens=1)
    tokens, mask = _prompts()
    out = jax.device_get(first(params, tokens, mask, jax.random.key(1)))
    np.testing.assert_array_equal(out.tokens, free_run.tokens[:, :1])
    np.testing.assert_allclose(out.logprobs, free_run.logprobs[:, :1], atol=1e-6)
    loops = {name: sampler.lower(params, tokens, mask, jax.random.key(1)).compile().as_text().count(" while(")
             for name, sampler in (("full", full), ("first", first))}
    assert loops["first"] < loops["full"], loops  # the prefill's layer scan stays, the decode loop goes
    assert first.mesh is full.mesh and first.config.stop_token_ids == FREE_CONFIG.stop_token_ids


@pytest.mark.parametrize("new, per_sync, steps", [(12, 1, 11), (12, 5, 15), (12, 16, 11), (1, 8, 0), (128, 8, 128)])
def test_decode_steps_count_whole_loop_iterations(new, per_sync, steps):
    """The decode steps a full-length sample runs: N - 1 (the first token is the prefill's) rounded
    up to the loop's K steps per stop test."""
    config = dataclasses.replace(FREE_CONFIG, max_new_tokens=new, steps_per_sync=per_sync)
    assert sampling.loop.decode_steps(config) == steps


def test_gemm_choice_reaches_gpu_programs_only(gpt2, free_run):
    """rollout.gemm is a compiler option of the sampler's program on a GPU (compile-only there:
    tests/test_accelerators.py); on a CPU the program is the default one and draws the same tokens."""
    cublas = dataclasses.replace(FREE_CONFIG, gemm="cublas")
    assert cublas.compiler_options("gpu") == cublas.compiler_options("cuda") == {"xla_gpu_enable_triton_gemm": False}
    assert cublas.compiler_options("cpu") is None and cublas.compiler_options("tpu") is None
    assert FREE_CONFIG.compiler_options("gpu") is None  # auto: XLA's defaults, the same cache key as before
    model, params, _ = gpt2
    mesh = make_test_mesh((1, 1, 1))
    out = jax.device_get(make_sampler(model, cublas, mesh, _shardings_on(model, mesh))(
        params, *_prompts(), jax.random.key(1)))
    np.testing.assert_array_equal(out.tokens, free_run.tokens)


def _shardings_on(model, mesh):
    """Parameter shardings of `model` on `mesh` (from the abstract, logically named tree)."""
    tokens = jnp.zeros((1, 4), jnp.int32)
    mask = jnp.ones((1, 4), jnp.int32)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, positions_from_mask(mask), mask))
    return sharding.tree_shardings(abstract["params"], mesh)


def test_bf16_cache_halves_cache_memory(gpt2):
    model, params, shardings = gpt2
    mesh = make_test_mesh((1, 1, 1))
    tokens, mask = _prompts()
    key = jax.random.key(1)
    temp_bytes, outputs = {}, {}
    for dtype in ("float32", "bfloat16"):
        # The scanned decode (the default off CPU): the unrolled CPU one gives each layer's dots an
        # f32 copy of that layer's cache (XLA:CPU has no bf16 dots), which eats part of the saving.
        config = dataclasses.replace(FREE_CONFIG, cache_dtype=dtype, unroll_layers=False)
        sampler = make_sampler(model, config, mesh, shardings)
        compiled = sampler.lower(params, tokens, mask, key).compile()
        temp_bytes[dtype] = compiled.memory_analysis().temp_size_in_bytes
        outputs[dtype] = jax.device_get(compiled(params, tokens, mask, key))
    mc = model.config
    rows, slots = BATCH * FREE_CONFIG.num_samples, PROMPT_LEN + NEW - 1
    fp32_cache_bytes = 2 * mc.num_layers * rows * slots * mc.kv_heads * mc.dim_per_head * 4
    saved = temp_bytes["float32"] - temp_bytes["bfloat16"]
    # Every cache buffer halves (the prefill cache of B rows and the loop's cache of B * n rows), so
    # the program needs at least half an fp32 cache fewer bytes.
    assert saved >= 0.5 * fp32_cache_bytes, (temp_bytes, fp32_cache_bytes)
    # bf16 keys/values: log-probs still match the fp32 training forward to bf16 rounding.
    out = outputs["bfloat16"]
    scaled = _training_logits(model, params, out) / FREE_CONFIG.temperature
    np.testing.assert_allclose(out.logprobs, _gather(_log_softmax(scaled), out.tokens), atol=5e-2)
    assert np.mean(out.tokens == outputs["float32"].tokens) > 0.5


# --------------------------------------------------------------------------------------------
# Input validation (before anything compiles).


@pytest.mark.parametrize("field, value, message", [
    ("max_new_tokens", 0, "max_new_tokens"),
    ("min_new_tokens", 99, "min_new_tokens"),
    ("temperature", 0.0, "greedy=True"),
    ("top_k", -1, "top_k"),
    ("top_p", 0.0, "top_p"),
    ("num_samples", 0, "num_samples"),
    ("cache_dtype", "int3", "dtype"),
    ("gemm", "tensor_cores", "gemm"),
])
def test_bad_config_is_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(FREE_CONFIG, **{field: value})


def test_bad_inputs_are_rejected(gpt2):
    model, params, shardings = gpt2
    tokens, mask = _prompts()
    with pytest.raises(ValueError, match="stop_token_ids"):
        _run(model, params, dataclasses.replace(FREE_CONFIG, stop_token_ids=(300,)), (tokens, mask))
    with pytest.raises(ValueError, match="prompt_mask shape"):
        _run(model, params, FREE_CONFIG, (tokens, mask[:, 1:]))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        _run(model, params, dataclasses.replace(FREE_CONFIG, max_new_tokens=60), (tokens, mask))
    mesh = make_test_mesh((8, 1, 1))
    sampler = make_sampler(model, FREE_CONFIG, mesh, _shardings_on(model, mesh))
    with pytest.raises(ValueError, match="not a multiple of 8"):
        sampler(params, tokens[:6], mask[:6], jax.random.key(0))
    assert sampler.trace_count == 0


# --------------------------------------------------------------------------------------------
# Text in, text out.

WORDS = "the a cat dog sat ran on mat big small red blue and then home".split()
TEXT_PROMPTS = ["the cat sat", "a dog ran on the mat", "red", "big blue dog and cat", "then home"]  # odd
TEXT_LEN = 8


@pytest.fixture(scope="module")
def word_lm():
    """A tiny GPT-2 over the word tokenizer's vocabulary; stop tokens: EOS and two words, so rows
    both stop and run to the end."""
    tokenizer = build_word_tokenizer(WORDS)
    model, params, _ = _model_and_params("gpt2", vocab=len(tokenizer))
    stops = (tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["cat", "mat"]))
    config = SamplingConfig(max_new_tokens=8, pad_token_id=tokenizer.pad_token_id, stop_token_ids=stops,
                            num_samples=2)
    return tokenizer, model, params, config


def _unsharded(word_lm, prompts, key):
    """Plain `sample` (no mesh, no filler) of exactly these prompts."""
    tokenizer, model, params, config = word_lm
    batch = PromptTokenizer(tokenizer, max_prompt_length=TEXT_LEN).prompts(prompts, length=TEXT_LEN)
    return jax.device_get(_jitted_sample(params, batch.tokens, batch.mask, key, model=model, config=config))


def _plain_texts(tokenizer, tokens, stops) -> list[str]:
    """Words before each row's first stop token, special tokens dropped, joined by spaces."""
    special = set(tokenizer.all_special_ids)
    texts = []
    for row in tokens:
        words = []
        for t in row.tolist():
            if t in stops:
                break
            if t not in special:
                words.append(tokenizer.convert_ids_to_tokens(t))
        texts.append(" ".join(words))
    return texts


_word_samplers = {}


def _sampler_on(word_lm, mesh_shape):
    """One sampler (and placed params) per mesh shape, shared by the tests below: every call they
    make has 8 prompt rows, so each sampler compiles once."""
    if mesh_shape not in _word_samplers:
        _, model, params, config = word_lm
        mesh = make_test_mesh(mesh_shape)
        shardings = _shardings_on(model, mesh)
        sampler = make_sampler(model, config, mesh, shardings)
        _word_samplers[mesh_shape] = sampler, jax.device_put(params, shardings)
    return _word_samplers[mesh_shape]


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2)])
def test_generate_texts_odd_batch_on_split_meshes(word_lm, mesh_shape):
    """5 prompts on meshes that split the batch 8 and 4 ways: the 3 filler rows never show, and every
    real row is what plain sampling of just the 5 prompts (no mesh, key fold_in(key, 0)) gives."""
    tokenizer, _, _, config = word_lm
    sampler, params = _sampler_on(word_lm, mesh_shape)
    key = jax.random.key(5)
    out = sampling.sample_prompts(sampler, params, tokenizer, TEXT_PROMPTS, key, prompt_length=TEXT_LEN)
    texts = sampling.generate_texts(sampler, params, tokenizer, TEXT_PROMPTS, key, prompt_length=TEXT_LEN,
                                    mesh=sampler.mesh)
    expected = _unsharded(word_lm, TEXT_PROMPTS, jax.random.fold_in(key, 0))
    n = config.num_samples
    assert out.tokens.shape == (len(TEXT_PROMPTS) * n, config.max_new_tokens)
    for field in ("prompt_tokens", "prompt_mask", "tokens", "mask", "lengths", "stopped"):
        np.testing.assert_array_equal(getattr(out, field), getattr(expected, field), err_msg=field)
    np.testing.assert_allclose(out.logprobs, expected.logprobs, atol=1e-5)
    # Row i * n + j holds prompt i: no filler row shifted anything.
    prompts_back = tokenizer.batch_decode(out.prompt_tokens, skip_special_tokens=True)
    assert prompts_back == [p for p in TEXT_PROMPTS for _ in range(n)]
    assert texts == _plain_texts(tokenizer, expected.tokens, config.stop_token_ids)
    assert out.stopped.any() and not out.stopped.all()  # both decode paths ran
    assert any(texts) and sampler.trace_count == 1


def test_generate_texts_equals_sampling_the_padded_batch(word_lm):
    """The helper == the sampler on the batch padded by hand (with other filler rows), filler dropped."""
    tokenizer, _, _, config = word_lm
    sampler, params = _sampler_on(word_lm, (8, 1, 1))
    key = jax.random.key(6)
    filled = TEXT_PROMPTS + [TEXT_PROMPTS[0]] * 3
    batch = PromptTokenizer(tokenizer, max_prompt_length=TEXT_LEN).prompts(filled, length=TEXT_LEN)
    tokens, mask = sharding.put_batch((batch.tokens, batch.mask), sampler.mesh)
    direct = jax.device_get(sampler(params, tokens, mask, jax.random.fold_in(key, 0)))
    real = len(TEXT_PROMPTS) * config.num_samples
    texts = sampling.generate_texts(sampler, params, tokenizer, TEXT_PROMPTS, key, prompt_length=TEXT_LEN)
    assert texts == _plain_texts(tokenizer, direct.tokens[:real], config.stop_token_ids)
    assert texts == sampling.decode_responses(tokenizer, jax.tree.map(lambda x: x[:real], direct))
    assert sampler.trace_count == 1


def test_sample_prompts_in_batches(word_lm):
    """batch_size: every call has the same shape (3 prompts + filler -> 8 rows, the last call 2 + 6),
    the call from prompt `start` keyed fold_in(key, start); a PromptTokenizer works as the tokenizer
    and only real prompts go through it; no prompts, no texts."""
    tokenizer, _, _, config = word_lm
    sampler, params = _sampler_on(word_lm, (8, 1, 1))
    key = jax.random.key(7)
    encoder = PromptTokenizer(tokenizer, max_prompt_length=TEXT_LEN)
    out = sampling.sample_prompts(sampler, params, encoder, TEXT_PROMPTS, key, prompt_length=TEXT_LEN,
                                  batch_size=3)
    by_hand = []
    for start in (0, 3):
        chunk = TEXT_PROMPTS[start:start + 3]
        filled = chunk + [TEXT_PROMPTS[1]] * (8 - len(chunk))
        batch = PromptTokenizer(tokenizer, max_prompt_length=TEXT_LEN).prompts(filled, length=TEXT_LEN)
        tokens, mask = sharding.put_batch((batch.tokens, batch.mask), sampler.mesh)
        full = jax.device_get(sampler(params, tokens, mask, jax.random.fold_in(key, start)))
        by_hand.append(jax.tree.map(lambda x, real=len(chunk) * config.num_samples: x[:real], full))
    for field in ("prompt_tokens", "tokens", "mask", "stopped"):
        np.testing.assert_array_equal(getattr(out, field), np.concatenate([getattr(p, field) for p in by_hand]),
                                      err_msg=field)
    assert sampler.trace_count == 1
    assert encoder.num_prompts == len(TEXT_PROMPTS)  # filler rows are not tokenised
    assert sampling.generate_texts(sampler, params, tokenizer, [], key, prompt_length=TEXT_LEN) == []
    with pytest.raises(ValueError, match="sampler's mesh"):
        sampling.sample_prompts(sampler, params, tokenizer, TEXT_PROMPTS, key, prompt_length=TEXT_LEN,
                                mesh=make_test_mesh((1, 1, 1)))
