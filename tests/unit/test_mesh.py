"""Local mesh bits that need no processes: Redis selection, state file, key storage."""

from __future__ import annotations

from dataclasses import replace

import pytest

from academus.shared.cli import mesh
from academus.shared.runtime.config import ModelSelection
from academus.shared.state.keys import Keys


def test_redis_url_from_env_is_used_and_not_owned(tmp_path, monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6390/2")
    assert mesh._redis(tmp_path) == ("redis://127.0.0.1:6390/2", None)
    assert not (tmp_path / "redis").exists()


def test_without_redis_url_the_mesh_starts_its_own_with_aof(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("ACADEMUS_REDIS_URL", raising=False)
    url, pid = mesh._redis(tmp_path)
    try:
        import redis

        client = redis.Redis.from_url(url, decode_responses=True)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("dir")["dir"] == str(tmp_path / "redis")
    finally:
        redis.Redis.from_url(url).shutdown()
    assert pid


def test_status_without_a_mesh_says_how_to_start_one(tmp_path):
    with pytest.raises(mesh.MeshError, match="academus up"):
        mesh.status(tmp_path)


@pytest.mark.parametrize("command", [["down"], ["keys", "list"], ["keys", "create", "acme"], ["tenants", "list"],
                                     ["ramps", "status"],
                                     ["shard", "budget", "--model", "sentiment-sti", "--bytes", "1"]])
def test_a_mesh_command_without_a_mesh_says_how_to_start_one(tmp_path, command, capsys, monkeypatch):
    from academus.shared.cli.main import main

    monkeypatch.delenv("REDIS_URL", raising=False)   # either names a deployed mesh to administer
    monkeypatch.delenv("ACADEMUS_REDIS_URL", raising=False)

    assert main(["--run-dir", str(tmp_path), *command]) == 1
    err = capsys.readouterr().err
    assert "no mesh is running" in err and "academus up" in err


def test_a_deployed_mesh_is_read_from_its_services_settings(tmp_path, monkeypatch):
    """No mesh.json: the Redis, password, key prefix and mesh identity a compose or Kubernetes container has."""
    from academus.shared.cli.pki import make_pki

    pki = make_pki(tmp_path, ["mesh"])
    for name, value in {"ACADEMUS_REDIS_URL": "redis://redis:6379/0", "ACADEMUS_REDIS_PASSWORD": "s3cret",
                        "ACADEMUS_KEY_PREFIX": "prod", "ACADEMUS_MESH_TOKEN": "t0ken", "ACADEMUS_MESH_TLS": "true",
                        "ACADEMUS_MESH_CA": str(pki.ca), "ACADEMUS_MESH_CERT": str(pki.cert("mesh")),
                        "ACADEMUS_MESH_KEY": str(pki.key("mesh")),
                        "ACADEMUS_MESH_SERVER_NAME": "mesh.academus.svc"}.items():
        monkeypatch.setenv(name, value)
    state = mesh.administered(tmp_path / "run")
    assert (state.redis_url, state.key_prefix, state.mesh_token) == ("redis://:s3cret@redis:6379/0", "prod", "t0ken")
    identity = state.mesh_tls()
    assert identity.server_name == "mesh.academus.svc" and identity.ca == pki.ca.read_bytes()
    assert not (tmp_path / "run").exists()


def test_admin_key_is_stable_private_and_stored_hashed(tmp_path, redis_url):
    state = mesh.MeshState(str(tmp_path), redis_url, None, "", "acd")
    key = mesh.ensure_admin_key(state)
    assert mesh.ensure_admin_key(state) == key
    assert (tmp_path / mesh.ADMIN_KEY_FILE).stat().st_mode & 0o077 == 0
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert client.hgetall(Keys().api_key(key)) == {"tenant": "admin", "role": "admin"}
    assert not any(key in k for k in client.keys("*"))


def test_workers_are_one_a_gpu_instance_under_mps_and_plain_processes_on_cpu(tmp_path):
    from academus.shared.cli.mesh import MeshOptions, _worker_envs

    gpu = _worker_envs(MeshOptions(run_dir=tmp_path, workers=1, instances=2, gpus=2))
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpu] == ["0", "0", "1", "1"]
    assert {e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for e in gpu} == {"50"}
    assert {e["ACADEMUS_INSTANCES"] for e in gpu} == {"1"}
    assert _worker_envs(MeshOptions(run_dir=tmp_path, workers=3, gpus=0)) == [{}, {}, {}]


def test_a_deployment_names_a_known_policy():
    from academus.shared.cli.mesh import Deployment, MeshError

    assert Deployment.parse("student=sentiment-students,spam-students") == Deployment(
        "student", "sentiment-students,spam-students")
    with pytest.raises(MeshError, match="policy must be one of"):
        Deployment.parse("fastest=spam")


def _fake_table(directory, lower_layers: int, model: str = "minilm") -> None:
    """A manifest only: the mesh reads it to configure the plot service, which checks the files."""
    from academus.shared.models.plot.table import PlotManifest

    (directory / "root").mkdir(parents=True)
    manifest = PlotManifest(model=model, teacher="t", lower_layers=lower_layers, hidden=384, vocab_size=10,
                            special_ids={}, version="root", counts={}, files={})
    (directory / "root" / "manifest.json").write_text(manifest.to_json())


def test_the_plot_service_starts_only_when_a_table_is_built(tmp_path):
    from academus.shared.cli.mesh import MeshOptions, _plan

    options = MeshOptions(run_dir=tmp_path / "run", artifacts=tmp_path, workers=2, gpus=0)
    assert [name for name, _ in _plan(options, [{}, {}])] == ["resource_manager", "adapter_store", "trainer",
                                                              "worker", "scheduler", "gateway"]
    _fake_table(tmp_path / "plot" / "minilm-k2", 2)
    plan = dict(_plan(options, [{}, {}]))
    assert list(plan) == ["resource_manager", "adapter_store", "trainer", "plot", "worker", "scheduler", "gateway"]
    assert plan["plot"] == [{"ACADEMUS_PLOT_DIR": str(tmp_path / "plot" / "minilm-k2"), "ACADEMUS_MODEL": "minilm",
                             "ACADEMUS_LOWER_LAYERS": "2", "ACADEMUS_PLOT_ID": "plot-0"}]
    assert len(plan["worker"]) == 2


def test_the_mesh_serves_the_table_the_catalogue_names(tmp_path):
    import json

    from academus.shared.models.plot.table import plot_tables

    _fake_table(tmp_path / "plot" / "minilm-k1", 1)
    _fake_table(tmp_path / "plot" / "minilm-k3", 3)
    assert plot_tables(tmp_path) == [tmp_path / "plot" / "minilm-k1"]
    (tmp_path / "models.json").write_text(json.dumps({"minilm": {"kind": "embedding"},
                                                      "minilm-plot": {"plot": "plot/minilm-k3"}}))
    assert plot_tables(tmp_path) == [tmp_path / "plot" / "minilm-k3"]


def test_each_table_the_catalogue_names_gets_a_plot_service_of_its_own(tmp_path):
    """The teacher's table and one on a user's model: two plot services, each announcing its model and K (the
    scheduler prefetches from the one holding a model's table); a table no entry names is not served."""
    import json

    from academus.shared.cli.mesh import MeshOptions, _plan

    _fake_table(tmp_path / "plot" / "minilm-k3", 3)
    _fake_table(tmp_path / "plot" / "mine-k2", 2, model="mine")
    _fake_table(tmp_path / "plot" / "minilm-k1", 1)
    (tmp_path / "models.json").write_text(json.dumps({
        "minilm-plot": {"plot": "plot/minilm-k3"}, "spam-plot": {"plot": "plot/minilm-k3"},
        "mine-plot": {"plot": "plot/mine-k2"}, "gone-plot": {"plot": "plot/never-built"}}))
    plan = dict(_plan(MeshOptions(run_dir=tmp_path / "run", artifacts=tmp_path, gpus=0), [{}]))
    assert [(e["ACADEMUS_PLOT_DIR"], e["ACADEMUS_MODEL"], e["ACADEMUS_LOWER_LAYERS"], e["ACADEMUS_PLOT_ID"])
            for e in plan["plot"]] == [(str(tmp_path / "plot" / "minilm-k3"), "minilm", "3", "plot-0"),
                                       (str(tmp_path / "plot" / "mine-k2"), "mine", "2", "plot-1")]


def test_domain_overlays_extend_the_teachers_table_whatever_the_catalogue_names_first(tmp_path, monkeypatch):
    """Tenant domains sit on minilm-plot and their overlays are built with the teacher's layers: a table on a
    user's model named first is not theirs."""
    import json

    from academus.shared.models.plot.domains import root_table

    monkeypatch.setenv("ACADEMUS_ARTIFACTS", str(tmp_path))
    _fake_table(tmp_path / "plot" / "mine-k2", 2, model="mine")
    (tmp_path / "models.json").write_text(json.dumps({"mine-plot": {"plot": "plot/mine-k2"}}))
    assert root_table() is None
    _fake_table(tmp_path / "plot" / "minilm-k3", 3)
    (tmp_path / "models.json").write_text(json.dumps({"mine-plot": {"plot": "plot/mine-k2"},
                                                      "minilm-plot": {"plot": "plot/minilm-k3"}}))
    assert root_table() == tmp_path / "plot" / "minilm-k3"


def test_a_mesh_needs_at_least_one_gateway_and_one_node(tmp_path):
    with pytest.raises(mesh.MeshError, match="gateways must be >= 1, not 0"):
        mesh.up(mesh.MeshOptions(run_dir=tmp_path, gateways=0))
    with pytest.raises(mesh.MeshError, match="nodes must be >= 1, not 0"):
        mesh.up(mesh.MeshOptions(run_dir=tmp_path, nodes=0))
    assert not (tmp_path / mesh.STATE_FILE).exists()   # refused before anything started


def test_a_port_handed_out_but_not_bound_yet_is_not_handed_out_again(monkeypatch):
    offered = iter([42335, 42335, 42336])   # the OS may offer a port again until someone binds it
    monkeypatch.setattr(mesh, "free_port", lambda: next(offered))
    taken = {42335}                          # the gateways' port, which they bind only once started
    assert mesh.unused_port(taken) == 42336 and taken == {42335, 42336}


def test_a_sharded_deployment_is_one_scheduler_process_a_shard(tmp_path):
    from academus.shared.cli.mesh import Deployment, MeshError, MeshOptions, _plan

    assert Deployment.parse("student=sentiment-students/3") == Deployment("student", "sentiment-students", 3)
    assert Deployment.parse("padded/2") == Deployment("padded", "", 2)
    for bad in ("student=a/0", "student=a/two", "student=a/-1", "student=a/\u00b2"):
        with pytest.raises(MeshError, match="shards must be a whole number >= 1"):
            Deployment.parse(bad)
    options = MeshOptions(run_dir=tmp_path / "run", artifacts=tmp_path, workers=1, gpus=0,
                          deployments=[Deployment("student", "ss", 2), Deployment("padded", "t")])
    schedulers = dict(_plan(options, [{}]))["scheduler"]
    assert schedulers == [
        {"ACADEMUS_MODELS": "ss", "ACADEMUS_POLICY": "student", "ACADEMUS_SCHEDULER_ID": "scheduler-0.0",
         "ACADEMUS_SHARDS": "2", "ACADEMUS_SHARD": "0"},
        {"ACADEMUS_MODELS": "ss", "ACADEMUS_POLICY": "student", "ACADEMUS_SCHEDULER_ID": "scheduler-0.1",
         "ACADEMUS_SHARDS": "2", "ACADEMUS_SHARD": "1"},
        {"ACADEMUS_MODELS": "t", "ACADEMUS_POLICY": "padded", "ACADEMUS_SCHEDULER_ID": "scheduler-1",
         "ACADEMUS_SHARDS": "1", "ACADEMUS_SHARD": "0"}]   # set even unsharded: an inherited value must not split it


def test_a_mesh_of_several_nodes_spreads_the_workers_and_runs_a_scheduler_a_node(tmp_path):
    from academus.shared.cli.mesh import Deployment, MeshOptions, _plan, _worker_envs

    options = MeshOptions(run_dir=tmp_path / "run", artifacts=tmp_path, workers=3, gpus=0, nodes=2,
                          deployments=[Deployment("student", "ss", 2)])
    assert _worker_envs(options) == [{"ACADEMUS_NODE": "node-0"}, {"ACADEMUS_NODE": "node-1"},
                                     {"ACADEMUS_NODE": "node-0"}]
    schedulers = dict(_plan(options, _worker_envs(options)))["scheduler"]
    assert [(s["ACADEMUS_SCHEDULER_ID"], s["ACADEMUS_NODE"], s["ACADEMUS_SHARD"]) for s in schedulers] == [
        ("scheduler-0.0@node-0", "node-0", "0"), ("scheduler-0.1@node-0", "node-0", "1"),
        ("scheduler-0.0@node-1", "node-1", "0"), ("scheduler-0.1@node-1", "node-1", "1")]
    one = replace(options, nodes=1)
    assert _worker_envs(one) == [{}, {}, {}]        # one node: no name, as before
    assert all("ACADEMUS_NODE" not in s for s in dict(_plan(one, [{}]))["scheduler"])


def test_academus_up_refuses_a_bad_setting_with_a_message_not_a_traceback(tmp_path, capsys):
    from academus.shared.cli.main import main

    assert main(["--run-dir", str(tmp_path), "up", "--nodes", "0", "--detach"]) == 2
    assert "nodes must be >= 1, not 0" in capsys.readouterr().err
    assert not (tmp_path / mesh.STATE_FILE).exists()


def _catalogue(tmp_path, entries: dict) -> mesh.MeshOptions:
    import json

    (tmp_path / "models.json").write_text(json.dumps(entries))
    return mesh.MeshOptions(run_dir=tmp_path / "run", artifacts=tmp_path)


def test_without_a_deployment_student_groups_get_the_student_policy_and_every_other_model_concat(tmp_path,
                                                                                                monkeypatch):
    monkeypatch.delenv("ACADEMUS_POLICY", raising=False)
    options = _catalogue(tmp_path, {"minilm": {"kind": "embedding"}, "sentiment": {"kind": "classification"},
                                    "sentiment-students": {"students": "students/sentiment"},
                                    "sentiment-2l": {"students": "students/sentiment", "limit_students": 1}})
    concat = "-sentiment-2l,-sentiment-students"   # every model but the groups: one added later included
    assert mesh.default_deployments(options) == [mesh.Deployment("student", "sentiment-2l,sentiment-students"),
                                                 mesh.Deployment("concat", concat)]
    schedulers = dict(mesh._plan(options, []))["scheduler"]
    assert [(e["ACADEMUS_POLICY"], e["ACADEMUS_MODELS"]) for e in schedulers] == [
        ("student", "sentiment-2l,sentiment-students"), ("concat", concat)]
    selection = ModelSelection.parse(concat)
    assert "minilm" in selection and "added-later" in selection and "sentiment-students" not in selection
    assert selection.describe() == "every model but sentiment-2l, sentiment-students"
    assert ModelSelection.parse("").describe() == "every model" and ModelSelection.parse("b,a").describe() == "a, b"


def test_without_student_groups_every_model_is_one_concat_deployment(tmp_path, monkeypatch):
    monkeypatch.delenv("ACADEMUS_POLICY", raising=False)
    assert mesh.default_deployments(_catalogue(tmp_path, {"minilm": {}})) == [mesh.Deployment("concat")]
    assert mesh.default_deployments(mesh.MeshOptions(run_dir=tmp_path, artifacts=tmp_path / "none")) == [
        mesh.Deployment("concat")]


def test_academus_policy_set_is_one_deployment_of_it_for_every_model(tmp_path, monkeypatch):
    options = _catalogue(tmp_path, {"minilm": {}, "sentiment-students": {"students": "students/sentiment"}})
    monkeypatch.setenv("ACADEMUS_POLICY", "fifo")
    assert mesh.default_deployments(options) == [mesh.Deployment("fifo")]
    monkeypatch.delenv("ACADEMUS_POLICY")
    assert mesh.default_deployments(replace(options, env={"ACADEMUS_POLICY": "padded"})) == [
        mesh.Deployment("padded")]
