"""The command line's entry point (the `kvrescue-local` script, `python3 -m kvrescue_local`, cli.py). Ctrl-C
handling goes in before the heavy imports (numpy, llama.cpp, every command's module), so a Ctrl-C during them
ends the run as one anywhere else does: rc 130 and no traceback."""

from . import interrupts


def main() -> None:
    interrupts.install()
    try:
        from .cli import main as command_line

        command_line()
    except KeyboardInterrupt:
        interrupts.exit_interrupted()
