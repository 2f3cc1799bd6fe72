"""The `academus` command: up, down, status, infer, prepare, models, keys, tenants, adapters, trace (DESIGN.md §9)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
from dataclasses import asdict
from pathlib import Path

from academus.shared.runtime.config import (
    ModelSelection,
    artifacts_dir,
    offline_hub,
    run_dir,
    trace_file,
    use_artifacts,
)
from academus.shared.runtime.config_docs import add_arguments as add_config_docs_arguments
from academus.shared.runtime.config_docs import write_or_check
from academus.shared.runtime.heap import keep_freed_pages


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    keep_freed_pages()    # as a service does: a command's models and batches (prepare, distill, shard profile)
    p = parser()
    args, extra = p.parse_known_args(argv)
    if args.command in PASS_THROUGH:  # their own parsers own their options (and --help)
        args.rest = extra
    elif extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except RuntimeError as e:   # the mesh module loads only with the commands that need it
        from academus.shared.cli.mesh import MeshError

        if not isinstance(e, MeshError):
            raise
        print(e, file=sys.stderr)   # no mesh running there, or a setting it refused
        return 1


PASS_THROUGH = {"prepare", "loadgen", "distill", "plot", "heads", "ramps", "shard"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="academus", description="Serve BERT-like encoders at the lowest latency.")
    p.add_argument("--run-dir", type=Path, default=None, help="mesh state, logs and admin key (ACADEMUS_RUN_DIR)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("up", help="start Redis (unless REDIS_URL is set) and every service")
    s.add_argument("--detach", action="store_true", help="return once the mesh is ready")
    s.add_argument("--port", type=int, default=50051, help="gateway port (0: any free port)")
    s.add_argument("--http-port", type=int, default=None,
                   help="serve the HTTP/JSON API (TEI's /embed and /predict, OpenAI's /v1/embeddings) on this port "
                        "too (0: any free port; default: gRPC only)")
    s.add_argument("--workers", type=int, default=1)
    s.add_argument("--gateways", type=int, default=1,
                   help="gateway processes sharing the port (the kernel spreads client connections over them)")
    s.add_argument("--worker-threads", type=int, default=0, help="torch threads per worker (0: default)")
    s.add_argument("--instances", type=int, default=0,
                   help="student instances each worker runs at once (0: 1, or the profile's choice)")
    s.add_argument("--deployment", action="append", default=[], metavar="POLICY[=MODELS][/SHARDS]",
                   help="a scheduler with this policy (fifo|padded|student) for these comma-separated models; "
                        "repeat for side-by-side deployments (default: student groups with student, every other model "
                        "with concat; ACADEMUS_POLICY set: one of it for every model); "
                        "/SHARDS: that many scheduler processes, each running its share of the groups")
    s.add_argument("--nodes", type=int, default=1,
                   help="machines this one stands in for (the cluster's layout on one host): workers spread "
                        "over them in turn, and each deployment runs a scheduler a node, sent its node's groups")
    s.add_argument("--gpus", type=int, default=None,
                   help="GPUs to use (default: every visible one; 0: CPU workers). With GPUs, one worker a "
                        "student instance, pinned with CUDA_VISIBLE_DEVICES and sharing its GPU under MPS")
    s.add_argument("--artifacts", type=Path, default=None)
    s.add_argument("--tls", action="store_true",
                   help="the gateway serves TLS only, its certificate from a new local CA under <run dir>/tls, "
                        "which `academus infer` and `status` trust; the mesh's own Redis gets a password")
    s.add_argument("--mtls", action="store_true",
                   help="--tls, and the services speak mutual TLS among themselves, each with its own certificate "
                        "from that CA")
    s.add_argument("--standby", action="store_true",
                   help="the supervisor keeps a standby process per worker, scheduler and gateway, built and waiting "
                        "(a second copy of each one's memory): a dead one's replacement starts serving at once")
    s.add_argument("--no-launcher", dest="launcher", action="store_false",
                   help="start every service as a plain process, not forked from a warm launcher (by default `up` "
                        "starts one, or uses ACADEMUS_LAUNCHER's: a restarted worker then skips its imports)")
    s.set_defaults(func=cmd_up)

    s = sub.add_parser("down", help="stop the mesh started from this run directory")
    s.set_defaults(func=cmd_down)

    s = sub.add_parser("status", help="every service, its address and health, and Redis (a deployed mesh: what its "
                       "Redis has registered, from ACADEMUS_REDIS_URL)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("infer", help="classify or embed texts through the gateway")
    s.add_argument("--model", required=True)
    s.add_argument("--output", choices=["label", "score", "embedding"], default="")
    gateway_options(s)
    s.add_argument("--no-truncate", action="store_true", help="refuse texts over the token limit")
    s.add_argument("--pair", action="append", default=None, metavar="TEXT",
                   help="the second text of a pair, once for each text, in order (an embedding model scores each pair; "
                        "a classifier of pairs reads it with its text)")
    s.add_argument("--stream", action="store_true",
                   help="early results (exit ramps) as they are released, then the full model's: one JSON line a "
                        "message of InferStream, with `final`, `exit_layer` and its texts' `predictions`")
    s.add_argument("--early-exit", action="store_true",
                   help="answer as soon as every text has a result, from the first confident exit ramp")
    s.add_argument("texts", nargs="+")
    s.set_defaults(func=cmd_infer)

    s = sub.add_parser("tokenize", help="each text's tokens by a model's own tokenizer, untruncated: one JSON line "
                                        "a text")
    s.add_argument("--model", required=True)
    s.add_argument("--no-special-tokens", action="store_true", help="leave the template's [CLS] and [SEP] out")
    gateway_options(s)
    s.add_argument("texts", nargs="+")
    s.set_defaults(func=cmd_tokenize)

    s = sub.add_parser("prepare", help="train the teacher's task heads and write the artifacts", add_help=False)
    s.set_defaults(func=cmd_prepare)

    s = sub.add_parser("distill", help="distil the teacher into a student group (run | report | ablations)",
                       add_help=False)
    s.set_defaults(func=cmd_distill)

    s = sub.add_parser("heads", help="heads train: a linear head on an embedding model you added", add_help=False)
    s.set_defaults(func=cmd_heads)
    s = sub.add_parser("ramps", help="early-exit ramps (Apparate): train --task T | --model NAME [--data F] "
                       "[--quick] | status", add_help=False)
    s.set_defaults(func=cmd_ramps)
    s = sub.add_parser("plot", help="PLOT tables of lower-layer states (build | info | head)", add_help=False)
    s.set_defaults(func=cmd_plot)
    s = sub.add_parser("shard", help="elastic shards (STI): build | adapt | info | verify | profile | plan | budget",
                       add_help=False)
    s.set_defaults(func=cmd_shard)

    s = sub.add_parser("loadgen", help="open-loop load: Poisson, bursts or trace replay; report.json + plots",
                       add_help=False)
    s.set_defaults(func=cmd_loadgen)

    s = sub.add_parser("keys", help="API keys")
    ks = s.add_subparsers(dest="keys_command", required=True)
    k = ks.add_parser("create", help="create a key for a tenant; prints it once (`admin`: an administrator's key). "
                      "Without a local mesh, in a deployed mesh's container: its Redis from ACADEMUS_REDIS_URL")
    k.add_argument("tenant")
    k.set_defaults(func=cmd_keys_create)
    k = ks.add_parser("list", help="every key's id, tenant and role (never the key)")
    k.add_argument("--tenant", help="only this tenant's keys")
    k.set_defaults(func=cmd_keys_list)
    k = ks.add_parser("revoke", help="delete a key, named by its id (8+ hex digits) or the key itself; "
                      "gateways refuse it at once")
    k.add_argument("key", help="an id from `keys list`, or the key")
    k.set_defaults(func=cmd_keys_revoke)
    k = ks.add_parser("rotate", help="a new key for TENANT in place of all its keys; prints it once "
                      "(`admin`: the mesh's own key, rewritten in admin.key)")
    k.add_argument("tenant")
    k.set_defaults(func=cmd_keys_rotate)

    s = sub.add_parser("tenants", help="tenant models: a tenant's adapter + head on a shared base (HMI)")
    ts = s.add_subparsers(dest="tenants_command", required=True)
    t = ts.add_parser("create", help="train NAME's adapter on labelled JSONL, register it; prints the key once")
    _training_args(t)
    t.set_defaults(func=cmd_tenants_create)
    ts.add_parser("list", help="tenants and their models").set_defaults(func=cmd_tenants_list)
    t = ts.add_parser("delete", help="a tenant, its key, models and adapters")
    t.add_argument("name")
    t.set_defaults(func=cmd_tenants_delete)

    s = sub.add_parser("adapters", help="tenant adapters")
    ads = s.add_subparsers(dest="adapters_command", required=True)
    t = ads.add_parser("train", help="train an adapter for an existing tenant and register it as its model")
    t.add_argument("--tenant", required=True)
    _training_args(t, positional=False)
    t.set_defaults(func=cmd_adapters_train)

    s = sub.add_parser("models", help="the user's models: add a transformers directory, list, remove")
    ms = s.add_subparsers(dest="models_command", required=True)
    m = ms.add_parser("add", help="check DIR, copy it under the artifacts, serve it (no restart)")
    m.add_argument("name")
    m.add_argument("--from", dest="source", type=Path, required=True,
                   help="a transformers directory: config.json, safetensors weights, tokenizer")
    m.add_argument("--task", choices=("embed", "classify"), default="",
                   help="default: classify for a …ForSequenceClassification checkpoint, else embed")
    m.add_argument("--pooling", choices=("mean", "cls"), default="",
                   help="embedding models; default: its sentence-transformers config, else mean")
    m.add_argument("--pairs", action="store_true",
                   help="a classifier of text pairs (a cross-encoder: a reranker, NLI): each input is a text and its "
                        "pair, read together as it was trained")
    m.set_defaults(func=cmd_models_add)
    m = ms.add_parser("list", help="the catalogue: each model's kind; a user's model's architecture and size")
    m.set_defaults(func=cmd_models_list)
    m = ms.add_parser("remove", help="unserve a model added with `models add` and delete its copy")
    m.add_argument("name")
    m.set_defaults(func=cmd_models_remove)
    for m in ms.choices.values():
        m.add_argument("--artifacts", type=Path, default=None,
                       help="default: the running mesh's (ACADEMUS_ARTIFACTS without one)")

    s = sub.add_parser("trace", help="print a recorded trace of the local mesh (the latest by default)")
    s.add_argument("trace_id", nargs="?")
    s.set_defaults(func=cmd_trace)

    s = sub.add_parser("certs", help="a CA and the certificates a deployment needs (compose, Kubernetes Secrets)")
    s.add_argument("directory", type=Path, help="where to write them (made, mode 0700)")
    s.add_argument("--gateway-name", action="append", default=[], metavar="NAME",
                   help="a name clients reach the gateway by (DNS name or IP; repeatable; default: localhost, "
                        "127.0.0.1)")
    s.add_argument("--mesh-name", default=MESH_NAME,
                   help=f"the one name every service's mesh certificate holds (ACADEMUS_MESH_SERVER_NAME; "
                        f"default {MESH_NAME})")
    s.set_defaults(func=cmd_certs)

    s = sub.add_parser("config", help="the configuration reference")
    cs = s.add_subparsers(dest="config_command", required=True)
    c = cs.add_parser("docs", help="write docs/configuration.md from the config classes")
    add_config_docs_arguments(c)
    c.set_defaults(func=cmd_config_docs)
    return p


def _run_dir(args: argparse.Namespace) -> Path:
    return args.run_dir or run_dir()


MESH_NAME = "mesh.academus.svc"


def cmd_certs(args: argparse.Namespace) -> int:
    """A new CA, the gateway's certificate for its public names, and one mesh certificate every service presents
    (with ACADEMUS_MESH_SERVER_NAME set to its name). The CA's key stays beside them, to sign more: keep it off
    the hosts that serve."""
    from academus.shared.cli.pki import PkiError, issue, subject_names

    names = args.gateway_name or ["localhost", "127.0.0.1"]
    try:
        pki = issue(args.directory, {"gateway": subject_names(names), "mesh": subject_names([args.mesh_name])},
                    keep_ca_key=True)
    except (PkiError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"ca": str(pki.ca), "ca_key": str(pki.key("ca")),
                      "gateway": {"cert": str(pki.cert("gateway")), "key": str(pki.key("gateway")), "names": names},
                      "mesh": {"cert": str(pki.cert("mesh")), "key": str(pki.key("mesh")),
                               "server_name": args.mesh_name}}))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from academus.shared.cli.mesh import Deployment, MeshError, MeshOptions, down, reap_children, status, up

    try:
        deployments = [Deployment.parse(d) for d in args.deployment]
    except MeshError as e:
        print(str(e), file=sys.stderr)
        return 2
    options = MeshOptions(run_dir=_run_dir(args), artifacts=args.artifacts or artifacts_dir(),
                          gateway_port=args.port, http_port=args.http_port, workers=args.workers,
                          worker_threads=args.worker_threads,
                          instances=args.instances, deployments=deployments, gpus=args.gpus,
                          gateways=args.gateways, nodes=args.nodes, tls=args.tls, mutual_tls=args.mtls,
                          standby=args.standby, launcher=args.launcher,
                          owner_pid=None if args.detach else os.getpid())
    try:
        up(options)
    except MeshError as e:   # refused before it started (a setting, or a mesh already running there)
        print(str(e), file=sys.stderr)
        return 2
    print(json.dumps(status(options.run_dir)))
    if args.detach:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print("mesh is up; Ctrl-C stops it", file=sys.stderr)
    while not stop.wait(1.0):
        reap_children()   # services that died (the supervisor starts them again as its own children)
    down(options.run_dir)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from academus.shared.cli.mesh import down

    print(json.dumps({"stopped": down(_run_dir(args))}))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from academus.shared.cli.mesh import MeshError, status

    try:
        report = status(_run_dir(args))
    except MeshError as e:
        print(json.dumps({"error": str(e)}) if args.json else str(e))
        return 1
    if args.json:
        print(json.dumps(report))
    else:
        _print_status(report)
    healthy = (report["redis"]["health"] == "SERVING" and all(s["health"] == "SERVING" for s in report["services"])
               and report["supervisor"]["health"] != "EXITED")
    return 0 if healthy else 1


def _print_status(report: dict) -> None:
    deployed = report.get("deployed", False)   # its processes are its orchestrator's to restart and count
    redis = report["redis"]
    print(f"{'redis':<16} {redis['url']:<28} {redis['health']:<12}"
          f"{'' if deployed else ' restarts ' + str(redis['restarts'])}")
    if report["http"]:
        print(f"{'http':<16} {report['http']}")
    for s in report["services"]:
        print(f"{s['name']:<16} {s['address']:<28} {s['health']:<12}"
              f"{'' if deployed else ' restarts ' + str(s['restarts'])}")
    if not deployed:
        launcher = report["launcher"]
        print(f"{'launcher':<16} {'pid ' + str(launcher['pid'] or '-'):<28} {launcher['health']:<12} "
              f"restarts {launcher['restarts']}")
        print(f"{'supervisor':<16} {'pid ' + str(report['supervisor']['pid'] or '-'):<28} "
              f"{report['supervisor']['health']}")
    for i, d in enumerate(report["deployments"]):
        models = ModelSelection.parse(d["models"] or "").describe()
        print(f"scheduler-{i:<6} policy {d['policy'] or 'fifo':<8} models {models}")
    for m in report["models"]:
        pooling = f"  pooling {m['pooling']}{', normalized' if m['normalized'] else ''}" if "pooling" in m else ""
        print(f"model {m['name']:<22} {m['kind']:<15} {m['architecture'] or 'bundled':<32} "
              f"layers {m['layers'] or '-':<3} {m['memory_bytes'] / 2**20:8.1f} MiB  "
              f"workers {m['workers']}{pooling}")
        for worker, students in m.get("held_students", {}).items():
            held = " ".join(f"{i}:{'full' if bits == 32 else f'{bits} bits'}" for i, bits in students.items())
            print(f"  {worker:<28} holds students {held or 'none'}")


def positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:   # a call with no time at all could only end DEADLINE_EXCEEDED
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {value}")
    return seconds


def _gateway_of(args: argparse.Namespace) -> tuple[str, str | None, bytes | None] | None:
    """--gateway, --key and --ca's certificate, each defaulting to the local mesh's; None (said on stderr) when they
    cannot be found."""
    from academus.shared.cli.mesh import ADMIN_KEY_FILE, MeshError, MeshState

    key, gateway, ca = args.key, args.gateway, args.ca
    try:
        if gateway is None:
            state = MeshState.load(_run_dir(args))
            gateway, ca = state.gateway, ca or (Path(state.tls_ca) if state.tls_ca else None)
        if key is None and (_run_dir(args) / ADMIN_KEY_FILE).exists():
            key = (_run_dir(args) / ADMIN_KEY_FILE).read_text().strip()
    except MeshError as e:
        print(str(e), file=sys.stderr)
        return None
    try:
        return gateway, key, ca.read_bytes() if ca else None
    except OSError as e:
        print(f"--ca {ca}: cannot read it ({e.strerror})", file=sys.stderr)
        return None


def cmd_tokenize(args: argparse.Namespace) -> int:
    from academus.client import AcademusError, Client

    found = _gateway_of(args)
    if found is None:
        return 2
    gateway, key, root = found
    try:
        with Client(gateway, api_key=key, timeout=args.timeout, tls=args.tls, root_certificates=root) as client:
            tokens = client.tokenize(args.model, args.texts, add_special_tokens=not args.no_special_tokens)
    except AcademusError as e:
        print(e.code, file=sys.stdout)
        print(f"{e.code}: {e.details}", file=sys.stderr)
        return 1
    for text, cut in zip(args.texts, tokens, strict=True):
        print(json.dumps({"text": text, "count": len(cut), "tokens": [asdict(t) for t in cut]}))
    return 0


def gateway_options(s: argparse.ArgumentParser) -> None:
    """How a command reaches the gateway: --key, --gateway, --tls, --ca, --timeout."""
    s.add_argument("--key", default=None, help="API key (default: the local admin key)")
    s.add_argument("--gateway", default=None, help="host:port (default: the local mesh's gateway)")
    s.add_argument("--tls", action="store_true",
                   help="connect over TLS (the local mesh's gateway: on when it was started with --tls)")
    s.add_argument("--ca", type=Path, default=None,
                   help="PEM file of the CA the gateway's certificate is signed by (implies --tls; default: the "
                        "local mesh's CA, else the system's roots)")
    s.add_argument("--timeout", type=positive_seconds, default=10.0, help="seconds (> 0)")


def cmd_infer(args: argparse.Namespace) -> int:
    from academus.client import AcademusError, Client

    if args.pair is not None and len(args.pair) != len(args.texts):
        print(f"--pair: {len(args.pair)} given for {len(args.texts)} texts; give one for each text", file=sys.stderr)
        return 2
    found = _gateway_of(args)
    if found is None:
        return 2
    gateway, key, root = found
    if args.stream and args.pair is not None:
        print("--stream: text pairs have no early results (exit ramps are trained on single texts)", file=sys.stderr)
        return 2
    truncate = False if args.no_truncate else None
    try:
        with Client(gateway, api_key=key, timeout=args.timeout, tls=args.tls, root_certificates=root) as client:
            if args.stream:
                for result in client.infer_stream(args.model, args.texts, args.output, truncate=truncate):
                    first = result.predictions[0]
                    print(json.dumps({"final": first.final, "exit_layer": first.exit_layer,
                                      "predictions": [_prediction_line(args, p) for p in result.predictions]}),
                          flush=True)
                return 0
            result = client.infer(args.model, args.texts, args.output, pairs=args.pair, truncate=truncate,
                                  early_exit=args.early_exit)
    except AcademusError as e:
        print(e.code, file=sys.stdout)
        print(f"{e.code}: {e.details}", file=sys.stderr)
        return 1
    for p in result.predictions:
        extra = {"final": p.final, "exit_layer": p.exit_layer} if args.early_exit else {}
        print(json.dumps(_prediction_line(args, p) | extra))
    return 0


def _prediction_line(args: argparse.Namespace, p) -> dict:
    """What `academus infer` prints for one prediction."""
    text = args.texts[p.input_index]
    if args.pair is not None:
        return {"text": text, "text_pair": args.pair[p.input_index], "score": p.score}
    if p.embedding:
        return {"text": text, "embedding": p.embedding}
    if args.output == "score":
        return {"text": text, "score": p.score}
    return {"text": text, "label": p.label, "probs": p.probs}


def cmd_prepare(args: argparse.Namespace) -> int:
    from academus.shared.training.prepare import main as prepare_main

    return prepare_main(args.rest)


def cmd_distill(args: argparse.Namespace) -> int:
    from academus.shared.training.distill_cli import main as distill_main

    return distill_main(_with_mesh_artifacts(args, args.rest))


def _with_mesh_artifacts(args: argparse.Namespace, rest: list[str]) -> list[str]:
    """A pass-through command's arguments, with the running mesh's artifacts unless --artifacts is given: what
    it writes is then what the mesh's workers read."""
    if any(a == "--artifacts" or a.startswith("--artifacts=") for a in rest):
        return rest
    return [*rest, "--artifacts", str(_mesh_artifacts(args))]


