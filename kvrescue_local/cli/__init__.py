"""The `kvrescue-local` command line: every click command lives in this package, one module per
command group (`cli.py` at the repository root and `python3 -m kvrescue_local` hand over to `main`)."""

from __future__ import annotations

import click

from .. import interrupts
from ..errors import KVRescueError, SettingError
from ..files import os_error_message
from ..settings import command_line_name
from .bench import bench
from .doctor import doctor, package_version
from .fit import fit
from .models import models
from .prm import prm
from .report import estimate_command, report
from .rpc import rpc_server
from .serve import serve
from .solve import solve
from .toy import toy


class ProjectErrorsAsOneLine(click.Group):
    """Every KVRescueError (and OSError) reaches the user as `Error: <message>`, never as a traceback; Ctrl-C ends
    the run with rc 130 (click's own handling says "Aborted!" with rc 1)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            interrupts.exit_interrupted()
        except SettingError as exc:  # a command that names settings in its own words has worded it already
            raise click.ClickException(exc.worded(command_line_name)) from None
        except KVRescueError as exc:
            raise click.ClickException(str(exc)) from None
        except OSError as exc:  # a full disk or a vanished folder mid-run: one line, no chained traceback
            raise click.ClickException(os_error_message(exc)) from None


@click.group(cls=ProjectErrorsAsOneLine)
@click.version_option(package_version("kvrescue-local"), prog_name="kvrescue-local")
def main() -> None:
    """KV-Rescue on llama.cpp: an evicted base model rescued by a full-context helper and a PRM."""


for command in (doctor, solve, fit, models, bench, prm, toy, report, estimate_command, serve, rpc_server):
    main.add_command(command)
