"""Triton kernels against plain-torch references over random shapes.

Used by tests/test_gpu_kernels.py on CUDA (bf16 and fp32) and by
tests/test_triton_interpret.py on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, fp32, fewer shapes). Each check raises AssertionError
with the shape that failed.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from tidyrun.attention.metadata import list_tiles, tile_shape
from tidyrun.model.layers import apply_rope


def reference_attention(q, k_cache, v_cache, q_lens, seq_lens, tables, scale, window=None):
    """Per-sequence dense causal GQA attention over keys gathered from the pages (``window``: keys within
    the last ``window`` positions only)."""
    out, start = [], 0
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    for n, total, table in zip(q_lens, seq_lens, tables):
        keys = k_cache[table].flatten(0, 1)[:total].float().repeat_interleave(heads // kv_heads, dim=1)
        vals = v_cache[table].flatten(0, 1)[:total].float().repeat_interleave(heads // kv_heads, dim=1)
        qs = q[start:start + n].float()
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        pos = torch.arange(total - n, total)[:, None]
        keys_at = torch.arange(total)[None, :]
        scores = scores.masked_fill(keys_at > pos, float("-inf"))
        if window is not None:
            scores = scores.masked_fill(keys_at <= pos - window, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals))
        start += n
    return torch.cat(out)


def check_attention(device, dtype, cases, seed=0, atol=2e-2, splits=(1, 4), windows=(None,)):
    rng = random.Random(seed)
    for heads, kv_heads, head_dim, block_size, q_lens, ctx_lens in cases:
        seq_lens = [c + n for n, c in zip(q_lens, ctx_lens)]
        blocks_per_seq = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3
        perm = list(range(num_blocks))
        rng.shuffle(perm)
        tables, i = [], 0
        for nb in blocks_per_seq:
            tables.append(perm[i:i + nb])
            i += nb
        g = torch.Generator().manual_seed(seed)
        # Unwritten slots hold NaN/inf/huge values: the kernel must not let them through.
        k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
        v_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("inf"))
        for table, total in zip(tables, seq_lens):
            flat = torch.tensor(table)[:, None] * block_size + torch.arange(block_size)
            flat = flat.flatten()[:total]
            k_cache.view(-1, kv_heads, head_dim)[flat] = torch.randn(total, kv_heads, head_dim, generator=g)
            v_cache.view(-1, kv_heads, head_dim)[flat] = torch.randn(total, kv_heads, head_dim, generator=g)
        q = torch.randn(sum(q_lens), heads, head_dim, generator=g)
        scale = head_dim ** -0.5
        block_q, block_m = tile_shape(heads // kv_heads, max(q_lens))
        tile_seq, tile_q0 = list_tiles(q_lens, block_q)
        for window in windows:
            expected = reference_attention(q, k_cache, v_cache, q_lens, seq_lens, tables, scale, window)
            for n_split in (splits if block_q == 1 else (1,)):
                _run_attention(device, dtype, q, k_cache, v_cache, tables, blocks_per_seq, q_lens, seq_lens, scale,
                               block_q, block_m, tile_seq, tile_q0, n_split, expected, atol,
                               f"{heads}/{kv_heads} heads, D={head_dim}, block {block_size}, q_lens {q_lens}, "
                               f"ctx {ctx_lens}, splits {n_split}, window {window}", window)


def _run_attention(device, dtype, q, k_cache, v_cache, tables, blocks_per_seq, q_lens, seq_lens, scale, block_q,
                   block_m, tile_seq, tile_q0, splits, expected, atol, label, window=None):
    from tidyrun.kernels.attention import paged_attention

    bt = torch.zeros(len(tables), max(blocks_per_seq) + 1, dtype=torch.int32)
    for b, t in enumerate(tables):
        bt[b, :len(t)] = torch.tensor(t)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    to = dict(device=device)
    out = torch.empty(q.shape, dtype=dtype, **to)
    paged_attention(q.to(dtype=dtype, **to), k_cache.to(dtype=dtype, **to), v_cache.to(dtype=dtype, **to), out,
                    torch.tensor(tile_seq, dtype=torch.int32, **to), torch.tensor(tile_q0, dtype=torch.int32, **to),
                    qsl.to(**to), torch.tensor(seq_lens, dtype=torch.int32, **to), bt.to(**to), scale,
                    block_q, block_m, splits, window)
    err = (out.float().cpu() - expected).abs().max().item()
    assert err <= atol, f"attention {label}: max error {err}"


def check_attention_invariance(device, dtype, heads=9, kv_heads=3, head_dim=64, block_size=16, length=300,
                               windows=(None, 37), seed=0, atol=0.0):
    """With batch-invariant tiles, a token decoded alone (one query, its keys in the cache) gets the bits it
    gets as one row of a prefill over the whole sequence: what makes greedy output batched equal alone and
    speculation on equal off. ``atol``: under Triton's interpreter, whose dots are numpy's and round a row
    differently with other rows beside it (1 ulp, depending on the machine's BLAS), the same keys and masks
    are checked to a tolerance; on the GPU the bits (``atol=0``)."""
    from tidyrun.kernels.attention import paged_attention

    g = torch.Generator().manual_seed(seed)
    to = dict(device=device, dtype=dtype)
    blocks = -(-length // block_size)
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(**to)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(**to)
    q = torch.randn(length, heads, head_dim, generator=g).to(**to)
    table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    for window in windows:
        block_q, block_m = tile_shape(heads // kv_heads, length, batch_invariant=True)
        seqs, starts = list_tiles([length], block_q)
        full = torch.empty_like(q)
        paged_attention(q, k_cache, v_cache, full, i32(seqs), i32(starts), i32([0, length]), i32([length]), table,
                        head_dim ** -0.5, block_q, block_m, 1, window)
        for pos in (0, 1, 15, 16, 63, 64, 65, 130, 200, length - 1):
            one = torch.empty_like(q[:1])
            paged_attention(q[pos:pos + 1], k_cache, v_cache, one, i32([0]), i32([0]), i32([0, 1]), i32([pos + 1]),
                            table, head_dim ** -0.5, *tile_shape(heads // kv_heads, 1, batch_invariant=True), 1,
                            window)
            diff = (one[0] - full[pos]).abs().max().item()
            assert diff <= atol, f"position {pos}, window {window}: decode differs from prefill by {diff}"


def check_padding_rows(device, dtype, splits=1):
    """A decode row with seq_len 0 (CUDA-graph padding) yields zeros and touches nothing."""
    from tidyrun.kernels.attention import paged_attention

    to = dict(device=device)
    k = torch.full((2, 16, 1, 64), float("nan"), dtype=dtype, **to)
    out = torch.full((2, 4, 64), 7.0, dtype=dtype, **to)
    q = torch.ones(2, 4, 64, dtype=dtype, **to)
    seq = torch.tensor([0, 1], dtype=torch.int32, **to)
    paged_attention(q, k, k, out, seq, torch.zeros(2, dtype=torch.int32, **to),
                    torch.tensor([0, 1, 2], dtype=torch.int32, **to), torch.zeros(2, dtype=torch.int32, **to),
                    torch.zeros(2, 1, dtype=torch.int32, **to), 0.125, *tile_shape(4, 1), splits)
    assert torch.equal(out.cpu(), torch.zeros(2, 4, 64, dtype=dtype)), out


def check_fused(device, dtype, shapes, seed=0, atol=None):
    from tidyrun.kernels.fused import add_rms_norm, rope_and_store, silu_mul

    atol = atol if atol is not None else (1e-5 if dtype == torch.float32 else 1.6e-2)
    g = torch.Generator().manual_seed(seed)
    to = dict(device=device, dtype=dtype)
    for tokens, hidden, heads, kv_heads, head_dim in shapes:
        x = torch.randn(tokens, hidden, generator=g).to(**to)
        r = torch.randn(tokens, hidden, generator=g).to(**to)
        w = torch.randn(hidden, generator=g).to(**to)
        out, res = add_rms_norm(x, r, w, 1e-5)
        s = x + r
        h = s.float()
        ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        assert torch.equal(res, s), "add_rms_norm residual"
        assert (out.float() - ref.float()).abs().max().item() <= atol * max(1.0, ref.abs().max().item()), "add_rms_norm"
        out, same = add_rms_norm(x, None, w, 1e-5)
        assert same is x

        gu = torch.randn(tokens, 2 * hidden, generator=g).to(**to)
        ref = F.silu(gu[:, :hidden]) * gu[:, hidden:]
        assert (silu_mul(gu).float() - ref.float()).abs().max().item() <= atol * 8, "silu_mul"

        positions = torch.randint(0, 500, (tokens,), generator=g)
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.arange(512).float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos(), emb.sin()
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=g).to(**to)
        qr, kr, vr = qkv.split([q_size, kv_size, kv_size], -1)
        c, sn = cos[positions].to(dtype)[:, None, :].to(device), sin[positions].to(dtype)[:, None, :].to(device)
        q_ref = apply_rope(qr.reshape(tokens, heads, head_dim), c, sn)
        k_ref = apply_rope(kr.reshape(tokens, kv_heads, head_dim), c, sn)
        blocks, bs = tokens // 4 + 2, 4
        k_cache = torch.zeros(blocks, bs, kv_heads, head_dim, **to)
        v_cache = torch.zeros(blocks, bs, kv_heads, head_dim, **to)
        slots = torch.randperm(blocks * bs, generator=g)[:tokens]
        if tokens > 1:
            slots[0] = -1  # skipped (a CUDA-graph padding row)
        rope_and_store(qkv, cos.to(device), sin.to(device), positions.to(device), heads, kv_heads, head_dim,
                       slots.to(device), k_cache, v_cache)
        q_out = qkv[:, :q_size].reshape(tokens, heads, head_dim)
        assert (q_out.float() - q_ref.float()).abs().max().item() <= atol * 8, "rope q"
        flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
        ok = slots >= 0
        assert (flat_k[slots[ok]].float() - k_ref[ok].float()).abs().max().item() <= atol * 8, "rope k stored"
        assert torch.equal(flat_v[slots[ok]], vr.reshape(tokens, kv_heads, head_dim)[ok]), "v stored"
        assert int((flat_k != 0).any(-1).any(-1).sum()) == int(ok.sum()), "a skipped slot was written"


ATTENTION_CASES = (
    # heads, kv_heads, head_dim, block_size, new tokens per sequence, cached tokens per sequence
    (4, 2, 64, 16, [1], [0]),                       # first token alone
    (4, 2, 64, 16, [1, 1, 1], [15, 16, 47]),        # decode at block boundaries
    (9, 3, 64, 16, [7, 1, 20], [0, 33, 5]),         # SmolLM's GQA ratio, mixed prefill/decode
    (8, 8, 32, 8, [70], [0]),                       # MHA, a prefill spanning several tiles
    (8, 1, 128, 32, [1, 3], [100, 64]),             # MQA, speculative-style multi-token decode
    (32, 8, 64, 16, [1] * 5, [1, 2, 200, 31, 32]),  # Llama-1B shape
)
# Sliding windows (checked with several widths): a window inside one tile, across tiles and pages, wider
# than the context, and decode rows whose window starts mid-page (split or not).
WINDOW_CASES = (
    (4, 2, 32, 16, [1, 1, 1], [15, 16, 90]),
    (9, 3, 64, 16, [7, 1, 20], [0, 33, 5]),
    (8, 8, 32, 8, [70], [0]),
)
FUSED_SHAPES = ((1, 64, 4, 2, 16), (5, 96, 9, 3, 64), (17, 256, 4, 4, 32), (3, 128, 2, 2, 80))


LINEAR_SHAPES = ((1, 48, 96), (3, 40, 600), (16, 64, 512), (5, 34, 1000), (40, 72, 320))


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Bit-equal (``exact``), or within float32 rounding of the larger values (under Triton's interpreter,
    whose dots are numpy's: how it rounds a row can depend on the rows beside it and the tile, by machine)."""
    if exact:
        return torch.equal(a, b)
    return a.shape == b.shape and (a.double() - b.double()).abs().max().item() <= 1e-6 * max(1.0, b.abs().max().item())


def check_linear(device, dtype, shapes, plans, seed=0, tiles=((16, 16, 1, 1), (32, 64, 4, 2)), exact=True):
    """kernels.linear against float64 torch (with and without bias, every plan (block_n, block_k, split,
    stages), the gated SiLU-mul epilogue), and its invariance: every row's bits equal the row computed
    alone, few-row (split over programs, in blocks of 16 rows, finished in-kernel or by the reduce kernel) or
    many-row (every ``tiles`` entry, by pointer loads and by tensor descriptors), so a row's result never
    depends on what else is in the batch. Then argmax_rows.
    Triton's interpreter computes a dot with numpy, whose order depends on BLOCK_K (and, with some BLAS
    builds, on the tile's rows): there, plans take the many-row launch's BLOCK_K (64) and ``exact=False``
    compares within rounding; on the GPU any BLOCK_K dividing k_seg gives the same bits."""
    from tidyrun.kernels.argmax import argmax_logprob_rows, argmax_rows
    from tidyrun.kernels.fused import silu_mul
    from tidyrun.kernels.linear import LinearPlan, ManyRowTile, linear

    g = torch.Generator().manual_seed(seed)
    to = dict(device=device, dtype=dtype)
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    counters = torch.zeros(64, dtype=torch.int32, device=device)
    for rows, n, k in shapes:
        x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        xd, wd = x.to(**to), w.to(**to)
        for block_n, block_k, split, stages in plans:
            per_split = -(-k // split)
            plan = LinearPlan(block_n, block_k, -(-per_split // block_k) * block_k, stages)
            for bias in (None, b):
                ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                bd = None if bias is None else bias.to(**to)
                out = linear(xd, wd, bd, plan)
                label = f"linear {rows}x{n}x{k} {plan} bias={bias is not None}"
                err = (out.double().cpu() - ref).abs().max().item()
                assert out.dtype == dtype and err <= rtol * ref.abs().max().item(), f"{label}: {err}"
                some = sorted({0, rows // 2, rows - 1})  # rows alone (every row: slow under the interpreter)
                alone = torch.cat([linear(xd[i:i + 1], wd, bd, plan) for i in some])
                assert _same(out[some], alone, exact), f"{label}: a row's bits depend on the batch"
                # Few-row launches (more than 16 rows: in blocks of 16), finished in-kernel and by the reduce kernel.
                for given in (counters, None):
                    assert _same(linear(xd, wd, bd, plan, given, split_grid=True), out, exact), \
                        f"{label}: few-row launch, counters={given is not None}"
                    assert not counters.any(), f"{label}: counters left armed"
                for tile in tiles:
                    for tma in (False, True):  # by pointer loads and by tensor descriptors
                        many = linear(xd, wd, bd, plan, tile=ManyRowTile(*tile), split_grid=False, tma=tma)
                        assert _same(many, out, exact), f"{label}: many-row tile {tile} (tma={tma}) differs from few-row"
            if n % 2 == 0:
                step = min(block_k, 128)  # a gated launch loads two weight tiles: 128 keeps it in shared memory
                one = plan._replace(block_k=step, k_seg=-(-k // step) * step)
                gated = linear(xd, wd, None, one, gated=True)
                ref = silu_mul(F.linear(xd, wd))
                err = (gated.double() - ref.double()).abs().max().item()
                assert err <= 2 * rtol * ref.abs().max().item(), f"gated {rows}x{n}x{k} {one}: {err}"
                for tile in tiles:
                    many = linear(xd, wd, None, one, gated=True, tile=ManyRowTile(*tile), split_grid=False, tma=True)
                    assert _same(many, gated, exact), f"gated {rows}x{n}x{k} {one}: many-row tile {tile} by descriptors"
                alone = torch.cat([linear(xd[i:i + 1], wd, None, one, gated=True) for i in some])
                assert _same(linear(xd, wd, None, one, gated=True, split_grid=True), gated, exact), \
                    f"gated {rows}x{n}x{k} {one}: few-row launch"
                assert _same(gated[some], alone, exact), f"gated {rows}x{n}x{k} {one}: a row's bits depend on the batch"
    x = torch.randn(3, 10000, generator=g)
    x[1, 5000] = x[1, 9000] = 100.0  # a tie: the first index wins, as in torch.argmax
    x[2] = 0.0
    assert argmax_rows(x.to(**to), block=512).tolist() == [x[0].to(dtype).argmax().item(), 5000, 0], "argmax_rows"
    _, logprob = argmax_logprob_rows(x.to(**to), block=512)
    ref = x.to(dtype).float()
    ref = ref.max(-1).values - ref.logsumexp(-1)
    assert (logprob.cpu() - ref).abs().max().item() <= 1e-5, "argmax_logprob_rows: logprob of the argmax"


def check_race(device, dtype, shapes=((1, 10000), (5, 4097), (3, 700)), block=512, seed=0):
    """race_sample (Triton) against the torch reference on the same noise: the same tokens (greedy rows the
    argmax, a tie to the first index), the same log-probabilities (1e-4) and ranks; rows of -inf (masked
    tokens) are never drawn; a strided view of the logits reads right; without logprobs the same tokens."""
    from tidyrun.kernels.argmax import argmax_logprob_rows
    from tidyrun.kernels.race import race_sample
    from tidyrun.sampling import race_sample as reference

    g = torch.Generator().manual_seed(seed)
    for rows, vocab in shapes:
        wide = torch.randn(rows, vocab + 3, generator=g) * 3
        wide[0, 7] = wide[0, vocab - 1] = 100.0  # a tie in the greedy row
        if rows > 2:
            wide[2, : vocab // 2] = float("-inf")  # half the vocabulary masked (a grammar)
        x = wide.to(device=device, dtype=dtype)[:, :vocab]  # row stride != vocab
        noise = torch.empty(rows, vocab).exponential_(generator=g).to(device)
        scale = torch.tensor([[1.0, 0.0]] + [[1.0 / (0.5 + r), 1.0] for r in range(1, rows)]).to(device)
        tokens, packed = race_sample(x, noise, scale, True, block=block)
        ref_tokens, ref_packed = reference(x, noise, scale, True)
        assert tokens.tolist() == ref_tokens.tolist(), f"race tokens {rows}x{vocab}"
        assert tokens[0].item() == 7, "greedy row: the first of two equal maxima"
        assert (packed[:, 0] == tokens.double()).all() and torch.equal(packed[:, 2].cpu(), ref_packed[:, 2].cpu())
        assert (packed[:, 1] - ref_packed[:, 1]).abs().max().item() <= 1e-4, f"race logprob {rows}x{vocab}"
        if rows > 2:
            assert tokens[2].item() >= vocab // 2, "a masked token was drawn"
        again, none = race_sample(x, noise, scale, False, block=block)
        assert none is None and torch.equal(again, tokens), "race without logprobs"
        # Greedy rows: the argmax pass's token and rank, its logprob within 1e-4 (not bit for bit on the GPU:
        # the runner takes a greedy row's logprob from the argmax pass whatever else its step holds).
        greedy = torch.tensor([[1.0, 0.0]] * rows, device=device)
        _, raced = race_sample(x, noise, greedy, True, block=block)
        at, logprob = argmax_logprob_rows(x, block=block)
        assert torch.equal(raced[:, 0], at.double()) and (raced[:, 2] == 1).all(), f"greedy race {rows}x{vocab}"
        whole = [r for r in range(rows) if r != 2]  # the argmax pass is for unmasked logits (no -inf slices)
        assert (raced[whole, 1] - logprob[whole].double()).abs().max().item() <= 1e-4, f"greedy race logprobs {rows}x{vocab}"


def check_masked_race(device, dtype, shapes=((1, 10000), (6, 4097), (6, 4096), (4, 700)), block=512, seed=0):
    """race_sample with a grammar's bitmask (Triton) against the torch reference and against the race over the
    logits masked to -inf: the same tokens, allowed ones (a row allowing one token takes it, at bit 31 of its
    word too; a greedy row the masked argmax; a row allowing none token 0, as the processed path's argmax over
    -inf); logprob and rank those of the raw logits (the reference's within 1e-4); a bitmask whose rows are
    views of wider rows reads right."""
    from tidyrun.kernels.race import race_sample
    from tidyrun.sampling import allowed_tokens
    from tidyrun.sampling import race_sample as reference

    g = torch.Generator().manual_seed(seed)
    for rows, vocab in shapes:
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
        bitmask[0] = -1  # everything allowed, bits past the vocabulary too
        if rows > 1:
            bitmask[1] = 0
            bit = (vocab - 1) % 32  # only the last token (bit 31 is the int32's sign)
            bitmask[1, (vocab - 1) // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)
        if rows > 3:
            bitmask[3] &= 0x0F0F0F0F  # sparser
        if rows > 4:
            bitmask[4] = 0  # nothing allowed
        x = (torch.randn(rows, vocab + 5, generator=g) * 3).to(device=device, dtype=dtype)[:, :vocab]
        noise = torch.empty(rows, vocab).exponential_(generator=g).to(device)
        scale = torch.tensor([[1.0, 0.0] if r % 3 == 2 else [1.0 / (0.5 + r), 1.0] for r in range(rows)]).to(device)
        wider = torch.zeros(rows, words + 3, dtype=torch.int32)
        wider[:, :words] = bitmask
        mask = wider.to(device)[:, :words]  # row stride != words
        tokens, packed = race_sample(x, noise, scale, True, mask, block=block)
        ref_tokens, ref_packed = reference(x, noise, scale, True, mask)
        allowed = allowed_tokens(mask, vocab)
        masked_x = x.float().masked_fill(~allowed, float("-inf"))
        plain_tokens, _ = race_sample(masked_x, noise, scale, False, block=block)
        assert tokens.tolist() == ref_tokens.tolist() == plain_tokens.tolist(), f"masked race tokens {rows}x{vocab}"
        some = [r for r in range(rows) if r != 4]
        assert allowed[some, tokens[some]].all(), "a refused token was drawn"
        if rows > 1:
            assert tokens[1].item() == vocab - 1, "the only allowed token"
        if rows > 4:
            assert tokens[4].item() == 0, "a row allowing nothing: token 0"
        for r in range(rows):
            if scale[r, 1].item() == 0:
                assert tokens[r].item() == masked_x[r].argmax().item(), "greedy row: the masked argmax"
        assert torch.equal(packed[:, 0], tokens.double()) and torch.equal(packed[:, 2].cpu(), ref_packed[:, 2].cpu())
        assert (packed[:, 1] - ref_packed[:, 1]).abs().max().item() <= 1e-4, f"masked race logprob {rows}x{vocab}"
        raw = x.float()
        value = raw.gather(1, tokens[:, None])[:, 0]
        assert (packed[:, 1].float() - (value - raw.logsumexp(-1))).abs().max().item() <= 1e-4, "raw logprob"
        again, none = race_sample(x, noise, scale, False, mask, block=block)
        assert none is None and torch.equal(again, tokens), "masked race without logprobs"


def check_race_keyed(device, dtype, vocab=3000, block=512):
    """The keyed race (noise drawn in the kernel from each row's (seed, step)): the tokens and logprob rows of
    the stored-noise race and of the torch reference given the noise ``keyed_noise`` materialises from the
    same keys, with and without a grammar's bitmask; a row's token follows its key wherever the row sits in
    the batch; greedy rows ignore theirs; the draws are Exp(1) (mean, tails), differ from step to step and
    seed to seed, and steps past 2**32 count."""
    from tidyrun.kernels.race import keyed_noise, race_sample
    from tidyrun.sampling import race_sample as reference

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, vocab, generator=g) * 3).to(device=device, dtype=dtype)
    keys = torch.tensor([[7, 0], [7, 1], [8, 0], [2**62 + 3, 5], [7, 0], [9, 2]], dtype=torch.int64, device=device)
    scale = torch.tensor([[1.0, 1.0], [1 / 0.7, 1.0], [1.0, 1.0], [2.0, 1.0], [1.0, 1.0], [1.0, 0.0]], device=device)
    noise = keyed_noise(keys, vocab)
    assert torch.equal(noise[0], noise[4]) and not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    far = keyed_noise(torch.tensor([[7, 2**32]], device=device), vocab)
    assert not torch.equal(far[0], noise[0]), "a step past 2**32 repeats step 0"
    tokens, packed = race_sample(x, keys, scale, True, block=block)
    stored_tokens, stored_packed = race_sample(x, noise, scale, True, block=block)
    assert tokens.tolist() == stored_tokens.tolist() and torch.equal(packed, stored_packed), "keyed vs stored noise"
    assert tokens.tolist() == reference(x, noise, scale, False)[0].tolist(), "keyed vs the torch reference"
    assert tokens[5].item() == x[5].float().argmax().item(), "a greedy row read its key"
    mask = torch.randint(-2**31, 2**31 - 1, (6, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    mask = mask.to(device)
    masked, _ = race_sample(x, keys, scale, True, mask, block=block)
    assert masked.tolist() == reference(x, noise, scale, False, mask)[0].tolist(), "keyed masked race"
    perm = [3, 0, 5, 1, 4, 2]
    moved, none = race_sample(x[perm], keys[perm], scale[perm], False, block=block)
    assert none is None and moved.tolist() == tokens[perm].tolist(), "a row's token depends on its batch"
    draws = keyed_noise(torch.tensor([[s, t] for s in (1, 2) for t in range(4)], device=device), 25000).cpu()
    assert abs(draws.mean().item() - 1) < 0.01, draws.mean()
    for cut in (0.1, 1.0, 3.0):
        assert abs((draws > cut).double().mean().item() - math.exp(-cut)) < 0.005, cut
    assert abs(torch.corrcoef(draws[:2])[0, 1].item()) < 0.02, "consecutive steps correlate"
    assert abs(torch.corrcoef(draws[[0, 4]])[0, 1].item()) < 0.02, "neighbouring seeds correlate"


# (tokens, hidden, expert intermediate, experts, top-k, skew): skew > 0 draws routing from a few favourite
# experts, so most experts get no token and a few get many.
MOE_CASES = ((1, 32, 16, 8, 2, 0.0), (5, 48, 40, 8, 8, 0.0), (9, 64, 24, 16, 3, 4.0), (33, 32, 16, 12, 1, 8.0))


def random_moe_cases(n, seed=0, max_tokens=300):
    """Random MoE shapes in the issue's range: experts 8-128, top-k 1-8, sometimes heavily skewed."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        experts = rng.choice([8, 16, 60, 64, 128])
        cases.append((rng.choice([1, 3, 16, 64, max_tokens]), rng.choice([128, 256, 576]), rng.choice([64, 96, 256]),
                      experts, rng.randint(1, 8), rng.choice([0.0, 6.0])))
    return tuple(cases)


def check_moe(device, dtype, cases, seed=0):
    """The grouped Triton experts (kernels.moe) against TorchOps' per-expert loop on the same routing;
    the alignment leaves every entry once and experts nobody chose without blocks."""
    from tidyrun.kernels.moe import align, align_one_kernel, moe_experts, tile_config
    from tidyrun.model.moe import route
    from tidyrun.model.ops import TorchOps

    g = torch.Generator().manual_seed(seed)
    rtol = 1e-4 if dtype == torch.float32 else 3e-2
    for tokens, hidden, inter, experts, top_k, skew in cases:
        favourite = torch.zeros(experts)
        favourite[torch.randperm(experts, generator=g)[:max(top_k, 2)]] = skew
        logits = torch.randn(tokens, experts, generator=g) + favourite
        weights, ids = route(logits, top_k, renormalize=bool(tokens % 2))
        case = f"moe {tokens}x{hidden} inter {inter} experts {experts} top-{top_k} skew {skew}"
        x = torch.randn(tokens, hidden, generator=g)
        w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
        w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
        to = dict(device=device, dtype=dtype)
        xd, w13d, w2d, wd, idd = x.to(**to), w13.to(**to), w2.to(**to), weights.to(device), ids.to(device)
        block = tile_config(ids.numel(), experts).block_m
        entries, block_expert = align(idd, experts, block)
        one = align_one_kernel(idd, experts, block)
        assert torch.equal(one[0], entries) and torch.equal(one[1], block_expert), f"moe one-kernel align {case}"
        real = entries[entries < ids.numel()].sort().values.cpu()
        assert torch.equal(real, torch.arange(ids.numel(), dtype=torch.int32)), f"moe align {case}"
        hit = set(ids.flatten().tolist())
        assert set(block_expert[block_expert < experts].tolist()) == hit, f"moe blocks of unrouted experts {case}"
        out = moe_experts(xd, w13d, w2d, wd, idd)
        ref = TorchOps().moe_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
        err = (out.double().cpu() - ref).abs().max().item()
        assert out.dtype == dtype and err <= rtol * max(ref.abs().max().item(), 1.0), f"{case}: {err}"


def check_take_pending(device, seed=0):
    """fused.take_pending (async scheduling's inputs) equals TorchOps.take_pending: ids -1 - r become row r
    of the previous step's tokens, others stay; padding zeros stay; a batch over one block too."""
    from tidyrun.kernels.fused import take_pending
    from tidyrun.model.ops import TorchOps

    g = torch.Generator().manual_seed(seed)
    for n, rows in ((5, 3), (1, 1), (2500, 300)):
        pending = torch.randint(0, 50000, (rows,), generator=g)
        ids = torch.randint(0, 50000, (n,), generator=g)
        take = torch.rand(n, generator=g) < 0.5
        ids[take] = -1 - torch.randint(0, rows, (int(take.sum()),), generator=g)
        ids[-1:] = 0  # graph padding
        want = ids.clone()
        TorchOps().take_pending(want, pending)
        got = ids.clone().to(device)  # .to("cpu") would not copy
        take_pending(got, pending.to(device), block=512)
        assert torch.equal(got.cpu(), want), f"take_pending {n} ids, {rows} pending"
        assert (want >= 0).all() and torch.equal(want[take & (ids != 0)], pending[-1 - ids[take & (ids != 0)]])
