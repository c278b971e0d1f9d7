"""Schemathesis fuzzes every route of the app's OpenAPI schema: no request may get a 5xx.

Cases come from schemathesis' strategies and run through hypothesis directly
(its pytest plugin is not used), against the app in-process over ASGI.
"""

from __future__ import annotations

import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings

from tidyrun import LLM
from tidyrun.server import EngineLoop, create_app
from tidyrun.synthetic import write_random_checkpoint

EXAMPLES_PER_ROUTE = 50
ADMIN_KEY = "fuzz-admin"


@pytest.fixture(scope="module")
def schema(tmp_path_factory):
    folder = write_random_checkpoint(str(tmp_path_factory.mktemp("fuzz")), "llama-tiny", dtype=torch.float32)
    loop = EngineLoop(LLM(folder, device="cpu", max_model_len=64))
    loop.start()
    # Lifecycle routes on, keyed, reading updates from the checkpoint itself: every route is in the schema.
    app = create_app(loop, "tiny", enable_lifecycle_endpoints=True, admin_key=ADMIN_KEY, weights_dir=folder)
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    report = loop.stop()
    assert report is not None and report.clean


def test_no_server_errors(schema):
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/sleep",
                                              "/update_weights", "/reset_prefix_cache"}
    seen: dict[str, set[int]] = {}
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        def check(case):
            response = case.call(headers={"authorization": f"Bearer {ADMIN_KEY}"})  # past the key, to the routes
            seen.setdefault(f"{op.method.upper()} {op.path}", set()).add(response.status_code)
            assert response.status_code < 500, (
                f"{case.method} {case.path} {case.body!r} -> {response.status_code}: {response.text[:300]}")
            content_type = "".join(response.headers.get("content-type", []))  # schemathesis: header -> list
            if response.status_code >= 400 and content_type.startswith("application/json"):
                assert "error" in response.json()

        check()
    print("\nstatus codes by route:", {k: sorted(v) for k, v in sorted(seen.items())})
