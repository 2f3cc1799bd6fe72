"""`python -m academus.shared.cli`, and `run`: the `academus` command."""
import importlib.util
import json
import os
import sys

# one-shot commands whose start is mostly torch's and transformers' imports: with a warm launcher (ACADEMUS_LAUNCHER's,
# else the running mesh's; shared/cli/launcher.py) they run forked from it, on this process's terminal or pipes
FORKED_COMMANDS = frozenset({"adapters", "distill", "heads", "models", "plot", "ramps", "shard", "tenants"})


def run() -> int:
    """The command; installed without the server packages (the client alone), one line says what to install."""
    status = _forked(sys.argv[1:])
    if status is not None:
        return status
    try:
        from academus.shared.cli.main import main

        return main()
    except ModuleNotFoundError as e:
        if importlib.util.find_spec("torch") is not None:   # a full install: a real fault, with its traceback
            raise
        print(f"academus: this command needs the server packages ({e.name} is missing): "
              "pip install 'academus[server]'", file=sys.stderr)
        return 2


def _forked(argv: list[str]) -> int | None:
    """The command's exit status when a warm launcher ran it; None: run it here."""
    from academus.shared.runtime.config import LAUNCHER, LAUNCHER_OFF, child_env

    command, run_dir = _command(argv)
    path = (LAUNCHER.get() or _mesh_launcher(run_dir)) if command in FORKED_COMMANDS else ""
    if not path or path == LAUNCHER_OFF:
        return None
    from academus.shared.cli.launcher import Launch, run_attached

    env = child_env({LAUNCHER.name: LAUNCHER_OFF})   # else the forked command would ask a launcher again
    return run_attached(path, Launch("academus.shared.cli", argv, env, cwd=os.getcwd()))


def _mesh_launcher(run_dir: str) -> str:
    """The launcher of the mesh `academus up` started from the run directory; "": none runs there. Its mesh.json
    read as plain JSON: MeshState's module imports grpc and redis, which this caller never needs."""
    from academus.shared.runtime import config

    try:
        with open(os.path.join(run_dir or config.run_dir(), "mesh.json")) as saved:
            return str(json.load(saved).get("launcher") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def _command(argv: list[str]) -> tuple[str, str]:
    """The subcommand (the first word that is neither an option nor --run-dir's value), and --run-dir's value."""
    words, run_dir = iter(argv), ""
    for word in words:
        if word == "--run-dir":
            run_dir = next(words, "")
        elif word.startswith("--run-dir="):
            run_dir = word.split("=", 1)[1]
        elif not word.startswith("-"):
            return word, run_dir
    return "", run_dir


if __name__ == "__main__":
    sys.exit(run())
