"""Loader: seeded per-epoch order, gapless epochs, disjoint per-process slices, exact resume."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ppo_jax import data

N = 10


def numbered(n=N):
    return data.from_list([{"prompt": f"p{i}", "i": i} for i in range(n)])


def reference_stream(n, seed, epochs):
    """The documented order, written out: epoch e is default_rng((seed, e)).permutation(n)."""
    return [(e, int(i)) for e in range(epochs)
            for i in np.random.default_rng((seed, e)).permutation(n)]


def run(iterator, steps):
    """(epoch, index) pairs per step."""
    out = []
    for _ in range(steps):
        batch = next(iterator)
        assert [r["i"] for r in batch.records] == batch.indices.tolist()
        out.append(list(zip(batch.epochs.tolist(), batch.indices.tolist())))
    return out


def test_two_processes_see_every_example_exactly_once_per_epoch():
    global_batch, steps = 4, 10  # 40 stream items = 4 epochs of 10; batches straddle epochs
    procs = [data.BatchIterator(numbered(), global_batch, seed=3, process_index=p, process_count=2)
             for p in range(2)]
    assert all(it.local_batch_size == 2 for it in procs)
    per_process = [run(it, steps) for it in procs]
    seen = {}
    for step in range(steps):
        rows0, rows1 = per_process[0][step], per_process[1][step]
        assert not set(rows0) & set(rows1)  # disjoint slices
        for epoch, index in rows0 + rows1:
            seen.setdefault(epoch, []).append(index)
    assert sorted(seen) == [0, 1, 2, 3]
    for epoch, indices in seen.items():
        assert sorted(indices) == list(range(N)), f"epoch {epoch}"
    # Process 0 holds the first half of each global batch, process 1 the second; in order.
    stream = [row for step in range(steps) for row in per_process[0][step] + per_process[1][step]]
    assert stream == reference_stream(N, seed=3, epochs=4)
    # Step 2 covers stream items 8..11: the end of epoch 0 and the start of epoch 1, no gap.
    assert [e for e, _ in per_process[0][2] + per_process[1][2]] == [0, 0, 1, 1]
    # Epochs are reshuffled.
    assert reference_stream(N, 3, 2)[:N] != reference_stream(N, 3, 2)[N:]


def test_restoring_the_state_continues_the_exact_order():
    original = data.BatchIterator(numbered(), 3, seed=11, process_index=0, process_count=1)
    run(original, 7)
    state = json.loads(json.dumps(original.state()))  # what a checkpoint stores
    assert (state["epoch"], state["position"]) == (2, 1)  # 21 items consumed
    expected = run(original, 6)

    resumed = data.BatchIterator(numbered(), 3, seed=11, process_index=0, process_count=1)
    resumed.restore(state)
    assert run(resumed, 6) == expected
    # Resuming with more processes: together they continue the same global order.
    global_batch = 4
    single = data.BatchIterator(numbered(), global_batch, seed=11, process_index=0, process_count=1)
    single.restore(state)
    split = [data.BatchIterator(numbered(), global_batch, seed=11, process_index=p, process_count=2)
             for p in range(2)]
    for it in split:
        it.restore(state)
    for _ in range(5):
        whole = next(single).indices.tolist()
        assert next(split[0]).indices.tolist() + next(split[1]).indices.tolist() == whole
    assert single.state() == split[0].state() == split[1].state()


def test_state_mismatch_and_bad_arguments_are_rejected():
    it = data.BatchIterator(numbered(), 2, seed=1, process_index=0, process_count=1)
    for key, value in (("seed", 2), ("num_examples", 11), ("shuffle", False)):
        other = {**it.state(), key: value}
        with pytest.raises(ValueError, match=f"checkpoint has {key}="):
            it.restore(other)
    with pytest.raises(ValueError, match="out of range"):
        it.restore({"epoch": 0, "position": N})
    with pytest.raises(KeyError, match="lacks"):
        it.restore({"epoch": 0})
    with pytest.raises(ValueError, match="not divisible by the 3 processes"):
        data.BatchIterator(numbered(), 4, process_index=0, process_count=3)
    with pytest.raises(ValueError, match="process_index < process_count"):
        data.BatchIterator(numbered(), 4, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        data.BatchIterator(numbered(), 4, seed=-1, process_index=0, process_count=1)


def test_defaults_come_from_jax_and_order_is_reproducible():
    a = data.BatchIterator(numbered(), 5, seed=0)
    assert (a.process_index, a.process_count, a.local_batch_size) == (0, 1, 5)
    b = data.BatchIterator(numbered(), 5, seed=0)
    c = data.BatchIterator(numbered(), 5, seed=1)
    first = run(a, 4)
    assert first == run(b, 4) and first != run(c, 4)
    unshuffled = data.BatchIterator(numbered(), 4, shuffle=False)
    assert [i for step in run(unshuffled, 3) for _, i in step] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]


def test_dataset_smaller_than_a_batch_wraps_over_several_epochs():
    it = data.BatchIterator(numbered(3), 8, seed=5, process_index=1, process_count=2)
    rows = run(it, 3)  # this process: stream items 4..7, 12..15, 20..23 of 3-example epochs
    stream = reference_stream(3, seed=5, epochs=8)
    assert rows == [stream[4:8], stream[12:16], stream[20:24]]
    assert it.state()["epoch"] == 8 and it.state()["position"] == 0


def test_iterate_once_covers_each_example_once_with_fixed_shapes():
    source = numbered(7)
    batches = [list(data.iterate_once(source, 4, process_index=p, process_count=2)) for p in range(2)]
    assert [len(b) for b in batches] == [2, 2]
    valid = []
    for p in range(2):
        for batch in batches[p]:
            assert len(batch.records) == 2 and batch.indices.shape == (2,)
            valid += batch.indices[batch.valid].tolist()
    assert sorted(valid) == list(range(7))
    assert batches[1][1].valid.tolist() == [True, False]  # stream item 7 is filler


# ---------------------------------------------------------------------------------------------
# PromptLoader: records -> tokenized batches.

WORDS = "a b c d e f g h i j".split()


@pytest.fixture(scope="module")
def tokenizer():
    return data.build_word_tokenizer(WORDS)


def prompt_records(n=12):
    # Prompt i has (i % 6) + 1 words: lengths vary so the buckets matter.
    return [{"prompt": " ".join(WORDS[: (i % 6) + 1]), "response": WORDS[i % 10],
             "chosen": "a b", "rejected": WORDS[i % 10]} for i in range(n)]


def test_prompt_loader_tokenizes_its_rows_and_resumes(tokenizer):
    source = data.from_list(prompt_records())
    make = lambda: data.PromptLoader(
        source, data.PromptTokenizer(tokenizer, max_prompt_length=8, prompt_buckets=(2, 4)),
        global_batch_size=4, seed=7, process_index=1, process_count=2)
    loader = make()
    batches = [next(loader) for _ in range(4)]
    # The rows are the last records' prompts, exactly, left-padded.
    for row, record in enumerate(loader.last_records.records):
        real = batches[-1].tokens[row][batches[-1].mask[row] == 1].tolist()
        assert real == tokenizer(record["prompt"])["input_ids"]
        assert (batches[-1].mask[row][-len(real):] == 1).all()
    assert all(b.tokens.shape[0] == 2 and b.tokens.shape[1] in (2, 4, 8) for b in batches)
    state = loader.state()
    following = [next(loader) for _ in range(3)]
    resumed = make()
    resumed.restore(json.loads(json.dumps(state)))
    for expected in following:
        got = next(resumed)
        np.testing.assert_array_equal(got.tokens, expected.tokens)
        np.testing.assert_array_equal(got.mask, expected.mask)
    metrics = loader.metrics()
    assert metrics["data/epoch"] == pytest.approx(7 * 4 / 12)
    assert metrics["data/num_prompts"] == 14.0  # 7 batches x 2 rows on this process


def test_prompt_loader_agreed_length_and_other_kinds(tokenizer):
    source = data.from_list(prompt_records())
    tok = data.PromptTokenizer(tokenizer, max_prompt_length=8, prompt_buckets=(2, 4),
                               max_response_length=2)
    # The length other processes agreed on wins over this process's own bucket.
    fixed = data.PromptLoader(source, tok, 4, process_index=0, process_count=2,
                              agree_length=lambda n: 8)
    assert next(fixed).tokens.shape == (2, 8)
    sft = next(data.PromptLoader(source, tok, 4, kind="sft", process_index=0, process_count=1))
    assert sft.tokens.shape[0] == 4 and sft.loss_mask.sum() == 4 * 2  # one word + EOS each
    pref = next(data.PromptLoader(source, tok, 4, kind="preference", shuffle=False))
    assert pref.chosen_tokens.shape == pref.rejected_tokens.shape
    with pytest.raises(ValueError, match="kind must be one of"):
        data.PromptLoader(source, tok, 4, kind="rl")
    no_prompt = data.from_list([{"text": "a"}])
    with pytest.raises(KeyError, match=r"list\[0\]: record has no 'prompt' field"):
        next(data.PromptLoader(no_prompt, tok, 1))


# ---------------------------------------------------------------------------------------------
# Two real JAX processes: default process slices and the cross-process length agreement.

WORKER = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                               process_id=int(sys.argv[2]))
    from ppo_jax import data
    words = "a b c d e f g h".split()
    tok = data.PromptTokenizer(data.build_word_tokenizer(words), max_prompt_length=8,
                               prompt_buckets=(2, 4))
    # Unshuffled: process 0 gets the 1-word prompts, process 1 the long ones in step 0.
    records = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "a b c d e"}, {"prompt": "a b c"},
               {"prompt": "c"}, {"prompt": "d"}, {"prompt": "e"}, {"prompt": "f"}]
    loader = data.PromptLoader(data.from_list(records), tok, global_batch_size=4, shuffle=False)
    out = []
    for _ in range(2):
        batch = next(loader)
        out.append({"indices": loader.last_records.indices.tolist(),
                    "shape": list(batch.tokens.shape)})
    print("RESULT " + json.dumps({"process": jax.process_index(), "steps": out}), flush=True)
    jax.distributed.shutdown()
""")


def test_two_real_processes_agree_on_the_padded_length(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    workers = [subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{port}", str(p)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
               for p in range(2)]
    results = {}
    for w in workers:
        stdout, stderr = w.communicate(timeout=120)
        assert w.returncode == 0, stderr[-3000:]
        line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][0]
        result = json.loads(line[len("RESULT "):])
        results[result["process"]] = result["steps"]
    assert [s["indices"] for s in results[0]] == [[0, 1], [4, 5]]
    assert [s["indices"] for s in results[1]] == [[2, 3], [6, 7]]
    # Step 0: process 0 alone would pick bucket 2 (BOS-less 1-token prompts), process 1 bucket 8.
    assert results[0][0]["shape"] == results[1][0]["shape"] == [2, 8]
    assert results[0][1]["shape"] == results[1][1]["shape"] == [2, 2]
