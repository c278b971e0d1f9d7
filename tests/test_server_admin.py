"""The lifecycle and admin routes are opt-in, keyed, confined to one weights folder, and all-or-nothing.

One tiny random engine serves the whole module; each test builds the app it
needs around it (apps are cheap, and a TestClient used without ``with`` runs
no lifespan, so no app stops the shared loop). Every weight-changing test
puts the original weights back before it ends, and the failing updates
check that the served weights and logprobs are bit-identical afterwards.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors import safe_open
from safetensors.torch import save_file

from tidyrun import LLM
from tidyrun.server import EngineLoop, create_app
from tidyrun.synthetic import write_random_checkpoint

ADMIN, USER = "admin-key", "user-key"
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}
# (method, path) of every lifecycle and admin route
ROUTES = [("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping"), ("post", "/reset_prefix_cache"),
          ("post", "/start_profile"), ("post", "/stop_profile"), ("post", "/update_weights"), ("post", "/shutdown")]
PROMPT = {"prompt": [5, 17, 99, 3, 250, 7, 42, 11], "max_tokens": 6, "temperature": 0, "logprobs": 5}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the model's checkpoint, the weights dir, a folder outside both), with the checkpoint's tensors."""
    base = tmp_path_factory.mktemp("admin")
    model = write_random_checkpoint(str(base / "model"), "llama-tiny", dtype=torch.float32)
    weights_dir, outside = base / "weights", base / "outside"
    weights_dir.mkdir()
    outside.mkdir()
    tensors = {}
    for f in sorted(os.listdir(model)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(model, f), framework="pt") as st:
                tensors.update({k: st.get_tensor(k) for k in st.keys()})
    write_shards(weights_dir / "original", tensors)
    return model, str(weights_dir), str(outside), tensors


@pytest.fixture(scope="module")
def loop(folders):
    loop = EngineLoop(LLM(folders[0], device="cpu", max_model_len=64))
    loop.start()
    yield loop
    report = loop.stop()
    assert report is not None and report.clean


def write_shards(folder, tensors: dict, shards: int = 2) -> str:
    """``tensors`` split by sorted name over ``shards`` files, as HF names them (file k holds the k-th part)."""
    os.makedirs(folder, exist_ok=True)
    names = sorted(tensors)
    step = math.ceil(len(names) / shards)
    for k in range(shards):
        part = {n: tensors[n].contiguous() for n in names[k * step:(k + 1) * step]}
        save_file(part, os.path.join(folder, f"model-{k + 1:05d}-of-{shards:05d}.safetensors"))
    return str(folder)


def client(loop, **kw) -> TestClient:
    return TestClient(create_app(loop, "tiny", **kw), raise_server_exceptions=False)


def admin_client(loop, folders, **kw) -> TestClient:
    return client(loop, **{"enable_lifecycle_endpoints": True, "admin_key": ADMIN, "api_key": USER,
                           "weights_dir": folders[1], **kw})


def served_state(loop) -> dict[str, torch.Tensor]:
    """A copy of every parameter the engine serves with."""
    async def grab():
        return await loop.call(lambda e: {k: v.detach().clone() for k, v in e.runner.model.state_dict().items()})

    import asyncio

    return asyncio.run(grab())


def greedy(c: TestClient) -> dict:
    r = c.post("/v1/completions", json=PROMPT, headers={"authorization": f"Bearer {USER}"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]}


