"""`vllm serve --help` (issue 48, item 3): a short overview, one answer per flag group, every flag under
`--help=all`, the no-effect compatibility flags one line each, and a misspelt flag an error that names
the nearest real flag (argparse's prefix matching off)."""

from __future__ import annotations

import argparse

import pytest

from vllm_omni.entrypoints.cli import main as cli_main
from vllm_omni.entrypoints.cli.compat_flags import NO_EFFECT_FLAGS
from vllm_omni.entrypoints.cli.help import group_key

OVERVIEW_MAX_LINES = 150


@pytest.fixture(autouse=True)
def no_real_vllm(monkeypatch):
    """`vllm serve --help` must answer for vllm-omni even though `vllm` is vLLM's name."""
    monkeypatch.setattr(cli_main.importlib.util, "find_spec", lambda name: None)


def _serve_parser() -> argparse.ArgumentParser:
    parser = cli_main.build_parser("vllm")
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        cli_main.main(list(argv), prog="vllm")
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_overview_is_short_and_lists_every_group(capsys):
    code, out, _ = _run(capsys, "serve", "--help")
    assert code == 0
    assert len(out.splitlines()) <= OVERVIEW_MAX_LINES, len(out.splitlines())
    assert out.startswith("usage: vllm serve [MODEL] --omni [options]\n")
    keys = [group_key(g) for g in _serve_parser().flag_groups()]
    assert {"server", "model", "engine", "lora", "parallelism", "compatibility"} <= set(keys), keys
    for key in keys:
        assert f"\n  {key} " in out, key
    for flag in ("--step-execution", "--max-num-seqs", "--enforce-eager", "--lora-modules"):
        assert flag in out
    assert not [spec.flag for spec in NO_EFFECT_FLAGS if spec.flag in out]


@pytest.mark.parametrize("key", [group_key(g) for g in _serve_parser().flag_groups()])
def test_each_group_answers_with_its_flags(capsys, key):
    groups = _serve_parser().flag_groups()
    group = next(g for g in groups if group_key(g) == key)
    code, out, _ = _run(capsys, "serve", f"--help={key}")
    assert code == 0
    for action in group._group_actions:
        assert action.option_strings[0] in out
    others = [g for g in groups if g is not group]
    assert not [
        a.option_strings[0] for g in others for a in g._group_actions if f"\n  {a.option_strings[0]} " in out
    ]


def test_help_all_lists_every_flag_and_no_effect_flags_one_line_each(capsys):
    code, out, _ = _run(capsys, "serve", "--help=all")
    assert code == 0
    for action in _serve_parser()._actions:
        for option in action.option_strings:
            assert option in out, option
    for spec in NO_EFFECT_FLAGS:
        lines = [line for line in out.splitlines() if line.lstrip().startswith(spec.flag + " ")
                 or line.lstrip() == spec.flag or line.lstrip().startswith(spec.flag + ",")]  # fmt: skip
        assert len(lines) == 1 and spec.reason in lines[0], (spec.flag, lines)


def test_help_for_one_flag_and_a_keyword(capsys):
    code, out, _ = _run(capsys, "serve", "--help=max-num-seqs")
    assert code == 0 and "--max-num-seqs" in out and "--max-queue-size" not in out
    code, out, _ = _run(capsys, "serve", "--help=timeout")
    assert code == 0 and "--body-read-timeout" in out and "--init-timeout" in out and "--port" not in out


def test_unknown_help_topic_exits_2_listing_the_groups(capsys):
    code, _, err = _run(capsys, "serve", "--help=nonsense")
    assert code == 2 and "nonsense" in err and "engine" in err


@pytest.mark.parametrize(
    ("argv", "suggested"),
    [
        (["--max-num-seq", "8"], "--max-num-seqs"),
        (["--max-num-seq=8"], "--max-num-seqs"),
        (["--enforce-eagre"], "--enforce-eager"),
        (["--step-exec"], "--step-execution"),
        (["--gpu-mem", "0.5"], "--gpu-memory-utilization"),  # a prefix argparse used to accept
    ],
)
def test_a_misspelt_flag_exits_2_naming_the_nearest(capsys, argv, suggested):
    code, _, err = _run(capsys, "serve", "tiny-qwen-image", "--omni", *argv)
    assert code == 2
    assert f"did you mean {suggested}?" in err, err
    assert err.startswith("usage: vllm serve [MODEL] --omni [options]\nvllm serve: error:"), err


def test_an_unknown_flag_far_from_every_flag_gets_no_suggestion(capsys):
    code, _, err = _run(capsys, "serve", "tiny-qwen-image", "--omni", "--bogus-flag")
    assert code == 2 and "unrecognized arguments: --bogus-flag" in err and "did you mean" not in err


def _example_value(action: argparse.Action) -> list[str]:
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    return ["1"]


def test_every_flag_parses_by_its_full_name_only():
    """Each spelling parses exactly; any strict prefix of a long flag is now an error (allow_abbrev)."""
    parser = _serve_parser()
    for action in parser._actions:
        for option in action.option_strings:
            if option in ("-h", "--help"):
                continue
            parser.parse_args(["tiny-qwen-image", option, *_example_value(action)])
    with pytest.raises(SystemExit):
        parser.parse_args(["tiny-qwen-image", "--max-num-seq", "8"])
