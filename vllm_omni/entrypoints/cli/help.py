"""The CLI's argparse: no prefix matching, a typo answered with the nearest flag, and a `--help[=TOPIC]`
that answers in pieces, as vLLM's `vllm serve --help=<group>` does.

`--help` prints an overview: the usage line, the main flags and one line per flag group. `--help=GROUP`
prints one group (its key is the first word of its title, lower case: `server`, `engine`, `lora`, ...;
a unique prefix works), `--help=all` every flag, `--help=listgroup` the groups, and `--help=FLAG` or
`--help=WORD` the flags whose name holds it. A group added anywhere with `parser.add_argument_group`
answers under its key without being registered here.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys

HIDDEN_GROUPS = ("positional arguments", "options")
"""argparse's own groups: shown in the overview, not listed as groups."""


def group_key(group: argparse._ArgumentGroup) -> str:
    """`--help=KEY` for a group: the first word of its title, lower case ('LoRA adapters' -> 'lora')."""
    words = re.findall(r"[a-z0-9]+", (group.title or "").lower())
    return words[0] if words else ""


def serve_group(parser: argparse.ArgumentParser, title: str, description: str | None = None):
    """The group of `parser` whose key is `title`'s, created if it does not exist yet (so flags added
    from several files land in one `--help=KEY` section)."""
    wanted = re.findall(r"[a-z0-9]+", title.lower())[0]
    for group in parser._action_groups:
        if group_key(group) == wanted and group.title not in HIDDEN_GROUPS:
            return group
    return parser.add_argument_group(title, description)


def _one_line(action: argparse.Action) -> str:
    """'--flag X, -f X   help' on one line (the `one_line` groups' layout)."""
    value = "" if action.nargs == 0 else " X"
    spelled = ", ".join(f"{o}{value}" for o in action.option_strings)
    return f"{spelled:<36} {action.help or ''}"


