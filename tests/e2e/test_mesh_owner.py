"""A mesh started in process by a bench or a test stops when that process ends, however it ends: killed before
its own `down`, it would otherwise leave every service, Redis and the supervisor restarting them running."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from academus.shared.cli.mesh import STATE_FILE, MeshState, down, pid_alive
from tests.e2e.conftest import wait_for

pytestmark = pytest.mark.e2e

OWNER = """
import sys, time
from pathlib import Path
from academus.shared.cli.mesh import Deployment, MeshOptions, up
up(MeshOptions(run_dir=Path(sys.argv[1]), gateway_port=0, workers=1, worker_threads=1,
               deployments=[Deployment("fifo")], env={"ACADEMUS_MODELS": "spam"}))
print("up", flush=True)
time.sleep(600)
"""


def test_a_mesh_whose_owner_is_killed_stops_entirely(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "up", "the owner's mesh did not start"
        state = MeshState.load(tmp_path)
        assert state.owner_pid == owner.pid and state.supervisor_pid
        pids = {s.name: s.pid for s in state.services} | {"redis": state.redis_pid,
                                                           "supervisor": state.supervisor_pid}
        assert all(pid_alive(pid) for pid in pids.values())
        owner.kill()   # no `down`, no handler: only the supervisor can notice
        owner.wait()
        wait_for(lambda: not any(pid_alive(pid) for pid in pids.values()), timeout_s=60,
                 what=f"every process of the killed owner's mesh to exit: {pids}")
        assert not (tmp_path / STATE_FILE).exists()
    finally:
        owner.kill()
        owner.wait()
        if (tmp_path / STATE_FILE).exists():
            down(tmp_path)
