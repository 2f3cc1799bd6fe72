"""`python -m academus.shared.cli`, and `run`: the `academus` command."""
import importlib.util
import os
import sys

# one-shot commands whose start is mostly torch's and transformers' imports: with a warm launcher
# (ACADEMUS_LAUNCHER, shared/cli/launcher.py) they run forked from it, on this process's terminal or pipes
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
    """The command's exit status when the warm launcher ran it; None: run it here."""
    from academus.shared.runtime.config import LAUNCHER, child_env

    path = LAUNCHER.get()
    if not path or _command(argv) not in FORKED_COMMANDS:
        return None
    from academus.shared.cli.launcher import Launch, run_attached

    env = child_env({}, without=(LAUNCHER.name,))   # else the forked command would ask the launcher again
    return run_attached(path, Launch("academus.shared.cli", argv, env, cwd=os.getcwd()))


def _command(argv: list[str]) -> str:
    """The subcommand: the first word that is neither an option nor --run-dir's value."""
    words = iter(argv)
    for word in words:
        if word == "--run-dir":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return ""


if __name__ == "__main__":
    sys.exit(run())
