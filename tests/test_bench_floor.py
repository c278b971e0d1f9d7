"""bench/throughput.py's physical floor and idealised bound for workload (a), checked by hand on small workloads."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

from throughput import floor_seconds, ideal_seconds  # noqa: E402


def test_floor_charges_each_decode_step_its_running_contexts():
    # Prompts of 10 and 20 tokens; outputs of 3 and 1 tokens: the prefill (30 tokens at 1 FLOP each, 1 FLOP/s)
    # samples both first tokens; decode steps 1 and 2 run the first request alone with 11 and 12 keys.
    work = ([[5] * 10, [5] * 20], [3, 1])
    got = floor_seconds(work, weight_bytes=100, kv_bytes_per_token=2, peak_bw=1.0, flops_per_token=1.0,
                        peak_flops=1.0)
    assert got == 30 + (100 + 11 * 2) + (100 + 12 * 2)


def test_floor_of_one_token_outputs_is_the_prefill_alone():
    assert floor_seconds(([[1] * 7], [1]), 100, 2, 1.0, 2.0, 1.0) == 14


def test_floor_takes_the_rows_flops_when_they_outlast_the_reads():
    # Three requests of 4-token prompts decoding one step: the products read 10 bytes (10 s at 1 B/s) but
    # compute 3 rows * 100 FLOPs (30 s at 10 FLOP/s): 30 s; then the attention reads 3 * 5 keys * 1 byte:
    # 15 s. The prefill: 12 tokens * 100 / 10 = 120 s.
    work = ([[1] * 4] * 3, [2, 2, 2])
    assert floor_seconds(work, 10, 1, 1.0, 100.0, 10.0) == 120 + 30 + 15


def test_ideal_bound_interpolates_the_measured_steps():
    # Three requests, prompts 10 + 10 + 20 tokens prefilled at 10 tok/s (4 s); outputs 1, 2, 4 tokens: step 1 runs
    # three rows (interpolated between batches 2 and 4: 2.5 s), step 2 two rows (2 s), steps 3-4 one row (1 s each).
    work = ([[1] * 10, [1] * 10, [1] * 20], [4, 2, 1])
    decode = [dict(batch=b, median_step_ms=ms, prefill_tok_s=10.0) for b, ms in ((1, 1e3), (2, 2e3), (4, 3e3))]
    assert ideal_seconds(work, decode) == 4 + 2.5 + 2 + 1 + 1


def test_ideal_bound_needs_step_times_up_to_the_workloads_batch():
    # Found on the H100: with --batch-sizes 1 8 64 the 256-row steps were priced at 4x the 64-row step (the
    # step time taken as proportional to the rows beyond the largest measured batch: 7.6 ms against 3.65
    # measured), and the "bound" came out at 145% of the measured run's time. No bound without those rows.
    work = ([[1] * 10] * 3, [4, 2, 1])
    decode = [dict(batch=b, median_step_ms=1.0, prefill_tok_s=10.0) for b in (1, 2)]
    assert ideal_seconds(work, decode) is None