def cmd_ramps(args: argparse.Namespace) -> int:
    """`ramps train` writes to the running mesh's artifacts (its workers load the new ramps within a second);
    `ramps status` prints every worker's ramps: active layers, thresholds, window agreement, exits, tunings and
    the latest changes with their reasons."""
    if args.rest[:1] == ["status"]:   # a Redis read: no torch to import
        return _with_mesh_redis(args, ramp_status)
    if args.rest[:1] != ["train"]:
        print("usage: academus ramps train (--task TASK | --model NAME [--data F.jsonl | --task TASK]) [--quick] | "
              "academus ramps status", file=sys.stderr)
        return 2
    from academus.shared.training.ramps import main as ramps_main

    return ramps_main(["train", *_with_mesh_artifacts(args, args.rest[1:])])


async def ramp_status(redis, keys) -> dict:
    """Worker id -> model -> its ramps' state, as the workers publish it."""
    out = {}
    async for key in redis.scan_iter(match=keys.ramps("*")):
        out[key.rsplit(":", 1)[-1]] = {m: json.loads(v) for m, v in (await redis.hgetall(key)).items()}
    return out


def cmd_heads(args: argparse.Namespace) -> int:
    from academus.shared.training.user_heads import main as heads_main

    if args.rest[:1] != ["train"]:
        print("usage: academus heads train --model NAME (--task TASK | --data F.jsonl) [--name HEAD]", file=sys.stderr)
        return 2
    return heads_main(_with_mesh_artifacts(args, args.rest[1:]))


