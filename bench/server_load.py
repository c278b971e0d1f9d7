"""A bounded loopback load test of `tidyrun serve`: many concurrent streaming clients, a third of them hanging up.

    python bench/server_load.py [--clients 256] [--seconds 120] [--json bench/results/server_load.json]

A random-weight llama-tiny checkpoint (tidyrun.synthetic) is served on the CPU
on 127.0.0.1. First one reference completion per prompt is taken alone
(temperature 0). Then ``--clients`` asyncio clients each send streaming
completions back to back for ``--seconds``: one of 8 prompts, ``max_tokens``
8, 16, 32 or 64, ``ignore_eos``; a third of the requests (random.Random(0)) disconnect
after a random number of chunks. Checked and reported: every completed
stream equals its reference's first ``max_tokens`` tokens of text and ends
with finish_reason "length" and [DONE]; no 5xx and no other error; after the
run the server is idle with no KV block in use (its /metrics); it stops
cleanly and its shutdown reports nothing survived.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

import httpx

PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog number {i}" for i in range(8)]
LENGTHS = (8, 16, 32, 64)


async def client(url: str, rng: random.Random, deadline: float, refs: dict, tally: dict) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() < deadline:
            prompt = rng.randrange(len(PROMPTS))
            max_tokens = rng.choice(LENGTHS)
            hang_up = rng.random() < 1 / 3
            cut_after = rng.randint(0, 3)  # chunks read before hanging up (0: right after the headers)
            body = {"prompt": PROMPTS[prompt], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            start = time.monotonic()
            chunks, text, reason, first = 0, "", None, None
            try:
                async with http.stream("POST", url + "/v1/completions", json=body) as r:
                    if r.status_code >= 500:
                        tally["5xx"] += 1
                        continue
                    if r.status_code != 200:
                        tally["other_status"] += 1
                        continue
                    done = False
                    if hang_up and cut_after == 0:
                        tally["disconnected"] += 1
                        continue
                    async for line in r.aiter_lines():
                        if not line:
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        choice = json.loads(line[len("data: "):])["choices"][0]
                        first = first or time.monotonic()
                        text += choice["text"]
                        reason = choice["finish_reason"] or reason
                        chunks += 1
                        if hang_up and chunks >= cut_after:
                            break
                if hang_up and not done:
                    tally["disconnected"] += 1
                    continue
                want = refs[(prompt, max_tokens)]
                ok = done and reason == "length" and text == want
                tally["completed"] += 1
                tally["wrong"] += not ok
                tally["tokens"] += max_tokens
                tally["latency"].append(time.monotonic() - start)
                tally["ttft"].append((first or time.monotonic()) - start)
            except httpx.HTTPError as exc:
                tally["errors"].append(type(exc).__name__)


async def run_clients(url: str, clients: int, seconds: float, refs: dict) -> dict:
    tally = dict(completed=0, disconnected=0, wrong=0, tokens=0, latency=[], ttft=[], errors=[], **{"5xx": 0},
                 other_status=0)
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(client(url, random.Random(i), deadline, refs, tally) for i in range(clients)))
    return tally


def main() -> None:
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from server_utils import ServerProcess

    from tidyrun.synthetic import write_random_checkpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--json", default="bench/results/server_load.json")
    args = ap.parse_args()
    folder = write_random_checkpoint(tempfile.mkdtemp(prefix="tidyrun-load-"), "llama-tiny", dtype=torch.float32)
    srv = ServerProcess("--model", folder, "--max-model-len", "256", "--max-num-seqs", "256", log_to_file=True)
    try:
        refs = {}
        for p, prompt in enumerate(PROMPTS):  # each (prompt, length) greedy, alone
            for n in LENGTHS:
                r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": n,
                                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
                refs[(p, n)] = r.json()["choices"][0]["text"]
        t0 = time.monotonic()
        tally = asyncio.run(run_clients(srv.url, args.clients, args.seconds, refs))
        wall = time.monotonic() - t0
        idle = srv.wait_idle(timeout=30)
    finally:
        code, err = srv.stop()
    clean = "nothing survived" in err and "Traceback" not in err
    row = dict(clients=args.clients, seconds=round(wall, 1), completed=tally["completed"],
               disconnected=tally["disconnected"], wrong=tally["wrong"], server_5xx=tally["5xx"],
               other_status=tally["other_status"], client_errors=len(tally["errors"]),
               tokens_per_s=round(tally["tokens"] / wall, 1),
               latency_p50_s=round(statistics.median(tally["latency"]), 3) if tally["latency"] else None,
               latency_p99_s=round(statistics.quantiles(tally["latency"], n=100)[98], 3)
               if len(tally["latency"]) > 1 else None,
               ttft_p50_s=round(statistics.median(tally["ttft"]), 3) if tally["ttft"] else None,
               running_after=idle["tidyrun_requests_running"], waiting_after=idle["tidyrun_requests_waiting"],
               kv_usage_after=idle["tidyrun_kv_cache_usage_ratio"], exit_code=code, clean_shutdown=clean)
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(str(v) for v in row.values()) + " |")
    if tally["errors"]:
        print("client errors:", sorted(set(tally["errors"])))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
