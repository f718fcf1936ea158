"""The command line's grammar: global options before or after the subcommand."""

from __future__ import annotations

import pytest

from gateway.cli import _parser


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["chat", "-m", "hi", "--model", "x"], {"model": "x", "message": "hi"}),
        (["--model", "x", "chat", "-m", "hi"], {"model": "x", "message": "hi"}),
        (["--model", "a", "chat", "--model", "b"], {"model": "b"}),  # the later one wins
        (["--model", "a", "chat"], {"model": "a"}),  # not reset by the subcommand
        (["sessions", "list", "--workspace", "w", "--json"], {"workspace": "w", "json": True}),
        (["sessions", "--log-level", "DEBUG", "show", "k"], {"log_level": "DEBUG", "key": "k"}),
        (["run", "--config", "g.toml"], {"config": "g.toml"}),
        (["chat"], {"config": None, "workspace": None, "model": None, "log_level": None}),
    ],
)
def test_global_options_work_before_and_after_the_subcommand(
    argv: list[str], expected: dict[str, object]
) -> None:
    args = vars(_parser().parse_args(argv))
    assert {k: args[k] for k in expected} == expected


def test_a_subcommand_option_of_the_same_name_keeps_its_meaning() -> None:
    args = _parser().parse_args(["--model", "g", "cache", "invalidate", "--model", "m"])
    assert (args.model, args.by_model) == ("g", "m")
    args = _parser().parse_args(["cache", "invalidate", "--model", "m", "--workspace", "w"])
    assert (args.model, args.by_model, args.workspace) == (None, "m", "w")