def cmd_plot(args: argparse.Namespace) -> int:
    """`plot build` and `plot head` write into the running mesh's artifacts (its workers serve what they register)."""
    from academus.shared.training.plot_build import main as plot_main

    return plot_main(_with_mesh_artifacts(args, args.rest) if args.rest[:1] in (["build"], ["head"]) else args.rest)


def cmd_shard(args: argparse.Namespace) -> int:
    """Shards are built into the running mesh's artifacts when one runs (else ACADEMUS_ARTIFACTS); `shard budget
    --model M --bytes N` sets a shard-served model's parameter-memory budget on every worker serving it."""
    if args.rest[:1] == ["budget"]:   # a Redis write: no torch to import
        p = argparse.ArgumentParser(prog="academus shard budget")
        p.add_argument("--model", required=True, help="a model served from shards, e.g. sentiment-sti")
        p.add_argument("--bytes", type=int, required=True, help="parameter memory; 0: the default")
        budget = p.parse_args(args.rest[1:])
        return _with_mesh_redis(args, lambda redis, keys: set_shard_budget(redis, keys, budget.model, budget.bytes))
    from academus.shared.training.shard_plans import main as shard_main

    return shard_main(_with_mesh_artifacts(args, args.rest))


async def set_shard_budget(redis, keys, model: str, budget_bytes: int) -> dict:
    """Worker id -> its budget and resident bytes after the change; a worker refusing it raises its error."""
    import grpc

    from academus.shared.runtime.errors import NotFound, from_rpc_error
    from academus.shared.runtime.serving import channel
    from academus.v1 import worker_pb2, worker_pb2_grpc

    workers = sorted(await redis.smembers(keys.placement(model)))
    if not workers:
        raise NotFound(f"no worker serves {model!r}")
    out = {}
    for worker_id in workers:
        address = await redis.hget(keys.worker(worker_id), "address")
        if not address:
            continue
        async with channel(address) as ch:
            try:
                reply = await worker_pb2_grpc.WorkerStub(ch).SetShardBudget(
                    worker_pb2.ShardBudgetRequest(model=model, budget_bytes=budget_bytes), timeout=10)
            except grpc.aio.AioRpcError as e:
                raise from_rpc_error(e, f"worker {worker_id}") from e
        out[worker_id] = {"budget_bytes": reply.budget_bytes, "resident_bytes": reply.resident_bytes}
    return out


