"""schemathesis against /openapi.json: generated requests of every operation never get a 5xx."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from .conftest import copy_home, start_server


@pytest.fixture(scope="module")
def fuzzed_server(corpus_home, tmp_path_factory, smollm):
    server = start_server(copy_home(corpus_home, tmp_path_factory.mktemp("fuzz")), smollm,
                          RAGCACHE_MAX_NEW_TOKENS=2, RAGCACHE_MAX_TOKENS_CAP=4)  # keep each example short
    yield server
    server.stop()


def test_no_operation_answers_5xx(fuzzed_server):
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")
    failures, operations = [], 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @given(operation.as_strategy())
        @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case):
            response = case.call(base_url=fuzzed_server.url, timeout=120)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} {case.body!r} -> {response.status_code} "
                                f"{response.text[:300]}")

        check()
    assert operations >= 15 and not failures, failures[:5]
