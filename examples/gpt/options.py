"""How a field of config.Config becomes a command-line option: declared with its help, its default
and its checks (option, derived), turned into argparse's parser (parser_for), and checked once the
Config is made (check). Refusals are argparse's: the message, exit status 2."""

import argparse
import difflib
import os
from dataclasses import field, fields
from typing import get_args

from failures import failure


def option(help=None, default=None, check=None, ok=None, no=None, group=None, **kwargs):
    """A field that is an option: its help, default (a function: called as the parser is built),
    argparse's other keywords (type: the field's), checks: check(config, name) -> the refusal or
    nothing, then ok(config), else the refusal `no` ({c.NAME}: a field); group: the --help heading
    from this option on."""
    checks = [check for check in (check, must(ok, no) if ok else None) if check]
    return field(metadata=dict(help=help, default=default, kwargs=kwargs, checks=checks, group=group))


def derived(check=None):
    """A field computed from the options before the Config is made, not an option itself."""
    return field(metadata=dict(checks=[check] if check else []))


def must(ok, refusal):
    return lambda c, name: None if ok(c) else refusal.format(c=c)


def positive(c, name):
    value = getattr(c, name)
    return value is not None and value <= 0 and f"--{name} must be positive, got {value}"


def not_negative(c, name):
    return getattr(c, name) < 0 and f"--{name} must be 0 or more, got {getattr(c, name)}"


def writable(c, name):  # now, not at the end of the run
    problem = unwritable(getattr(c, name))
    return problem and f"--{name} {getattr(c, name)}: {problem}"


def unwritable(path):
    """Why a file or directory could not be written at path, or None: an existing directory there
    (a snapshot folder, written into) must itself be writable, else the nearest folder that exists
    on the way to it must be a writable directory. Nothing is created."""
    if path is None:
        return None
    if os.path.isdir(path):
        return None if os.access(path, os.W_OK | os.X_OK) else f"{path} is not writable"
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable"
    return None


class Parser(argparse.ArgumentParser):
    """argparse, whose errors are the last line a user sees: under torchrun said once, in
    torchrun's closing summary; alone after one line of usage, not the whole list of options."""

    def error(self, message):
        if message.startswith("unrecognized arguments: "):  # the nearest options, as Python 3.14's
            known = [name for action in self._actions for name in action.option_strings]
            words = [word.split("=")[0] for word in message.split(": ", 1)[1].split()]
            near = [match for word in words for match in difflib.get_close_matches(word, known, 1)]
            message += f" (did you mean {', '.join(near)}?)" if near else ""
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            self.exit(2, f"usage: {self.prog} [options] (--help lists them)\n{self.prog}: error: {message}\n")
        failure.refuse(self.prog, message)


def parser_for(cls, description):
    """An option for each of the dataclass cls's option fields, in their order, under their group's
    heading."""
    p = group = Parser(description=description)
    for f in fields(cls):
        if "kwargs" not in f.metadata:  # derived
            continue
        kwargs, default = dict(f.metadata["kwargs"]), f.metadata["default"]
        if f.metadata["group"]:
            group = p.add_argument_group(f.metadata["group"])
        if f.type is bool:
            kwargs.update(action="store_true", default=False)
        else:
            kwargs.setdefault("type", f.type if isinstance(f.type, type) else get_args(f.type)[0])
            kwargs["default"] = default() if callable(default) else default
        group.add_argument(f"--{f.name}", help=f.metadata["help"], **kwargs)
    return p


def check(config, parser):
    """Every field's checks, in the fields' order: the
    first refusal ends the run as argparse's error."""
    for f in fields(config):
        for rule in f.metadata["checks"]:
            refusal = rule(config, f.name)
            if refusal:
                parser.error(refusal)