def assert_bit_identical(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"weights changed by a refused update: {changed[:5]}"


def assert_error(r, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in err["message"], err
    return err


# -- off by default ---------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"api_key": USER}])
def test_routes_do_not_exist_without_the_switch(loop, kw):
    c = client(loop, **kw)
    for method, path in ROUTES:
        for headers in ({}, {"authorization": f"Bearer {USER}"}):
            assert_error(getattr(c, method)(path, headers=headers), 404, "Not Found")
    assert not {p for _, p in ROUTES} & set(c.get("/openapi.json").json()["paths"])
    assert c.get("/health").status_code == 200


@pytest.mark.parametrize("kw, needle", [
    ({"enable_lifecycle_endpoints": True}, "--admin-key"),
    ({"enable_lifecycle_endpoints": True, "admin_key": ""}, "must not be empty"),
    ({"admin_key": ADMIN}, "--enable-lifecycle-endpoints"),
    ({"api_key": USER, "weights_dir": "."}, "--enable-lifecycle-endpoints"),
    ({"api_key": USER, "request_exit": lambda: None}, "--enable-lifecycle-endpoints"),
    ({"enable_lifecycle_endpoints": True, "admin_key": ADMIN, "weights_dir": "/no/such/dir"}, "not an existing"),
])
def test_unsafe_or_ignored_options_are_refused(loop, kw, needle):
    with pytest.raises(ValueError, match=needle) as info:
        create_app(loop, "tiny", **kw)
    if "needs a key" in str(info.value):
        assert "--api-key" in str(info.value)


def test_cli_refuses_to_start_without_a_key(capsys):
    from tidyrun.cli import main

    for argv in (["serve", "--enable-lifecycle-endpoints"], ["serve", "--enable-shutdown-endpoint", "--api-key", "k"]):
        with pytest.raises(SystemExit) as info:
            main(argv)  # refused by argparse before any model is loaded
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "needs a key" in err and "--admin-key" in err and "--api-key" in err
    assert "--enable-shutdown-endpoint" in err


# -- the admin key ------------------------------------------------------------------------------


def test_every_route_needs_the_admin_key(loop, folders):
    calls = []
    c = admin_client(loop, folders, request_exit=lambda: calls.append("exit"))
    for method, path in ROUTES:
        for headers in ({}, {"authorization": f"Bearer {USER}"}, {"authorization": "Bearer wrong"},
                        {"authorization": ADMIN}):
            err = assert_error(getattr(c, method)(path, headers=headers), 401, "admin key")
            assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")
    # the key is checked before the body and query: no validation detail leaks to a caller without it
    assert_error(c.post("/sleep", params={"level": 7}), 401)
    assert_error(c.post("/update_weights", content=b"{not json"), 401)
    assert calls == [] and c.get("/is_sleeping", headers=AS_ADMIN).json() == {"is_sleeping": False}
    assert c.post("/shutdown", headers=AS_ADMIN).json() == {"shutting_down": True} and calls == ["exit"]
    assert_error(c.get("/v1/models", headers=AS_ADMIN), 401)  # the admin key is not a /v1 key


def test_the_api_key_is_the_admin_key_when_none_is_given(loop):
    c = client(loop, enable_lifecycle_endpoints=True, api_key=USER)
    assert c.get("/is_sleeping", headers={"authorization": f"Bearer {USER}"}).json() == {"is_sleeping": False}
    assert_error(c.get("/is_sleeping"), 401)
    assert_error(c.post("/update_weights", json={"path": "x"}, headers={"authorization": f"Bearer {USER}"}), 404)
    assert_error(c.post("/shutdown", headers={"authorization": f"Bearer {USER}"}), 404)


def test_sleep_wake_with_the_admin_key(loop, folders):
    c = admin_client(loop, folders)
    before = greedy(c)
    r = c.post("/sleep", params={"level": 1}, headers=AS_ADMIN)
    assert r.status_code == 200 and r.json()["sleeping"]
    assert c.get("/is_sleeping", headers=AS_ADMIN).json() == {"is_sleeping": True}
    assert_error(c.post("/v1/completions", json=PROMPT, headers={"authorization": f"Bearer {USER}"}), 409, "asleep")
    assert_error(c.post("/sleep", params={"level": 7}, headers=AS_ADMIN), 400)
    assert c.post("/wake_up", headers=AS_ADMIN).json() == {"sleeping": False}
    assert greedy(c) == before


def test_reset_prefix_cache(loop, folders):
    import asyncio

    async def hits():
        return await loop.call(lambda e: e.scheduler.num_prefix_cached_tokens)

    c = admin_client(loop, folders)
    body = dict(PROMPT, prompt=list(range(300, 340)), max_tokens=1)  # 40 tokens: two full 16-token blocks
    c.post("/v1/completions", json=body, headers={"authorization": f"Bearer {USER}"})
    start = asyncio.run(hits())
    c.post("/v1/completions", json=body, headers={"authorization": f"Bearer {USER}"})
    cached = asyncio.run(hits())
    assert cached >= start + 32  # the repeat was served from the cache
    assert c.post("/reset_prefix_cache", headers=AS_ADMIN).json() == {"reset": True}
    c.post("/v1/completions", json=body, headers={"authorization": f"Bearer {USER}"})
    assert asyncio.run(hits()) == cached  # after the reset, nothing to reuse
    reset = c.post("/reset_prefix_cache", params={"reset_running_requests": "true", "reset_external": "true"},
                   headers=AS_ADMIN)  # vLLM's query parameters
    assert reset.json() == {"reset": True}
    assert_error(c.post("/reset_prefix_cache", params={"reset_running_requests": "maybe"}, headers=AS_ADMIN), 400)


def test_profiling_routes(loop, folders, tmp_path):
    c = admin_client(loop, folders)  # the module's engine has no profiler: a 400 saying how to configure one
    assert_error(c.post("/start_profile", headers=AS_ADMIN), 400, "profiling is off", "VLLM_TORCH_PROFILER_DIR")
    assert_error(c.post("/stop_profile", headers=AS_ADMIN), 400, "no profile is running")
    traced = EngineLoop(LLM(folders[0], device="cpu", max_model_len=64,
                            profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)}))
    traced.start()
    try:
        c = admin_client(traced, folders)
        assert c.post("/start_profile", headers=AS_ADMIN).json() == {"profiling": True}
        assert_error(c.post("/start_profile", headers=AS_ADMIN), 400, "already running")
        greedy(c)
        r = c.post("/stop_profile", headers=AS_ADMIN)
        assert r.status_code == 200 and r.json()["profiling"] is False
        assert os.path.dirname(r.json()["trace"]) == str(tmp_path) and os.listdir(tmp_path)
    finally:
        assert traced.stop().clean


