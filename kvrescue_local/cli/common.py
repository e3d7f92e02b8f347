"""What the commands share: the options of the settings (made from settings.SETTINGS) and their grouped help, the
model options, list parsing, JSON output."""

from __future__ import annotations

from pathlib import Path

import click

from ..bench.estimate import scaled
from ..errors import KVRescueError, SettingError
from ..files import json_text, write_output
from ..rescue.rules import CHOICE_SPECS
from ..settings import BY_FIELD, DEFAULTS, GROUPS, NON_NEGATIVE, SETTINGS, Setting, command_line_name, range_text


def preset_default(value) -> str:
    return f"[default: the preset's, else {value}]"


HEADINGS = {"common": "Options", "eviction": "Eviction options", "sampling": "Sampling options",
            "rule": "Commit rule options", "detector": "Detector options", "llama.cpp": "llama.cpp options"}


class GroupedOption(click.Option):
    """An option shown in a group of its command's help (settings.GROUPS)."""

    def __init__(self, *args, group: str = "common", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group


class SettingsCommand(click.Command):
    """A command whose options are grouped in its help, the common ones first, as llama.cpp's help shows them; a
    refused setting (SettingError) is named by this command's own option for it (bench run's --budgets, where it
    sweeps the budget)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict[str, list] = {group: [] for group in GROUPS}
        for param in (p for p in self.get_params(ctx) if isinstance(p, click.Option)):
            record = param.get_help_record(ctx)
            if record is not None:
                rows[getattr(param, "group", "common")].append(record)
        for group, records in rows.items():
            if records:
                with formatter.section(HEADINGS[group]):
                    formatter.write_dl(records)

    def option_name(self, field: str) -> str:
        setting = BY_FIELD.get(field)
        flags = {flag for param in self.params for flag in param.opts}
        if setting is not None and setting.axis in flags and setting.flag not in flags:
            return setting.axis
        return command_line_name(field)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SettingError as exc:
            raise KVRescueError(exc.worded(self.option_name)) from None


def setting_option(setting: Setting):
    """The command-line option of a setting: unset (None), it takes the preset's recipe, else RescueConfig's default
    (compose.py)."""
    help_text = f"{setting.help} [default: {setting.default_text}]"
    if setting.switch:
        return click.option(setting.flags[0], setting.param, cls=GroupedOption, group=setting.group, default=None,
                            help=help_text)
    return click.option(*setting.flags, setting.param, cls=GroupedOption, group=setting.group, type=setting.kind,
                        help=help_text)


def setting_options(*fields: str):
    """A decorator adding the options of these settings, in this order."""
    def decorate(command):
        for field in reversed(fields):
            command = setting_option(BY_FIELD[field])(command)
        return command
    return decorate


RULE_HELP = f"{BY_FIELD['rule'].help} [default: {BY_FIELD['rule'].default_text}]"

FITTED_FOR_HELP = ("DATASET: the preset's rule fitted for that dataset's problems applies (bench run --dataset "
                   "applies its own; a --data file's problems take the preset's default without it), e.g. gsm8k")

# what the options that set a rule before rules were specs say in one
OLD_RULE_OPTIONS = {
    "--choice": lambda v: " --rule ".join(CHOICE_SPECS.get(x.strip(), "judge") for x in str(v).split(",") if x.strip()),
    "--pick-margin": lambda v: f"judge:margin={v} (or lead:SIDE,pick={v})",
    "--helper-margin": lambda v: f"lead:base,margin={v}",
    "--base-margin": lambda v: f"lead:helper,margin={v}",
    "--judge-max-budget": lambda v: f"by-budget:{v},judge,lead:base",
    "--weak-base-choice": lambda v: f"by-budget:BUDGET,{CHOICE_SPECS.get(v, 'judge')},lead:base",
    "--check-arithmetic": lambda v: "arith:RULE (e.g. arith:judge)" if v else "RULE without arith:",
}


def refuse_old_rule_option(ctx, param, value) -> None:
    """An option of the rules before they were specs: one Error line naming the spec that says the same."""
    if value is None or value == ():
        return
    option = "--check-arithmetic" if param.name == "check_arithmetic" else param.opts[0]
    given = next(iter(value)) if isinstance(value, tuple) else value
    shown = option if option != "--check-arithmetic" or given else "--no-check-arithmetic"
    raise KVRescueError(f"{shown} is gone: commit rules are specs now, pass --rule {OLD_RULE_OPTIONS[option](given)} "
                        "(docs/prm.md lists the rules)")


REFUSED_RULE_OPTIONS = [
    *(click.option(name, hidden=True, expose_value=False, callback=refuse_old_rule_option)
      for name in OLD_RULE_OPTIONS if name != "--check-arithmetic"),
    click.option("--check-arithmetic/--no-check-arithmetic", default=None, hidden=True, expose_value=False,
                 callback=refuse_old_rule_option),
]


MODEL_OPTIONS = [
    click.option("--preset", default="toy", show_default=True,
                 help="model preset, or a folder `kvrescue-local fit` wrote (overridden by --base/--helper/--prm)"),
    click.option("--base", help="base model (evicted): a GGUF path, owner/repo:FILE.gguf or owner/repo:QUANT"),
    click.option("--helper", help="helper model (full context): a GGUF path, owner/repo:FILE.gguf or owner/repo:QUANT"),
    click.option("--prm", help="PRM: a backbone GGUF path (its .head.npz beside it, or PATH.gguf:HEAD.npz), a hub "
                               "checkpoint owner/repo, or helper[:HEAD.npz]: a head on the helper's own context (the "
                               "preset's helper head, or that one)"),
    click.option("--rpc", cls=GroupedOption, group="llama.cpp",
                 help="host:port[,host:port...]: offload the models' layers to these `kvrescue-local rpc-server`s "
                      "(every layer unless -ngl says how many; needs a build with --rpc)"),
    click.option("--prm-ctx", type=NON_NEGATIVE, default=0, show_default=True, cls=GroupedOption, group="llama.cpp",
                 help="PRM context in its own tokens (0: sized from the problem; it grows as the trajectory does)"),
    *REFUSED_RULE_OPTIONS,
]


def search_options(sweep: bool = False):
    """A decorator adding the model options, one option per setting (settings.SETTINGS) and the refused options of
    the rules before they were specs; with `sweep` (bench run) not those of the settings its axes sweep."""
    fields = [setting.field for setting in SETTINGS if not (sweep and setting.axis)]

    def decorate(command):
        command = setting_options(*fields)(command)
        for option in reversed(MODEL_OPTIONS):
            command = option(command)
        return command
    return decorate


def settings_reference() -> str:
    """docs/usage.md's table of the settings, made from the schema (tests/test_docs.py keeps the doc equal to it)."""
    lines = ["| option | request field | values | default | what |", "|---|---|---|---|---|"]
    for group in GROUPS:
        for setting in (s for s in SETTINGS if s.group == group):
            flags = " ".join(f"`{flag}`" for flag in setting.flags)
            request = f"`{setting.request}`" if setting.request else "(not per request)"
            what = setting.help.replace("|", "\\|")
            lines.append(f"| {flags} | {request} | {range_text(setting)} | {setting.default_text} "
                         f"| {group}: {what} |")
    return "\n".join(lines) + "\n"


UNITS = {"k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}
MAX_SIZE = 2 ** 63 - 1  # llama.cpp and the OS count bytes in 64 bits


def parse_size(text: str, option: str) -> int:
    """'512M', '8G', '1.5GiB' or bytes -> bytes; a size that is not finite ('infG', '1e400k') or beyond 64 bits
    is refused."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        size = scaled(value[:-1], UNITS[value[-1]]) if value and value[-1] in UNITS else int(value)
    except ValueError:
        raise KVRescueError(f"{option} takes a size like 512M or 8G, not {text!r}") from None
    if size <= 0:
        raise KVRescueError(f"{option} must be a positive size, not {text!r}")
    if size > MAX_SIZE:
        raise KVRescueError(f"{option} {text} is larger than any memory (8 EiB, 64-bit byte counts): give a size "
                            "like 512M or 8G")
    return size


def name_list(text: str, allowed, what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in allowed]
    if unknown or not names:
        raise KVRescueError(f"unknown {what} {', '.join(unknown) or repr(text)}: use {', '.join(sorted(allowed))}")
    return names


def write_json(path: Path, data: dict, option: str) -> None:
    """Complete file or none (files.write_output); NaN or infinity would not be JSON, so they are refused."""
    write_output(path, json_text(data, f"the record for {option} {path}:", indent=1) + "\n", option)


def note(text: str) -> None:
    click.echo(text, err=True)
