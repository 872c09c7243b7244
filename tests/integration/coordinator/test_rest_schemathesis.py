"""Property-based checks of the REST API against its own OpenAPI schema (schemathesis):
no server errors, responses conform to the documented schemas and status codes."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.support.rest_fuzz import call_and_validate

pytestmark = pytest.mark.integration


@pytest.fixture
def api_schema(coordinator, sim_cluster):
    # A job with members, so generated requests hit real refits and topologies too.
    cluster = sim_cluster(coordinator)
    cluster.trainers(world=1)
    cluster.replica("a")
    cluster.client().trigger("job")
    return schemathesis.openapi.from_url(f"{coordinator.http_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms_and_never_errors(case):
    response = call_and_validate(case)
    assert response.status_code < 500
