"""`python -m academus.shared.cli`, and `run`: the `academus` command."""
import importlib.util
import sys


def run() -> int:
    """The command; installed without the server packages (the client alone), one line says what to install."""
    try:
        from academus.shared.cli.main import main

        return main()
    except ModuleNotFoundError as e:
        if importlib.util.find_spec("torch") is not None:   # a full install: a real fault, with its traceback
            raise
        print(f"academus: this command needs the server packages ({e.name} is missing): "
              "pip install 'academus[server]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run())