def cmd_loadgen(args: argparse.Namespace) -> int:
    from academus.loadgen.cli import main as loadgen_main

    rest = list(args.rest)
    if args.run_dir and "--run-dir" not in rest and rest[:1] in (["run"], ["compare"]):
        rest += ["--run-dir", str(args.run_dir)]
    return loadgen_main(rest)


def cmd_keys_create(args: argparse.Namespace) -> int:
    from academus.shared.cli.mesh import administered, create_key
    from academus.shared.state.api_keys import ADMIN

    role = ADMIN if args.tenant == ADMIN else "tenant"   # a deployed mesh's administrator has no admin.key
    key = create_key(administered(_run_dir(args)), args.tenant, role)
    print(json.dumps({"tenant": args.tenant, "key": key}))
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from academus.shared.state.api_keys import ApiKeys

    async def listed(redis, keys) -> list[dict]:
        return [{"id": r.key_id, "tenant": r.tenant, "role": r.role}
                for r in await ApiKeys(redis, keys).list(args.tenant)]

    return _with_mesh_redis(args, listed)


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from academus.shared.state.api_keys import ApiKeys

    async def revoked(redis, keys) -> dict:
        record = await ApiKeys(redis, keys).revoke(args.key)
        return {"revoked": record.key_id, "tenant": record.tenant}

    return _with_mesh_redis(args, revoked)