class HelpAction(argparse.Action):
    """`-h` / `--help[=TOPIC]`: print the answer for TOPIC and exit (2 when nothing matches)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs="?", const="", default=default, help=help)
        self.metavar = "TOPIC"

    def __call__(self, parser, namespace, values, option_string=None):
        text, found = parser.help_for(values or "")
        print(text, file=sys.stdout if found else sys.stderr)
        parser.exit(0 if found else 2)


class OmniArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with `allow_abbrev=False`, a nearest-flag suggestion on an unknown flag,
    and the topic help above. `main_flags`: the dests the overview lists first (empty: the overview is
    argparse's whole help, for parsers with few flags)."""

    def __init__(self, *args, main_flags: tuple[str, ...] = (), **kwargs):
        kwargs["allow_abbrev"] = False  # `--max-num-seq 8` must not silently mean --max-num-seqs
        kwargs["add_help"] = False
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self.main_flags = main_flags
        self.add_argument(
            "-h",
            "--help",
            action=HelpAction,
            help="Show this help and exit; --help=GROUP one flag group, --help=all every flag, "
            "--help=WORD the flags whose name holds WORD.",
        )

    # -- errors ---------------------------------------------------------------------------------------

    def _all_option_strings(self) -> list[str]:
        """Every `--flag` of this parser and of its subcommands' parsers."""
        names = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    names += list(sub._option_string_actions)
        return names

    def suggestion(self, word: str) -> str | None:
        """The flag a misspelt `word` meant: the one flag it abbreviates (what argparse's prefix
        matching used to accept), else the nearest by difflib's ratio (>= 0.7), else None."""
        flag = word.split("=", 1)[0]
        known = [name for name in self._all_option_strings() if name.startswith("--")]
        longer = [name for name in known if name.startswith(flag)]
        if len(longer) == 1:
            return longer[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.7)
        return close[0] if close else None

    def error(self, message: str):
        """argparse's error (usage, message, exit 2) with 'did you mean --flag?' for an unknown flag."""
        if message.startswith("unrecognized arguments:"):
            unknown = [w for w in message.split(":", 1)[1].split() if w.startswith("-")]
            hints = [f"{w.split('=', 1)[0]} -> {s}" for w in unknown if (s := self.suggestion(w))]
            if len(hints) == 1:
                message += f" (did you mean {hints[0].split(' -> ')[1]}?)"
            elif hints:
                message += f" (did you mean: {', '.join(hints)}?)"
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def subcommand(self, name: str | None) -> argparse.ArgumentParser:
        """The parser of subcommand `name` (this parser when it has none by that name)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                return action.choices[name]
        return self

    # -- help -----------------------------------------------------------------------------------------

    def flag_groups(self) -> list[argparse._ArgumentGroup]:
        """The groups `--help=GROUP` answers for (argparse's own two excluded), in order."""
        return [g for g in self._action_groups if g.title not in HIDDEN_GROUPS and g._group_actions]

    def help_for(self, topic: str) -> tuple[str, bool]:
        """The help text for `topic` ('' = overview) and whether anything matched."""
        topic = topic.strip().lower()
        groups = self.flag_groups()
        if topic == "all" or (not topic and not self.main_flags):
            return self.format_help(), True
        if not topic:
            return self._overview(groups), True
        if topic in ("listgroup", "groups"):
            return self._group_list(groups), True
        matching = [g for g in groups if group_key(g) == topic] or [
            g for g in groups if group_key(g).startswith(topic)
        ]
        if len(matching) == 1:
            return self._format(matching, usage=True), True
        word = topic.lstrip("-")
        actions = [a for a in self._actions if any(o.lstrip("-") == word for o in a.option_strings)]
        actions = actions or [a for a in self._actions if any(word in o for o in a.option_strings)]
        if actions and word:
            return self._format_actions(f"flags matching {topic!r}", actions), True
        return (
            f"{self.prog}: no flag group or flag matches {topic!r}; groups: "
            f"{', '.join(group_key(g) for g in groups)} (or all)"
        ), False

    def format_help(self) -> str:
        """Every flag, each group as `_format` lays it out (`--help=all`)."""
        groups = [g for g in self._action_groups if g._group_actions]
        return self._format(groups, usage=True, description=True, epilog=True)

    def _format(self, groups, usage: bool = False, description: bool = False, epilog: bool = False) -> str:
        """`groups` as argparse lays them out, except a group marked `one_line` (set by whoever made it):
        one unwrapped line per flag, 'spellings  help'."""
        formatter = self._get_formatter()
        if usage:
            formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        if description:
            formatter.add_text(self.description)
        for group in groups:
            formatter.start_section(group.title)
            formatter.add_text(group.description)
            if getattr(group, "one_line", False):
                formatter.add_text("\n".join(_one_line(a) for a in group._group_actions))
            else:
                formatter.add_arguments(group._group_actions)
            formatter.end_section()
        if epilog:
            formatter.add_text(self.epilog)
        return formatter.format_help()

    def _format_actions(self, title: str, actions) -> str:
        formatter = self._get_formatter()
        formatter.start_section(title)
        formatter.add_arguments(actions)
        formatter.end_section()
        return formatter.format_help()

    def _group_list(self, groups) -> str:
        width = max(len(group_key(g)) for g in groups) + 2
        lines = [f"flag groups ({self.prog} --help=GROUP shows one, --help=all every flag):"]
        for group in groups:
            summary = (group.description or group.title or "").splitlines()[0]
            count = len(group._group_actions)
            lines.append(f"  {group_key(group):<{width}}{summary} ({count} flag{'s' if count > 1 else ''})")
        return "\n".join(lines) + "\n"

    def _overview(self, groups) -> str:
        """Usage, description, positionals, the main flags, every ungrouped flag, and the group list."""
        by_dest = {a.dest: a for a in self._actions}
        main = [by_dest[d] for d in self.main_flags if d in by_dest]
        ungrouped = [a for a in self._optionals._group_actions if a not in main]
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        for title, actions in (
            ("positional arguments", self._positionals._group_actions),
            ("main flags", main + ungrouped),
        ):
            formatter.start_section(title)
            formatter.add_arguments(actions)
            formatter.end_section()
        return formatter.format_help() + "\n" + self._group_list(groups)
