"""A service whose node-local plane cannot start serves on gRPC alone (shared/runtime/serving.py)."""

from __future__ import annotations

import json
import logging

import pytest

from academus.shared.runtime.config import CommonConfig, load
from academus.shared.runtime.serving import RunningService, ServiceSpec
from tests.integration.test_tls_serving import QUIET, check

pytestmark = pytest.mark.integration


async def test_a_plane_folder_it_cannot_make_leaves_the_service_serving_on_grpc(tmp_path, caplog):
    """The node-local plane only saves time: a socket folder this user cannot make (a host folder mounted root's
    own, in a container) must not stop a worker or scheduler from serving, and the warning says what to fix."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    config = load(CommonConfig, {**QUIET, "ACADEMUS_SOCKET_DIR": str(blocked / "plane")})
    service = RunningService(ServiceSpec("plane-off", config, lambda server: None, [], hop_target=True))
    with caplog.at_level(logging.WARNING, logger="academus"):
        await service.start()
    try:
        assert service.local_plane is None and service.multiplex.local_endpoint == ""
        assert await check(service.address, None) == "SERVING"
        (warning,) = [json.loads(r.getMessage()) for r in caplog.records if "local_plane_off" in r.getMessage()]
        assert warning["folder"] == str(blocked / "plane") and "ACADEMUS_SOCKET_DIR" in warning["fix"]
    finally:
        await service.stop()