# -- update_weights: where from -------------------------------------------------------------------


def test_update_weights_needs_a_weights_dir(loop, folders):
    c = admin_client(loop, folders, weights_dir=None)
    assert_error(c.post("/update_weights", json={"path": folders[0]}, headers=AS_ADMIN), 404)
    assert "/update_weights" not in c.get("/openapi.json").json()["paths"]


def test_paths_outside_the_weights_dir_are_forbidden(loop, folders):
    model, weights_dir, outside, tensors = folders
    write_shards(os.path.join(outside, "evil"), {k: v + 1 for k, v in tensors.items()})
    links = os.path.join(weights_dir, "links")
    os.makedirs(links, exist_ok=True)
    os.symlink(os.path.join(outside, "evil"), os.path.join(links, "to_outside"))  # a folder link
    os.makedirs(os.path.join(links, "mixed"))
    for f in os.listdir(os.path.join(outside, "evil")):  # a folder inside whose files link out
        os.symlink(os.path.join(outside, "evil", f), os.path.join(links, "mixed", f))
    c = admin_client(loop, folders)
    before, state = greedy(c), served_state(loop)
    for path in (model, os.path.join(outside, "evil"), "../outside/evil", "original/../../outside/evil",
                 os.path.join(weights_dir, "..", "outside", "evil"), "links/to_outside", "links/mixed",
                 "links/mixed/model-00001-of-00002.safetensors", "/etc/passwd", "/no/such/place"):
        err = assert_error(c.post("/update_weights", json={"path": path}, headers=AS_ADMIN), 403,
                           "outside the server's weights dir")
        assert (err["param"], err["code"]) == ("path", "path_not_allowed")
    assert_error(c.post("/update_weights", json={"path": "nothing/here"}, headers=AS_ADMIN), 400, "does not exist")
    assert_error(c.post("/update_weights", json={"path": "links"}, headers=AS_ADMIN), 400, "safetensors")
    for bad in ("", "a\x00b", "\ud800"):  # empty, NUL, a lone surrogate (valid JSON, no file name)
        body = json.dumps({"path": bad}).encode()  # ASCII-escaped: the surrogate travels as JSON allows
        r = c.post("/update_weights", content=body, headers={**AS_ADMIN, "content-type": "application/json"})
        assert_error(r, 400, "non-empty")
    assert_bit_identical(state, served_state(loop))
    assert greedy(c) == before


# -- update_weights: all or nothing ---------------------------------------------------------------


@pytest.mark.parametrize("fault, needle, scale", [("shape", "has shape", 1.5), ("name", "unexpected weight", 1.25),
                                                  ("nan", "NaN", 1.75), ("repeat", "is in both", 2.0)])