def cmd_keys_rotate(args: argparse.Namespace) -> int:
    from academus.shared.cli.mesh import ADMIN_KEY_FILE
    from academus.shared.state.api_keys import ADMIN, ApiKeys
    from academus.shared.state.artifacts import write_atomic

    kept = _run_dir(args) / ADMIN_KEY_FILE   # the command line's own key, where `up` put it

    async def rotated(redis, keys) -> dict:
        key, old = await ApiKeys(redis, keys).rotate(args.tenant)
        if args.tenant == ADMIN and kept.exists():   # a deployed mesh's administrator keeps the printed key
            write_atomic(kept, key, mode=0o600)
        return {"tenant": args.tenant, "key": key, "revoked": [r.key_id for r in old]}

    return _with_mesh_redis(args, rotated)


def _training_args(p: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        p.add_argument("name", help="the tenant, and its model's name")
    else:
        p.add_argument("--name", required=True, help="the model's name (a new version if it exists)")
    p.add_argument("--base", default="minilm", help="the served base model the adapter runs on: minilm, "
                   "minilm-plot (PLOT lookups for the lower layers; needs `academus plot build`), or an embedding "
                   "model added with `academus models add`")
    p.add_argument("--domain", default="", help="PLOT overlay the model's texts are looked up in first "
                   "(a minilm-plot base only)")
    p.add_argument("--data", type=Path, required=True, help='JSONL lines {"text": ..., "label": ...}')
    p.add_argument("--rank", type=int, default=16, help="adapter bottleneck size r")
    p.add_argument("--epochs", type=int, default=8)


def _with_mesh_redis(args: argparse.Namespace, work) -> int:
    """Runs `work(redis, keys)` against the administered mesh's Redis; prints its JSON result last."""
    from academus.shared.cli.mesh import administered
    from academus.shared.runtime.errors import ServingError
    from academus.shared.runtime.redis_conn import connect
    from academus.shared.state.keys import Keys

    state = administered(_run_dir(args))
    state.use_as_mesh()   # the adapter store and the workers take only the mesh's calls
    if state.artifacts:   # what trains here (tenants create|train) reads the catalogue the mesh's workers serve
        use_artifacts(state.artifacts)

    async def run() -> object:
        redis = connect(state.redis_url)
        try:
            return await work(redis, Keys(state.key_prefix))
        finally:
            await redis.aclose()

    try:
        print(json.dumps(asyncio.run(run())))
    except ServingError as e:
        print(f"error: {e.code.name}: {e.message}", file=sys.stderr)
        return 2
    return 0


def cmd_tenants_create(args: argparse.Namespace) -> int:
    from academus.shared.training.onboarding import create_tenant_model

    return _with_mesh_redis(args, lambda redis, keys: create_tenant_model(
        redis, keys, args.name, args.base, args.data, args.rank, args.epochs, domain=args.domain))


def cmd_tenants_list(args: argparse.Namespace) -> int:
    from academus.shared.training.onboarding import list_tenants

    return _with_mesh_redis(args, list_tenants)


def cmd_tenants_delete(args: argparse.Namespace) -> int:
    from academus.shared.training.onboarding import delete_tenant

    return _with_mesh_redis(args, lambda redis, keys: delete_tenant(redis, keys, args.name))


def cmd_adapters_train(args: argparse.Namespace) -> int:
    from academus.shared.training.onboarding import train_tenant_adapter

    return _with_mesh_redis(args, lambda redis, keys: train_tenant_adapter(
        redis, keys, args.tenant, args.name, args.base, args.data, args.rank, args.epochs, domain=args.domain))


def _models_artifacts(args: argparse.Namespace) -> Path:
    """Where the mesh's workers read the catalogue: --artifacts, else the running mesh's, else the default."""
    return args.artifacts or _mesh_artifacts(args)


def _mesh_artifacts(args: argparse.Namespace) -> Path:
    """The running mesh's artifacts (ACADEMUS_ARTIFACTS without one)."""
    from academus.shared.cli.mesh import MeshError, MeshState

    try:
        return Path(MeshState.load(_run_dir(args)).artifacts or artifacts_dir())
    except MeshError:
        return artifacts_dir()


def _refused(work) -> int:
    from academus.shared.models.user_models import ModelRefused

    try:
        print(json.dumps(work(), indent=2))
    except ModelRefused as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_models_add(args: argparse.Namespace) -> int:
    from academus.shared.models.user_models import add_model

    return _refused(lambda: add_model(_models_artifacts(args), args.name, args.source, args.task, args.pooling,
                                      args.pairs))


def cmd_models_list(args: argparse.Namespace) -> int:
    from academus.shared.models.user_models import list_models

    return _refused(lambda: list_models(_models_artifacts(args)))


def cmd_models_remove(args: argparse.Namespace) -> int:
    from academus.shared.models.user_models import remove_model

    def remove() -> dict[str, str]:
        remove_model(_models_artifacts(args), args.name, _tenants_on(args, args.name))
        return {"removed": args.name}

    return _refused(remove)


def _tenants_on(args: argparse.Namespace, base: str) -> list[str]:
    """Tenants whose models run on `base`, read from the running mesh's Redis (none without a mesh)."""
    from academus.shared.cli.mesh import MeshError, MeshState
    from academus.shared.runtime.redis_conn import connect
    from academus.shared.state.keys import Keys
    from academus.shared.state.tenants import TenantRegistry

    try:
        state = MeshState.load(_run_dir(args))
    except MeshError:
        return []

    async def read() -> list[str]:
        redis = connect(state.redis_url)
        try:
            return await TenantRegistry(redis, Keys(state.key_prefix)).tenants_on(base)
        finally:
            await redis.aclose()

    return asyncio.run(read())


def cmd_config_docs(args: argparse.Namespace) -> int:
    return write_or_check(args.out, args.check)


def cmd_trace(args: argparse.Namespace) -> int:
    from academus.shared.runtime.tracing import format_trace, read_traces

    traces = read_traces([Path(trace_file(_run_dir(args) / "traces.jsonl"))])
    if not traces:
        print("no traces recorded", file=sys.stderr)
        return 1
    trace_id = args.trace_id or max(traces, key=lambda t: max(s["end_ns"] for s in traces[t]))
    if trace_id not in traces:
        print(f"trace {trace_id} not found", file=sys.stderr)
        return 1
    print(format_trace(traces[trace_id]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
