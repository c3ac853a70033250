"""argparse for llmtrain's commands: an unknown option is refused naming the nearest one (exit status 2).

    parser = ArgumentParser(prog="python -m llmtrain.export", description=...)
    python -m llmtrain.export --checkpoint RUN --ouput out/   # exit 2: "--ouput: unknown option; did you mean --output?"
"""
from __future__ import annotations

import argparse

from llmtrain.utils.overrides import nearest


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose refusal of unknown arguments names the nearest option."""

    def parse_args(self, args=None, namespace=None):
        import sys

        given = list(sys.argv[1:] if args is None else args)
        options = [o for action in self._actions for o in action.option_strings]
        lines = []
        for arg in given:
            flag = arg.split("=", 1)[0]
            if not flag.startswith("--") or any(o.startswith(flag) for o in options):
                continue  # a value, a short option, a known option or an abbreviation argparse accepts
            near = nearest(flag, options, cutoff=0.6)
            lines.append(f"{arg}: unknown option" + (f"; did you mean {near}?" if near else ""))
        if lines:
            self.error("; ".join(lines))  # exit status 2, with the usage
        parsed, unknown = self.parse_known_args(given, namespace)
        if unknown:
            self.error("unrecognized arguments: " + " ".join(unknown))
        return parsed


def field_help(cls, prefix: str, width: int = 100) -> list[str]:
    """`--help` lines for a config dataclass: `  <prefix>.<field>=<default>` and its docstring (the string under
    each field in the class source), wrapped."""
    import ast
    import dataclasses
    import inspect
    import textwrap

    docs, body = {}, ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    lines = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = "null" if f.default is None else f.default
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else "???"
        lines.append(f"  {prefix}.{f.name}={default}")
        lines += textwrap.wrap(docs.get(f.name, ""), width, initial_indent="      ", subsequent_indent="      ")
    return lines