def test_a_bad_later_shard_changes_nothing(loop, folders, fault, needle, scale):
    _, weights_dir, _, tensors = folders
    changed = {k: v * scale for k, v in tensors.items()}  # a scale of its own: a half-copy is seen in every case
    names = sorted(changed)
    last = names[-1]  # in the second shard: the first shard is valid and would be copied first
    if fault == "shape":
        changed[last] = changed[last][..., :-1].clone()
    elif fault == "name":
        changed["model.layers.99.mlp.up_proj.weight"] = changed.pop(last)
    elif fault == "nan":
        changed[last] = changed[last].clone()
        changed[last].view(-1)[3] = float("nan")
    folder = write_shards(os.path.join(weights_dir, f"bad_{fault}"), changed)
    if fault == "repeat":  # the second shard holds a name of the first one too
        save_file({names[0]: changed[names[0]], last: changed[last]},
                  os.path.join(folder, "model-00002-of-00002.safetensors"))
    c = admin_client(loop, folders)
    before, state = greedy(c), served_state(loop)
    r = c.post("/update_weights", json={"path": f"bad_{fault}", "check_finite": fault == "nan"}, headers=AS_ADMIN)
    assert_error(r, 400, needle, "model.layers.99" if fault == "name" else last if fault != "repeat" else names[0])
    assert_bit_identical(state, served_state(loop))
    assert greedy(c) == before  # the same greedy tokens and the same logprobs, to the bit


def test_a_good_two_shard_update_changes_the_output(loop, folders):
    _, weights_dir, _, tensors = folders
    write_shards(os.path.join(weights_dir, "tuned"), {k: v * 1.5 if v.dim() == 2 else v for k, v in tensors.items()})
    c = admin_client(loop, folders)
    before, state = greedy(c), served_state(loop)
    r = c.post("/update_weights", json={"path": os.path.join(weights_dir, "tuned"), "check_finite": True},
               headers=AS_ADMIN)
    assert r.status_code == 200, r.text
    assert r.json() == {"updated": len(tensors), "files": 2}
    assert greedy(c) != before
    r = c.post("/update_weights", json={"path": "original"}, headers=AS_ADMIN)  # relative: from the weights dir
    assert r.status_code == 200, r.text
    assert_bit_identical(state, served_state(loop))
    assert greedy(c) == before


def test_serve_cli_wires_the_switches(folders):
    """`tidyrun serve` passes its switches through: keyed routes, the weights dir, and a keyed /shutdown."""
    import httpx

    from server_utils import ServerProcess

    model, weights_dir, _, _ = folders
    srv = ServerProcess("--model", model, "--max-model-len", "64", "--enable-lifecycle-endpoints", "--admin-key",
                        ADMIN, "--weights-dir", weights_dir, "--enable-shutdown-endpoint")
    try:
        assert httpx.get(srv.url + "/is_sleeping").status_code == 401
        assert httpx.get(srv.url + "/is_sleeping", headers=AS_ADMIN).json() == {"is_sleeping": False}
        assert httpx.get(srv.url + "/v1/models").status_code == 200  # no --api-key: /v1 stays open
        r = httpx.post(srv.url + "/update_weights", json={"path": "original"}, headers=AS_ADMIN, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.post(srv.url + "/update_weights", json={"path": model}, headers=AS_ADMIN).status_code == 403
        assert httpx.post(srv.url + "/shutdown").status_code == 401
        assert httpx.post(srv.url + "/shutdown", headers=AS_ADMIN).json() == {"shutting_down": True}
        code = srv.proc.wait(60)
    finally:
        if srv.proc.poll() is None:
            srv.stop()
    assert code == 0


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/embeddings", b'{"input": "a\\ud800b"}'),
    ("/v1/completions", b'{"prompt": "a\xff\xfeb", "max_tokens": 2}'),  # not UTF-8 at all
])
def test_malformed_text_is_a_400(loop, route, body):
    """A lone surrogate is valid JSON but not Unicode: it used to reach the tokenizer and answer 500. (Chat
    messages: tests/test_bad_input.py, with a chat template.)"""
    r = client(loop).post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "not valid Unicode" in error["message"] or "parsing the body" in error["message"], error


def test_unknown_paths_share_one_metrics_label(loop):
    """404s (made-up URLs, disabled admin routes) are counted under "unmatched", not one label per path."""
    c = client(loop)
    for path in ("/made-up-1", "/made-up-2", "/sleep"):
        assert c.post(path).status_code == 404
    assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
    text = c.get("/metrics").text
    assert 'route="unmatched",status="404"} 3.0' in text, text
    assert 'route="/v1/completions",status="400"} 1.0' in text, text  # a served route keeps its own label
    assert "made-up" not in text and 'route="/sleep"' not in text
