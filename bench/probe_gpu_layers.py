"""Standalone GPU probe: attention kernels, layer-loop structure, remat, fp32 master, decode.

Does NOT import ppo_jax (pure JAX + optax), so it runs whatever state the package is in.
TinyLlama-1.1B shapes (vocab 32000, d 2048, 22 layers, 32/4 heads, Dh 64, MLP 5632), bf16.

    python bench/probe_gpu_layers.py --part attention            # kernel table (one process)
    python bench/probe_gpu_layers.py --part layers               # loop/attn/remat table (one subprocess per config)
    python bench/probe_gpu_layers.py --part layers --configs scan:cudnn_roll:none:16,unrolled:einsum:full:32
    python bench/probe_gpu_layers.py --part decode --configs scan:einsum,unrolled:einsum,unrolled:cudnn_bias,unrolled:pallas8
    python bench/probe_gpu_layers.py --part attention --decode-attn-only     # only the q-length-1 table
    python bench/probe_gpu_layers.py --part attention --tiny     # CPU smoke test, tiny shapes, seconds

Results are printed as a table and written as JSON lines to --out (default: $OUT or /tmp/probe_gpu_layers).
Figures and conclusions from one H100: docs/gpu_probe.md.
A layers config is loop:attn:remat:batch[:fp32], loop in scan|scan2|unrolled|unrolled_stacked,
attn in einsum|xla|cudnn_mask|cudnn_roll|cudnn_packed, remat in none|full|dots_nobatch|dots|names|minimal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from functools import partial

import numpy as np


def shapes(tiny: bool) -> dict:
    if tiny:
        return dict(V=512, D=64, L=3, Hq=4, Hkv=2, Dh=16, F=128, B=2, P=16, R=16, DB=4)
    return dict(V=32000, D=2048, L=22, Hq=32, Hkv=4, Dh=64, F=5632, B=16, P=128, R=128, DB=64)


# ------------------------------------------------------------------------------------------------
# helpers


def out_dir(args) -> str:
    d = args.out or os.environ.get("OUT") or "/tmp/probe_gpu_layers"
    os.makedirs(d, exist_ok=True)
    return d


def emit(args, rec: dict, fname: str):
    line = json.dumps(rec, default=str)
    print("RESULT " + line, flush=True)
    with open(os.path.join(out_dir(args), fname), "a") as f:
        f.write(line + "\n")


def peak_bytes():
    import jax
    try:
        return jax.devices()[0].memory_stats().get("peak_bytes_in_use")
    except Exception:
        return None


def bench(fn, *a, reps=7, inner=1):
    """median seconds of fn(*a) (blocked), after 2 warm-ups; each rep runs it `inner` times."""
    import jax
    for _ in range(2):
        jax.block_until_ready(fn(*a))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            r = fn(*a)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t0) / inner)
    return float(np.median(ts)), float(np.min(ts)), float(np.max(ts))


def short_err(e: Exception) -> str:
    s = f"{type(e).__name__}: {e}"
    s = " ".join(s.split())
    return s[:400]


# ------------------------------------------------------------------------------------------------
# attention implementations. q [B,T,Hq,Dh], k/v [B,S,Hkv,Dh] (BTNH), `aux` holds masks/lengths.


def attn_einsum(q, k, v, mask):
    """The library's style: k/v transposed to [B,K,S,Dh], fp32 scores, finfo.min masking, [B,T,S] mask."""
    import jax
    import jax.numpy as jnp
    b, t, h, dh = q.shape
    kh = k.shape[2]
    k = k.transpose(0, 2, 1, 3)
    v = v.transpose(0, 2, 1, 3)
    qg = q.reshape(b, t, kh, h // kh, dh)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(dh)
    s = jnp.where(mask[:, None, None, :, :], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgts,bksd->btkgd", p, v)
    return o.reshape(b, t, h, dh).astype(q.dtype)


def attn_ref32(q, k, v, mask):
    import jax.numpy as jnp
    return attn_einsum(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask)


def cudnn_packed_attention(q, k, v, pad, is_causal=True):
    """cuDNN packed ('THD'-style) layout via jax's internal API: each left-padded row is two
    segments, [0,pad) and [pad,T); the pad segment only sees itself. Internal API (jax._src)."""
    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as fa
    b, t = q.shape[0], q.shape[1]
    s = k.shape[1]
    pad = pad.astype(jnp.int32)
    has = pad > 0
    q_len = jnp.stack([jnp.where(has, pad, t - pad), jnp.where(has, t - pad, -1)], axis=1).astype(jnp.int32)
    kv_len = jnp.stack([jnp.where(has, pad, s - pad), jnp.where(has, s - pad, -1)], axis=1).astype(jnp.int32)
    q_off = jnp.stack([jnp.zeros_like(pad), jnp.where(has, pad, -1), jnp.full_like(pad, -1)], axis=1)
    kv_off = q_off
    mt = fa.MaskType.PADDING_CAUSAL if is_causal else fa.MaskType.PADDING
    return fa.dot_product_attention(q, k, v, None, None, q_len, kv_len, q_off, kv_off,
                                    scale=1.0 / math.sqrt(q.shape[-1]), mask_type=mt, qkv_layout="BTNH")


def pallas_mha_segids(q, k, v, kmask):
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention as pa
    rep = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, rep, axis=2)
    v = jnp.repeat(v, rep, axis=2)
    return pa.mha(q, k, v, kmask.astype(jnp.int32), sm_scale=1.0 / math.sqrt(q.shape[-1]), causal=True)


def pallas_decode_bksd(q, k, v, start, kv_len, k_splits, interpret=False):
    """Pallas (Triton) split-K decode attention on the library's cache layout [B,K,S,Dh]:
    q [B,1,Hq,Dh]; valid slots [start_b, kv_len_b) per row (left padding handled natively)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import decode_attention as pd
    b, _, hq, dh = q.shape
    kh, s = k.shape[1], k.shape[2]
    qr = q.reshape(b, kh, hq // kh, dh)
    st = jnp.broadcast_to(start[:, None], (b, kh)).astype(jnp.int32)
    kl = jnp.broadcast_to(jnp.asarray(kv_len).reshape(-1, 1), (b, kh)).astype(jnp.int32)
    inner = partial(pd.decode_attn_unbatched, sm_scale=1.0 / math.sqrt(dh), block_h=16,
                    block_k=min(128, s // k_splits), k_splits=k_splits, num_warps=None, num_stages=2,
                    grid=None, interpret=interpret, debug=False, return_residuals=False, normalize_output=True)
    o = jax.vmap(jax.vmap(inner))(qr, k, v, st, kl)
    # the kernel's normalisation promotes to float32 (np.float32 eps); keep the residual stream bf16
    return o.reshape(b, 1, hq, dh).astype(q.dtype)


def roll_left(x, shift, axis=1):
    """roll each row b of x left by shift[b] along `axis` (left padding -> right padding)."""
    import jax.numpy as jnp
    n = x.shape[axis]
    idx = (jnp.arange(n)[None, :] + shift[:, None]) % n  # [B, n]
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=axis)


def roll_right(x, shift, axis=1):
    import jax.numpy as jnp
    n = x.shape[axis]
    idx = (jnp.arange(n)[None, :] - shift[:, None]) % n
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=axis)


def attention_variants():
    """name -> (fn(q,k,v,aux) on *prepared* inputs, layout) where layout 'left' (as given) or
    'rolled' (inputs rolled so padding is on the right; outputs compared after rolling back)."""
    import jax
    import jax.numpy as jnp
    dpa = jax.nn.dot_product_attention

    def m4(aux):
        return aux["mask"][:, None]  # [B,1,T,S]

    def km4(aux):
        return aux["kmask"][:, None, None, :]  # [B,1,1,S]

    def bias(aux, neg):
        b = jnp.where(aux["mask"], 0.0, neg).astype(jnp.bfloat16)
        return b[:, None]

    def kbias_full(aux, neg):
        b = jnp.where(aux["kmask"], 0.0, neg).astype(jnp.bfloat16)[:, None, None, :]
        t = aux["mask"].shape[1]
        return jnp.broadcast_to(b, (b.shape[0], 1, t, b.shape[-1]))

    V = {
        "einsum(a)": (lambda q, k, v, a: attn_einsum(q, k, v, a["mask"]), "left"),
        "xla mask[B,1,T,S]": (lambda q, k, v, a: dpa(q, k, v, mask=m4(a), implementation="xla"), "left"),
        "xla causal+kmask[B,1,1,S]": (lambda q, k, v, a: dpa(q, k, v, mask=km4(a), is_causal=True, implementation="xla"), "left"),
        "xla rolled causal+seqlens": (lambda q, k, v, a: dpa(q, k, v, is_causal=True, query_seq_lengths=a["len"],
                                                             key_value_seq_lengths=a["len"], implementation="xla"), "rolled"),
        "cudnn causal only (WRONG on pads; speed ref)": (lambda q, k, v, a: dpa(q, k, v, is_causal=True, implementation="cudnn"), "left"),
        "cudnn causal+mask[B,1,1,S]": (lambda q, k, v, a: dpa(q, k, v, mask=km4(a), is_causal=True, implementation="cudnn"), "left"),
        "cudnn causal+mask bcast[B,1,T,S]": (lambda q, k, v, a: dpa(q, k, v, mask=jnp.broadcast_to(km4(a), m4(a).shape), is_causal=True, implementation="cudnn"), "left"),
        "cudnn mask[B,1,T,S] (causal in mask)": (lambda q, k, v, a: dpa(q, k, v, mask=m4(a), implementation="cudnn"), "left"),
        "cudnn causal+bias -1e9 [B,1,T,S]": (lambda q, k, v, a: dpa(q, k, v, bias=kbias_full(a, -1e9), is_causal=True, implementation="cudnn"), "left"),
        "cudnn causal+bias -inf [B,1,T,S]": (lambda q, k, v, a: dpa(q, k, v, bias=kbias_full(a, -jnp.inf), is_causal=True, implementation="cudnn"), "left"),
        "cudnn causal+bias [B,1,1,S]": (lambda q, k, v, a: dpa(q, k, v, bias=jnp.where(km4(a), 0.0, -1e9).astype(jnp.bfloat16), is_causal=True, implementation="cudnn"), "left"),
        "cudnn causal+kv_seqlen (left pads: WRONG)": (lambda q, k, v, a: dpa(q, k, v, is_causal=True, key_value_seq_lengths=a["len"], implementation="cudnn"), "left"),
        "cudnn rolled causal+q&kv seqlens": (lambda q, k, v, a: dpa(q, k, v, is_causal=True, query_seq_lengths=a["len"],
                                                                    key_value_seq_lengths=a["len"], implementation="cudnn"), "rolled"),
        "cudnn rolled causal+kv seqlen only": (lambda q, k, v, a: dpa(q, k, v, is_causal=True,
                                                                      key_value_seq_lengths=a["len"], implementation="cudnn"), "rolled"),
        "cudnn rolled, KV repeated to 32 heads": (lambda q, k, v, a: dpa(q, jnp.repeat(k, q.shape[2] // k.shape[2], 2), jnp.repeat(v, q.shape[2] // k.shape[2], 2),
                                                                         is_causal=True, query_seq_lengths=a["len"], key_value_seq_lengths=a["len"], implementation="cudnn"), "rolled"),
        "cudnn packed 2-segment (jax._src)": (lambda q, k, v, a: cudnn_packed_attention(q, k, v, a["pad"]), "left"),
        "pallas triton mha segment_ids (KV repeated)": (lambda q, k, v, a: pallas_mha_segids(q, k, v, a["kmask"]), "left"),
    }
    return V


def attention_part(args):
    import jax
    import jax.numpy as jnp
    sh = shapes(args.tiny)
    B, Hq, Hkv, Dh = sh["B"], sh["Hq"], sh["Hkv"], sh["Dh"]
    T = S = sh["P"] + sh["R"]
    R = 2 if args.tiny else 8  # distinct input sets per timed call (rotates buffers, amortises dispatch)
    rng = np.random.default_rng(0)
    pad = rng.integers(0, sh["P"] - 8, size=B).astype(np.int32)
    pad[0] = 0  # one unpadded row
    pad[1] = sh["P"] - 8  # one heavily padded row
    pad = jnp.asarray(pad)
    kmask = jnp.arange(S)[None, :] >= pad[:, None]
    causal = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]
    mask = causal[None] & kmask[:, None, :]
    qvalid = kmask  # T == S, left padded
    length = (S - pad).astype(jnp.int32)
    aux_left = dict(mask=mask, kmask=kmask, pad=pad, len=length)
    # rolled layout: row b rolled left by pad[b]; valid tokens at [0, len), pads at the end
    kmask_r = jnp.arange(S)[None, :] < length[:, None]
    aux_rolled = dict(mask=causal[None] & kmask_r[:, None, :], kmask=kmask_r, pad=jnp.zeros_like(pad), len=length)

    keys = jax.random.split(jax.random.PRNGKey(1), 4 * R)
    qs = [jax.random.normal(keys[4 * i], (B, T, Hq, Dh), jnp.bfloat16) for i in range(R)]
    ks = [jax.random.normal(keys[4 * i + 1], (B, S, Hkv, Dh), jnp.bfloat16) for i in range(R)]
    vs = [jax.random.normal(keys[4 * i + 2], (B, S, Hkv, Dh), jnp.bfloat16) for i in range(R)]
    dos = [jax.random.normal(keys[4 * i + 3], (B, T, Hq, Dh), jnp.float32) * qvalid[:, :, None, None] for i in range(R)]

    def loss_of(fn, aux):
        def loss(q, k, v, do):
            return jnp.sum(fn(q, k, v, aux).astype(jnp.float32) * do)
        return loss

    # references (fp32 and bf16 einsum) on set 0
    ref32 = jax.jit(lambda q, k, v: attn_ref32(q, k, v, mask))(qs[0], ks[0], vs[0])
    g32 = jax.jit(jax.grad(loss_of(lambda q, k, v, a: attn_ref32(q, k, v, a["mask"]), aux_left), argnums=(0, 1, 2)))(qs[0], ks[0], vs[0], dos[0])
    fname = "attention.jsonl"
    rows = []
    env = dict(kind="env", jax=jax.__version__, devices=[str(d) for d in jax.devices()],
               device_kind=jax.devices()[0].device_kind, B=B, T=T, Hq=Hq, Hkv=Hkv, Dh=Dh, R=R,
               pads=np.asarray(pad).tolist())
    try:
        import jax._src.cudnn.fused_attention_stablehlo as fa
        env["cudnn_version"] = fa.check_cudnn_version()
    except Exception as e:  # noqa: BLE001
        env["cudnn_version"] = short_err(e)
    import inspect
    env["dpa_signature"] = str(inspect.signature(jax.nn.dot_product_attention))
    emit(args, env, fname)

    V = {} if args.decode_attn_only else attention_variants()
    only = set(args.variants.split("|")) if args.variants else None
    fwd_flops = 4.0 * B * T * S * Hq * Dh
    for name, (fn, layout) in V.items():
        if only and name not in only:
            continue
        rec = dict(kind="attn", name=name, layout=layout)
        aux = aux_left if layout == "left" else aux_rolled
        prep = (lambda x: x) if layout == "left" else (lambda x: roll_left(x, pad))
        unprep = (lambda x: x) if layout == "left" else (lambda x: roll_right(x, pad))
        try:
            pq = [prep(x) for x in qs]
            pk = [prep(x) for x in ks]
            pv = [prep(x) for x in vs]
            pdo = [prep(x) for x in dos]
            f1 = jax.jit(lambda q, k, v: fn(q, k, v, aux))
            t0 = time.perf_counter()
            out = jax.block_until_ready(f1(pq[0], pk[0], pv[0]))
            rec["fwd_compile_s"] = time.perf_counter() - t0
            out = unprep(out).astype(jnp.float32)
            qv = qvalid[:, :, None, None]
            d32 = jnp.where(qv, jnp.abs(out - ref32), 0.0)
            rec["fwd_maxdiff_vs_fp32"] = float(jnp.max(d32))
            ein = attn_einsum(qs[0], ks[0], vs[0], mask).astype(jnp.float32)
            rec["fwd_maxdiff_vs_einsum"] = float(jnp.max(jnp.where(qv, jnp.abs(out - ein), 0.0)))
            rec["fwd_all_finite"] = bool(jnp.all(jnp.isfinite(out)))
            fR = jax.jit(lambda qq, kk, vv: [fn(q, k, v, aux) for q, k, v in zip(qq, kk, vv)])
            med, lo, hi = bench(fR, pq, pk, pv, reps=args.reps)
            rec["fwd_us"] = med / R * 1e6
            rec["fwd_tflops_nominal"] = fwd_flops / (med / R) / 1e12
        except Exception as e:  # noqa: BLE001
            rec["fwd_error"] = short_err(e)
            if args.verbose:
                traceback.print_exc()
        if "fwd_error" not in rec:
            try:
                g1 = jax.jit(jax.grad(loss_of(fn, aux), argnums=(0, 1, 2)))
                t0 = time.perf_counter()
                gq, gk, gv = jax.block_until_ready(g1(pq[0], pk[0], pv[0], pdo[0]))
                rec["bwd_compile_s"] = time.perf_counter() - t0
                gq, gk, gv = (unprep(x).astype(jnp.float32) for x in (gq, gk, gv))
                rec["grad_all_finite"] = bool(all(bool(jnp.all(jnp.isfinite(x))) for x in (gq, gk, gv)))
                qv = qvalid[:, :, None, None]
                rec["dq_maxdiff_vs_fp32"] = float(jnp.max(jnp.where(qv, jnp.abs(gq - g32[0]), 0.0)))
                rec["dk_maxdiff_vs_fp32"] = float(jnp.max(jnp.abs(gk - g32[1])))
                rec["dv_maxdiff_vs_fp32"] = float(jnp.max(jnp.abs(gv - g32[2])))
                rec["grad_ref_absmax"] = [float(jnp.max(jnp.abs(x))) for x in g32]
                gR = jax.jit(lambda qq, kk, vv, dd: [jax.grad(loss_of(fn, aux), argnums=(0, 1, 2))(q, k, v, d)
                                                     for q, k, v, d in zip(qq, kk, vv, dd)])
                med, lo, hi = bench(gR, pq, pk, pv, pdo, reps=args.reps)
                rec["fwdbwd_us"] = med / R * 1e6
                rec["fwdbwd_tflops_nominal"] = 3.5 * fwd_flops / (med / R) / 1e12
            except Exception as e:  # noqa: BLE001
                rec["bwd_error"] = short_err(e)
                if args.verbose:
                    traceback.print_exc()
        rows.append(rec)
        emit(args, rec, fname)

    # bf16 einsum vs fp32 reference, for scale of the errors above
    ein = attn_einsum(qs[0], ks[0], vs[0], mask).astype(jnp.float32)
    emit(args, dict(kind="note", einsum_fwd_absmax=float(jnp.max(jnp.abs(ref32))),
                    einsum_vs_fp32_fwd=float(jnp.max(jnp.where(qvalid[:, :, None, None], jnp.abs(ein - ref32), 0.0)))), fname)

    decode_rows = decode_attention(args, sh)
    print_attention_table(rows, decode_rows)


def decode_attention(args, sh):
    """q length 1, B=64, cache S=256, per-row valid slots [pad_b, idx]; 22 calls per jit (a 'step')."""
    import jax
    import jax.numpy as jnp
    B, Hq, Hkv, Dh = sh["DB"], sh["Hq"], sh["Hkv"], sh["Dh"]
    S = sh["P"] + sh["R"]
    NL = sh["L"]
    idx = S - S // 4  # slots [0, idx] written
    rng = np.random.default_rng(1)
    pad = jnp.asarray(rng.integers(0, sh["P"] - 8, size=B).astype(np.int32))
    slots = jnp.arange(S)
    kvalid = (slots[None, :] >= pad[:, None]) & (slots[None, :] <= idx)  # [B,S]
    length = (idx + 1 - pad).astype(jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(2), 3 * NL)
    qs = [jax.random.normal(keys[3 * i], (B, 1, Hq, Dh), jnp.bfloat16) for i in range(NL)]
    ks = [jax.random.normal(keys[3 * i + 1], (B, S, Hkv, Dh), jnp.bfloat16) for i in range(NL)]
    vs = [jax.random.normal(keys[3 * i + 2], (B, S, Hkv, Dh), jnp.bfloat16) for i in range(NL)]
    ks_bksd = [k.transpose(0, 2, 1, 3) for k in ks]  # library cache layout [B,K,S,Dh]
    vs_bksd = [v.transpose(0, 2, 1, 3) for v in vs]
    ks_r = [roll_left(k, pad) for k in ks]  # right-aligned cache: valid slots [0, len)
    vs_r = [roll_left(v, pad) for v in vs]
    dpa = jax.nn.dot_product_attention

    def einsum_cache(q, k, v):  # k,v [B,K,S,Dh] (no transpose, like the library's cache)
        b, t, h, dh = q.shape
        kh = k.shape[1]
        qg = q.reshape(b, t, kh, h // kh, dh)
        s = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(dh)
        s = jnp.where(kvalid[:, None, None, None, :], s, jnp.finfo(jnp.float32).min)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bkgts,bksd->btkgd", p, v).reshape(b, t, h, dh)

    def pallas_gqa(q, k, v):
        from jax.experimental.pallas.ops.gpu import decode_attention as pd
        o = pd.gqa(q[:, 0], k, v, start_idx=pad, kv_seq_len=jnp.full((B,), idx + 1, jnp.int32))
        return o[:, None]

    ref = jax.jit(lambda q, k, v: attn_ref32(q, k, v, kvalid[:, None, :]))(qs[0], ks[0], vs[0]).astype(jnp.float32)
    m4 = kvalid[:, None, None, :]
    variants = {
        "einsum [B,K,S,Dh] cache": (einsum_cache, ks_bksd, vs_bksd),
        "xla mask[B,1,1,S]": (lambda q, k, v: dpa(q, k, v, mask=m4, implementation="xla"), ks, vs),
        "cudnn mask[B,1,1,S]": (lambda q, k, v: dpa(q, k, v, mask=m4, implementation="cudnn"), ks, vs),
        "cudnn bias[B,1,1,S]": (lambda q, k, v: dpa(q, k, v, bias=jnp.where(m4, 0.0, -1e9).astype(jnp.bfloat16), implementation="cudnn"), ks, vs),
        "cudnn right-aligned kv_seqlen": (lambda q, k, v: dpa(q, k, v, key_value_seq_lengths=length, implementation="cudnn"), ks_r, vs_r),
        "xla right-aligned kv_seqlen": (lambda q, k, v: dpa(q, k, v, key_value_seq_lengths=length, implementation="xla"), ks_r, vs_r),
        "pallas gqa start_idx (BSKH in, transposes)": (lambda q, k, v: pallas_gqa(q, k, v), ks, vs),
    }
    for ksp in (4, 8, 16):
        variants[f"pallas split-K [B,K,S,Dh] k_splits={ksp}"] = (
            partial(lambda q, k, v, ksp: pallas_decode_bksd(q, k, v, pad, jnp.full((B,), idx + 1), ksp), ksp=ksp), ks_bksd, vs_bksd)
    rows = []
    cache_bytes = 2 * B * S * Hkv * Dh * 2
    for name, (fn, kk, vv) in variants.items():
        rec = dict(kind="decode_attn", name=name, B=B, S=S, calls=NL)
        try:
            out = jax.jit(fn)(qs[0], kk[0], vv[0]).astype(jnp.float32)
            rec["maxdiff_vs_fp32"] = float(jnp.max(jnp.abs(out - ref)))
            fR = jax.jit(lambda qq, k2, v2: [fn(q, k, v) for q, k, v in zip(qq, k2, v2)])
            med, lo, hi = bench(fR, qs, kk, vv, reps=args.reps)
            rec["us_per_call"] = med / NL * 1e6
            rec["GBps_cache_read"] = cache_bytes / (med / NL) / 1e9
        except Exception as e:  # noqa: BLE001
            rec["error"] = short_err(e)
        rows.append(rec)
        emit(args, rec, "attention.jsonl")
    return rows


def print_attention_table(rows, drows):
    print("\n== attention (B,T=S,Hq,Hkv,Dh as in env; times per call, us) ==")
    print(f"{'variant':48s} {'fwd_us':>8s} {'fb_us':>8s} {'fwd_err':>9s} {'dq_err':>9s} {'dk_err':>9s} {'dv_err':>9s} fin  note")
    for r in rows:
        def g(k, fmt="{:8.1f}"):
            return fmt.format(r[k]) if k in r else "-"
        note = r.get("fwd_error") or r.get("bwd_error") or ""
        fin = ("Y" if r.get("fwd_all_finite") else "N") + ("Y" if r.get("grad_all_finite") else ("N" if "grad_all_finite" in r else "-"))
        print(f"{r['name'][:48]:48s} {g('fwd_us'):>8s} {g('fwdbwd_us'):>8s} {g('fwd_maxdiff_vs_fp32', '{:9.2e}'):>9s} "
              f"{g('dq_maxdiff_vs_fp32', '{:9.2e}'):>9s} {g('dk_maxdiff_vs_fp32', '{:9.2e}'):>9s} {g('dv_maxdiff_vs_fp32', '{:9.2e}'):>9s} {fin:4s} {note[:150]}")
    print("\n== decode attention (q len 1) ==")
    for r in drows:
        print(f"{r['name']:36s} {r.get('us_per_call', float('nan')):8.1f} us  err {r.get('maxdiff_vs_fp32', float('nan')):.2e}  {r.get('error', '')[:150]}")


# ------------------------------------------------------------------------------------------------
# model (pure JAX). params: embed [V,D], layers (stacked dict of [L,...] or list of dicts), ln_f, head.

LAYER_KEYS = ("ln1", "wq", "wk", "wv", "wo", "ln2", "wg", "wu", "wd")


def init_params(key, sh, dtype, stacked=True):
    import jax
    import jax.numpy as jnp
    V, D, L, Hq, Hkv, Dh, F = (sh[k] for k in ("V", "D", "L", "Hq", "Hkv", "Dh", "F"))
    ks = jax.random.split(key, 12)

    def w(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    layers = dict(
        ln1=jnp.ones((L, D), dtype), ln2=jnp.ones((L, D), dtype),
        wq=w(ks[0], (L, D, Hq * Dh), D), wk=w(ks[1], (L, D, Hkv * Dh), D), wv=w(ks[2], (L, D, Hkv * Dh), D),
        wo=w(ks[3], (L, Hq * Dh, D), Hq * Dh), wg=w(ks[4], (L, D, F), D), wu=w(ks[5], (L, D, F), D),
        wd=w(ks[6], (L, F, D), F))
    if not stacked:
        layers = [{k: v[i] for k, v in layers.items()} for i in range(L)]
    return dict(embed=(w(ks[7], (V, D), 1.0) * 0.02).astype(dtype), layers=layers,
                ln_f=jnp.ones((D,), dtype), head=w(ks[8], (D, V), D))


def matmul_params(sh) -> int:
    D, L, Hq, Hkv, Dh, F, V = (sh[k] for k in ("D", "L", "Hq", "Hkv", "Dh", "F", "V"))
    per_layer = D * Hq * Dh * 2 + D * Hkv * Dh * 2 + 3 * D * F
    return L * per_layer + D * V


def rmsnorm(x, w, eps=1e-5):
    import jax
    import jax.numpy as jnp
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(jnp.bfloat16)


def rope_tables(positions, dh):
    import jax.numpy as jnp
    inv = 1.0 / (10000.0 ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    f = positions.astype(jnp.float32)[..., None] * inv
    e = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(e), jnp.sin(e)


def apply_rope(x, cos, sin):
    import jax.numpy as jnp
    x32 = x.astype(jnp.float32)
    h = x.shape[-1] // 2
    rot = jnp.concatenate([-x32[..., h:], x32[..., :h]], axis=-1)
    return (x32 * cos[:, :, None, :] + rot * sin[:, :, None, :]).astype(x.dtype)


def make_attn(name, aux):
    """attention callable (q,k,v)->[B,T,Hq,Dh] for the training model; aux from model_inputs."""
    import jax
    dpa = jax.nn.dot_product_attention
    if name == "einsum":
        return lambda q, k, v: attn_einsum(q, k, v, aux["mask"])
    if name == "xla":
        return lambda q, k, v: dpa(q, k, v, mask=aux["mask"][:, None], implementation="xla")
    if name == "cudnn_mask":
        import jax.numpy as jnp
        m = jnp.broadcast_to(aux["kmask"][:, None, None, :], (aux["kmask"].shape[0], 1) + aux["mask"].shape[1:])
        return lambda q, k, v: dpa(q, k, v, mask=m, is_causal=True, implementation="cudnn")
    if name == "cudnn_roll":  # inputs were rolled at model entry: padding on the right
        return lambda q, k, v: dpa(q, k, v, is_causal=True, query_seq_lengths=aux["len"],
                                   key_value_seq_lengths=aux["len"], implementation="cudnn")
    if name == "cudnn_packed":
        return lambda q, k, v: cudnn_packed_attention(q, k, v, aux["pad"])
    raise ValueError(name)


def layer_fn(x, p, cos, sin, attn, sh):
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name
    B, T, D = x.shape
    Hq, Hkv, Dh = sh["Hq"], sh["Hkv"], sh["Dh"]
    h = rmsnorm(x, p["ln1"])
    q = (h @ p["wq"]).reshape(B, T, Hq, Dh)
    k = (h @ p["wk"]).reshape(B, T, Hkv, Dh)
    v = (h @ p["wv"]).reshape(B, T, Hkv, Dh)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = attn(q, k, v)
    o = checkpoint_name(o, "attn_out")
    x = x + (o.reshape(B, T, Hq * Dh) @ p["wo"])
    h = rmsnorm(x, p["ln2"])
    g = h @ p["wg"]
    u = h @ p["wu"]
    import jax
    x = x + ((jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(jnp.bfloat16) @ p["wd"])
    return x


def remat_policy(name):
    import jax
    cp = jax.checkpoint_policies
    return {
        "full": cp.nothing_saveable,
        "dots_nobatch": cp.dots_with_no_batch_dims_saveable,
        "dots": cp.dots_saveable,
        "names": cp.save_only_these_names("attn_out"),
        "minimal": cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names("attn_out")),
    }[name]


def model_inputs(sh, B, seed=0):
    import jax.numpy as jnp
    T = sh["P"] + sh["R"]
    rng = np.random.default_rng(seed)
    pad = rng.integers(0, sh["P"] - 8, size=B).astype(np.int32)
    pad[0] = 0
    tokens = rng.integers(1, sh["V"], size=(B, T)).astype(np.int32)
    kmask = np.arange(T)[None, :] >= pad[:, None]
    tokens = np.where(kmask, tokens, 0)
    return dict(tokens=jnp.asarray(tokens), kmask=jnp.asarray(kmask), pad=jnp.asarray(pad))


def forward_loss(params, batch, sh, cfg):
    """-mean log p(next token) over real tokens. cfg: loop, attn, remat, fp32 (cast params inside)."""
    import jax
    import jax.numpy as jnp
    tokens, kmask, pad = batch["tokens"], batch["kmask"], batch["pad"]
    B, T = tokens.shape
    if cfg["fp32"]:
        params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    m = kmask.astype(jnp.int32)
    positions = jnp.cumsum(m, axis=-1) - m
    length = (T - pad).astype(jnp.int32)
    if cfg["attn"] == "cudnn_roll":
        # one gather at entry: left padding -> right padding; the loss is order-invariant per row
        tokens, kmask, positions = (roll_left(a, pad) for a in (tokens, kmask, positions))
        aux = dict(len=length)
    else:
        causal = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]
        aux = dict(mask=causal[None] & kmask[:, None, :], kmask=kmask, pad=pad, len=length)
    attn = make_attn(cfg["attn"], aux)
    cos, sin = rope_tables(positions, sh["Dh"])
    x = jnp.take(params["embed"], tokens, axis=0)

    def body(x, p):
        return layer_fn(x, p, cos, sin, attn, sh)

    if cfg["remat"] != "none":
        body = jax.checkpoint(body, policy=remat_policy(cfg["remat"]), prevent_cse=not cfg["loop"].startswith("scan"))
    loop = cfg["loop"]
    if loop in ("scan", "scan2", "scan_full"):
        unroll = {"scan": 1, "scan2": 2, "scan_full": True}[loop]
        x, _ = jax.lax.scan(lambda c, p: (body(c, p), None), x, params["layers"], unroll=unroll)
    elif loop == "unrolled":
        for p in params["layers"]:
            x = body(x, p)
    elif loop == "unrolled_stacked":
        L = params["layers"]["wq"].shape[0]
        for i in range(L):
            x = body(x, {k: v[i] for k, v in params["layers"].items()})
    else:
        raise ValueError(loop)
    h = rmsnorm(x, params["ln_f"])
    logits = jnp.einsum("btd,dv->btv", h[:, :-1], params["head"], preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    tgt = tokens[:, 1:]
    picked = jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    w = (kmask[:, 1:] & kmask[:, :-1]).astype(jnp.float32)
    return -jnp.sum(picked * w) / jnp.sum(w)


def parse_cfg(s):
    parts = s.split(":")
    loop, attn, remat, batch = parts[:4]
    return dict(loop=loop, attn=attn, remat=remat, batch=int(batch), fp32=len(parts) > 4 and parts[4] == "fp32", tag=s)


def layers_child(args, cfg_s):
    import jax
    import jax.numpy as jnp
    import optax
    sh = shapes(args.tiny)
    cfg = parse_cfg(cfg_s)
    rec = dict(kind="layers", cfg=cfg_s, **{k: cfg[k] for k in ("loop", "attn", "remat", "batch", "fp32")})
    try:
        pdtype = jnp.float32 if cfg["fp32"] else jnp.bfloat16
        params = init_params(jax.random.PRNGKey(0), sh, pdtype, stacked=cfg["loop"] != "unrolled")
        opt = optax.adamw(1e-5, weight_decay=0.0)
        opt_state = opt.init(params)
        batch = model_inputs(sh, cfg["batch"])
        jax.block_until_ready((params, opt_state))
        rec["param_state_bytes"] = int(sum(a.nbytes for a in jax.tree.leaves((params, opt_state))))

        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(forward_loss)(params, batch, sh, cfg)
            upd, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, upd), opt_state, loss

        jstep = jax.jit(step, donate_argnums=(0, 1))
        t0 = time.perf_counter()
        lowered = jstep.lower(params, opt_state, batch)
        rec["lower_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        comp = lowered.compile()
        rec["compile_s"] = time.perf_counter() - t0
        try:
            ma = comp.memory_analysis()
            rec["temp_bytes"] = int(ma.temp_size_in_bytes)
            rec["arg_bytes"] = int(ma.argument_size_in_bytes)
        except Exception as e:  # noqa: BLE001
            rec["memory_analysis_error"] = short_err(e)
        losses = []
        for _ in range(2):
            params, opt_state, loss = comp(params, opt_state, batch)
            losses.append(float(loss))
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            params, opt_state, loss = comp(params, opt_state, batch)
            jax.block_until_ready(loss)
            ts.append(time.perf_counter() - t0)
            losses.append(float(loss))
        med = float(np.median(ts))
        N = matmul_params(sh)
        tok = cfg["batch"] * (sh["P"] + sh["R"])
        rec.update(step_ms=med * 1e3, step_ms_min=float(np.min(ts)) * 1e3, step_ms_max=float(np.max(ts)) * 1e3,
                   mfu_6N=6.0 * N * tok / med / 989e12, N_matmul=N, tokens=tok,
                   peak_bytes=peak_bytes(), loss_first=losses[0], loss_last=losses[-1],
                   loss_finite=bool(np.all(np.isfinite(losses))))
    except Exception as e:  # noqa: BLE001
        rec["error"] = short_err(e)
        rec["peak_bytes"] = peak_bytes()
        if args.verbose:
            traceback.print_exc()
    emit(args, rec, "layers.jsonl")


DEFAULT_LAYER_CONFIGS = ",".join([
    "scan:einsum:none:16", "unrolled:einsum:none:16",
    "scan:cudnn_roll:none:16", "scan2:cudnn_roll:none:16", "unrolled:cudnn_roll:none:16",
    "unrolled_stacked:cudnn_roll:none:16",
])


def run_children(args, part, configs, fname):
    recs = []
    for c in configs:
        cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--child", c, "--reps", str(args.reps),
               "--out", out_dir(args)] + (["--tiny"] if args.tiny else []) + (["--verbose"] if args.verbose else [])
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if lines:
                recs.append(json.loads(lines[-1][7:]))
            else:
                rec = dict(kind=part, cfg=c, error=f"child rc={p.returncode}: " + " ".join(p.stderr.split())[-400:])
                recs.append(rec)
                emit(args, rec, fname)
            if args.verbose and p.stderr:
                print(p.stderr[-3000:], file=sys.stderr)
        except subprocess.TimeoutExpired:
            rec = dict(kind=part, cfg=c, error=f"timeout after {args.child_timeout}s")
            recs.append(rec)
            emit(args, rec, fname)
        r = recs[-1]
        print(f"  [{time.perf_counter() - t0:5.1f}s wall] {c}: " + (r.get("error") or
              f"{r.get('step_ms', r.get('ms_per_step', 0)):.2f} ms"), flush=True)
    return recs


def gib(x):
    return "-" if x is None else f"{x / 2**30:.1f}"


def layers_part(args):
    configs = (args.configs or DEFAULT_LAYER_CONFIGS).split(",")
    if args.tiny:
        configs = [c.replace("cudnn_roll", "einsum").replace("cudnn_mask", "einsum").replace("cudnn_packed", "einsum") for c in configs]
    recs = run_children(args, "layers", configs, "layers.jsonl")
    print("\n== training step (value_and_grad + adamw) ==")
    print(f"{'config':38s} {'step_ms':>8s} {'MFU(6N)':>8s} {'peakGiB':>8s} {'tempGiB':>8s} {'compile_s':>9s}  loss")
    for r in recs:
        if "error" in r:
            print(f"{r['cfg']:38s} ERROR {r['error'][:200]}  peak={gib(r.get('peak_bytes'))}")
            continue
        print(f"{r['cfg']:38s} {r['step_ms']:8.1f} {100 * r['mfu_6N']:7.1f}% {gib(r['peak_bytes']):>8s} "
              f"{gib(r.get('temp_bytes')):>8s} {r['compile_s']:9.1f}  {r['loss_first']:.3f}->{r['loss_last']:.3f}")


# ------------------------------------------------------------------------------------------------
# decode: one token per row per step, B rows, KV cache S slots, greedy; n steps in one jit.


def decode_child(args, cfg_s):
    """cfg: loop:attn with loop in scan|unrolled, attn in einsum|cudnn_bias|xla|pallasN (N = k_splits)."""
    import jax
    import jax.numpy as jnp
    sh = shapes(args.tiny)
    loop, attn_name = cfg_s.split(":")[:2]
    B, S, L, Hq, Hkv, Dh, D = sh["DB"], sh["P"] + sh["R"], sh["L"], sh["Hq"], sh["Hkv"], sh["Dh"], sh["D"]
    nsteps = 16 if args.tiny else 64
    start = sh["P"]
    rec = dict(kind="decode", cfg=cfg_s, B=B, S=S, steps=nsteps)
    try:
        params = init_params(jax.random.PRNGKey(0), sh, jnp.bfloat16, stacked=(loop == "scan"))
        rng = np.random.default_rng(3)
        pad = jnp.asarray(rng.integers(0, sh["P"] - 8, size=B).astype(np.int32))
        kv_mask0 = jnp.arange(S)[None, :] >= pad[:, None]
        if attn_name == "einsum" or attn_name.startswith("pallas"):
            cshape = (B, Hkv, S, Dh)  # library layout
        else:
            cshape = (B, S, Hkv, Dh)
        key = jax.random.PRNGKey(5)
        if loop == "scan":
            cache = (jax.random.normal(key, (L,) + cshape, jnp.bfloat16), jax.random.normal(key, (L,) + cshape, jnp.bfloat16) * 0.5)
        else:
            cache = tuple((jax.random.normal(jax.random.fold_in(key, i), cshape, jnp.bfloat16),
                           jax.random.normal(jax.random.fold_in(key, 100 + i), cshape, jnp.bfloat16)) for i in range(L))
        dpa = jax.nn.dot_product_attention

        def attend(q, k, v, vis, idx):  # q [B,1,Hq,Dh], vis [B,S]
            if attn_name.startswith("pallas"):
                return pallas_decode_bksd(q, k, v, pad, jnp.full((B,), idx + 1), int(attn_name[6:] or 8))
            if attn_name == "einsum":
                b = q.shape[0]
                qg = q.reshape(b, 1, Hkv, Hq // Hkv, Dh)
                s = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(Dh)
                s = jnp.where(vis[:, None, None, None, :], s, jnp.finfo(jnp.float32).min)
                p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
                return jnp.einsum("bkgts,bksd->btkgd", p, v).reshape(b, 1, Hq, Dh)
            if attn_name == "cudnn_bias":
                return dpa(q, k, v, bias=jnp.where(vis, 0.0, -1e9).astype(jnp.bfloat16)[:, None, None, :], implementation="cudnn")
            return dpa(q, k, v, mask=vis[:, None, None, :], implementation="xla")

        def write(c, new, idx, layer=None):  # new [B,1,Hkv,Dh]
            if attn_name == "einsum" or attn_name.startswith("pallas"):
                new = new.transpose(0, 2, 1, 3)
                st = (0, 0, idx, 0)
            else:
                st = (0, idx, 0, 0)
            if layer is None:
                return jax.lax.dynamic_update_slice(c, new, st)
            return jax.lax.dynamic_update_slice(c, new[None], (layer,) + st)

        def layer(x, p, ck, cv, idx, cos, sin, vis, li=None):
            b = x.shape[0]
            h = rmsnorm(x, p["ln1"])
            q = (h @ p["wq"]).reshape(b, 1, Hq, Dh)
            k = (h @ p["wk"]).reshape(b, 1, Hkv, Dh)
            v = (h @ p["wv"]).reshape(b, 1, Hkv, Dh)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            ck, cv = write(ck, k, idx, li), write(cv, v, idx, li)
            if li is None:
                kk, vv = ck, cv
            else:
                kk = jax.lax.dynamic_index_in_dim(ck, li, 0, keepdims=False)
                vv = jax.lax.dynamic_index_in_dim(cv, li, 0, keepdims=False)
            o = attend(q, kk, vv, vis, idx)
            x = x + o.reshape(b, 1, Hq * Dh) @ p["wo"]
            h = rmsnorm(x, p["ln2"])
            x = x + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]
            return x, ck, cv

        def one_step(params, cache, tok, idx, pos):
            x = jnp.take(params["embed"], tok, axis=0)[:, None, :]
            cos, sin = rope_tables(pos[:, None], Dh)
            vis = kv_mask0 & (jnp.arange(S)[None, :] <= idx)
            if loop == "scan":
                def body(carry, xs):
                    x, ck, cv = carry
                    p, li = xs
                    x, ck, cv = layer(x, p, ck, cv, idx, cos, sin, vis, li)
                    return (x, ck, cv), None
                (x, ck, cv), _ = jax.lax.scan(body, (x,) + tuple(cache), (params["layers"], jnp.arange(L)))
                cache = (ck, cv)
            else:
                new = []
                for p, (ck, cv) in zip(params["layers"], cache):
                    x, ck, cv = layer(x, p, ck, cv, idx, cos, sin, vis)
                    new.append((ck, cv))
                cache = tuple(new)
            h = rmsnorm(x[:, 0], params["ln_f"])
            logits = h @ params["head"]
            return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)

        def generate(params, cache, tok0):
            pos0 = (start - pad).astype(jnp.int32)

            def body(i, carry):
                cache, tok, acc = carry
                cache, tok = one_step(params, cache, tok, start + i, pos0 + i)
                return cache, tok, acc + tok
            cache, tok, acc = jax.lax.fori_loop(0, nsteps, body, (cache, tok0, jnp.zeros_like(tok0)))
            return cache, acc

        g = jax.jit(generate, donate_argnums=(1,))
        tok0 = jnp.asarray(rng.integers(1, sh["V"], size=B).astype(np.int32))
        t0 = time.perf_counter()
        comp = g.lower(params, cache, tok0).compile()
        rec["compile_s"] = time.perf_counter() - t0
        cache, acc = comp(params, cache, tok0)
        jax.block_until_ready(acc)
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            cache, acc = comp(params, cache, tok0)
            jax.block_until_ready(acc)
            ts.append(time.perf_counter() - t0)
        med = float(np.median(ts))
        wbytes = sum(int(a.nbytes) for a in jax.tree.leaves(params)) - int(params["embed"].nbytes) + B * D * 2
        cache_bytes = 2 * L * B * S * Hkv * Dh * 2  # upper bound: all slots read once
        rec.update(ms_per_step=med / nsteps * 1e3, weight_bytes=wbytes, cache_bytes=cache_bytes,
                   roofline_ms=(wbytes + cache_bytes * (start + nsteps / 2) / S) / 3.35e12 * 1e3,
                   weights_only_roofline_ms=wbytes / 3.35e12 * 1e3,
                   tok_per_s=B / (med / nsteps), peak_bytes=peak_bytes())
        rec["pct_roofline"] = rec["roofline_ms"] / rec["ms_per_step"]
    except Exception as e:  # noqa: BLE001
        rec["error"] = short_err(e)
        if args.verbose:
            traceback.print_exc()
    emit(args, rec, "decode.jsonl")


def decode_part(args):
    configs = (args.configs or "scan:einsum,unrolled:einsum,unrolled:cudnn_bias,unrolled:xla").split(",")
    if args.tiny:
        configs = [c for c in configs if "cudnn" not in c]
    recs = run_children(args, "decode", configs, "decode.jsonl")
    print("\n== decode (B rows, KV cache S, greedy, steps in one jit) ==")
    for r in recs:
        if "error" in r:
            print(f"{r['cfg']:24s} ERROR {r['error'][:200]}")
            continue
        print(f"{r['cfg']:24s} {r['ms_per_step']:7.3f} ms/step  roofline {r['roofline_ms']:.3f} ms "
              f"({100 * r['pct_roofline']:.0f}%)  {r['tok_per_s']:.0f} tok/s  compile {r['compile_s']:.1f}s  peak {gib(r['peak_bytes'])} GiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["attention", "layers", "decode"], required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes; runs on CPU in seconds")
    ap.add_argument("--configs", default=None, help="comma-separated configs (layers/decode)")
    ap.add_argument("--variants", default=None, help="'|'-separated attention variant names to run")
    ap.add_argument("--decode-attn-only", action="store_true", help="attention part: only the q-length-1 table")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-timeout", type=int, default=240)
    ap.add_argument("--out", default=None)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.tiny and not os.environ.get("JAX_PLATFORMS"):
        os.environ["JAX_PLATFORMS"] = "cpu"
    if args.child:
        {"layers": layers_child, "decode": decode_child}[args.part](args, args.child)
        return
    {"attention": attention_part, "layers": layers_part, "decode": decode_part}[args.part](args)


if __name__ == "__main__":
    main()
