"""One grammar for the whole command line: every option of every command is walked.

- Every option is one of `focus_hf.commands.options.OPTIONS`, whose meanings are all different: two names for one
  thing fail, and so do two names that say the same words (`--groups` / `--num-groups`, `--sinks` / `--sink-tokens`).
- The former names are hidden and still work: each gives what its new name gives, with a notice that names the new
  one.
- Every command that reads an adapter takes it the same way (ADAPTER, a folder or a Hub id, and --revision), and
  `--json` takes a PATH wherever there is JSON.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

import pytest

from focus_hf.cli import build_parser
from focus_hf.commands.options import OPTIONS, DeprecatedAlias

# Words that qualify a name without changing what it names: `--num-groups` and `--groups`, `--max-blocks` and
# `--eval-blocks` name the same thing.
QUALIFIERS = {"num", "max", "eval", "train", "speed", "no", "tokens", "per"}
READERS = ("info", "inspect", "eval", "audit")  # commands reading one adapter


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS and a.dest != "help"]


def aliases(parser: argparse.ArgumentParser) -> list[DeprecatedAlias]:
    return [a for a in parser._actions if isinstance(a, DeprecatedAlias)]


def name_of(action: argparse.Action) -> str:
    """The option's name: its long form (a boolean's positive one)."""
    return next(s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-") or s in OPTIONS)


def words(name: str) -> tuple[str, ...]:
    """The words of an option's name that say what it is, singular."""
    kept = [word for word in name.lstrip("-").split("-") if word not in QUALIFIERS]
    return tuple(re.sub(r"(ie)?s$", lambda m: "y" if m.group(1) else "", word) for word in kept)


def test_every_option_of_every_command_is_one_of_the_grammar():
    unknown = {(command, name_of(a)) for command, parser in commands().items() for a in visible(parser)}
    unknown = {(command, name) for command, name in unknown if name not in OPTIONS}
    assert not unknown, f"options outside focus_hf.commands.options.OPTIONS: {sorted(unknown)}"


def test_no_two_names_mean_one_thing():
    by_meaning = defaultdict(list)
    for name, meaning in OPTIONS.items():
        by_meaning[meaning].append(name)
    assert all(len(names) == 1 for names in by_meaning.values()), {m: n for m, n in by_meaning.items() if len(n) > 1}
    used = {name_of(a) for parser in commands().values() for a in visible(parser)}
    by_words = defaultdict(set)
    for name in used:
        by_words[words(name)].add(name)
    assert all(len(names) == 1 for names in by_words.values()), [sorted(n) for n in by_words.values() if len(n) > 1]


def test_the_walk_would_catch_the_names_it_replaced():
    """The former pairs fail the words check: the test above tells them apart."""
    pairs = [("--groups", "--num-groups"), ("--sinks", "--sink-tokens"), ("--eval-data", "--data"),
             ("--eval-blocks", "--max-blocks"), ("--speed-repeats", "--repeats"), ("--seq-lens", "--seq-len")]
    assert all(words(old) == words(new) for old, new in pairs)
    assert words("--decode-repeats") != words("--repeats") and words("--kv-heads") != words("--heads")


def _minimal_argv(command: str, parser: argparse.ArgumentParser) -> list[str]:
    argv = [command]
    for action in parser._actions:
        if not action.option_strings and action.nargs is None and action.dest != "help":
            argv.append("x")
        elif action.option_strings and action.required:
            argv += [action.option_strings[0], "x"]
    return argv


CASES = sorted({(name, alias.option_strings[0]) for name, parser in commands().items() for alias in aliases(parser)})


@pytest.mark.parametrize(("command", "old"), CASES, ids=[f"{c}{o}" for c, o in CASES])
def test_former_names_still_work_with_a_notice(command, old, capsys):
    parser = commands()[command]
    alias = next(a for a in aliases(parser) if old in a.option_strings)
    assert alias.target in parser._actions and alias.target.dest == alias.dest  # it stands for an option of its own
    new = alias.name if alias.name != "ADAPTER" else None
    value = [] if alias.nargs == 0 else ["3"]
    top = build_parser()
    before = vars(top.parse_args([*_minimal_argv(command, parser), *([new, *value] if new else value)]))
    assert capsys.readouterr().err == ""
    after = vars(top.parse_args([*_minimal_argv(command, parser), old, *value]))
    notice = capsys.readouterr().err
    assert f"{old} is now {alias.name}" in notice and notice.count("\n") == 1
    assert after == before


def test_commands_reading_an_adapter_take_it_one_way():
    for command in READERS:
        parser = commands()[command]
        positional = [a for a in parser._actions if not a.option_strings and a.dest == "adapter"]
        assert positional and positional[0].metavar == "ADAPTER", command
        assert "Hub id" in positional[0].help, command
        assert "--revision" in {name_of(a) for a in visible(parser)}, command
        assert any("--adapter" in a.option_strings for a in aliases(parser)), command
    compare = commands()["compare"]
    assert [a.metavar for a in compare._actions if not a.option_strings] == ["A", "B"]
    assert "--revision" in {name_of(a) for a in visible(compare)}


def test_json_takes_a_path_everywhere():
    found = 0
    for command, parser in commands().items():
        for action in visible(parser):
            if name_of(action) == "--json":
                found += 1
                assert action.metavar == "PATH" and action.nargs in (None, "?"), command
                assert action.nargs != "?" or action.const == "-", command
    assert found >= 7


def test_help_texts_use_the_products_words():
    """No command's help says 'centroid-only' (the routers hold projections too) or carries one machine's timing."""
    text = build_parser().format_help() + "".join(parser.format_help() for parser in commands().values())
    assert "centroid-only" not in text and not re.search(r"\d+ minutes", text) and "EPYC" not in text
