"""Lark grammars for the xgrammar backend, converted to EBNF as vLLM 0.26 converts them.

xgrammar reads EBNF (`name ::= ...`) only; vLLM takes a grammar with no `::=` rule as Lark
and rewrites it line by line before compiling, so a Lark grammar written for vLLM gives
the same EBNF (and the same outputs) here. The rewrite is vLLM's, deliberately simple:

- comments (`#` or `//` to the end of a line) and blank lines go;
- a line `name: definition` starts a rule (a leading or trailing `?` of the name dropped),
  a line `| alternative` adds an alternative to the rule above, other lines are ignored;
- single-quoted strings become double-quoted;
- the root is `start` when there is such a rule, else the first rule;
- every referenced name must be a rule.

The guidance backend reads Lark itself (no conversion).
"""

from __future__ import annotations

import re

_COMMENT = re.compile(r"(#|//).*$")
_SINGLE_QUOTED = re.compile(r"'([^']*)'")
_DOUBLE_QUOTED = re.compile(r'"[^"]*"')
_OPERATORS = re.compile(r"[+*?()|\[\]{}]")
_NAME = re.compile(r"\b[a-zA-Z_][a-zA-Z0-9_]*\b")


class LarkConversionError(ValueError):
    """The grammar cannot be rewritten as EBNF (the message says where)."""


def is_lark(grammar: str) -> bool:
    """Whether `grammar` reads as Lark: no line (comments aside) defines an EBNF rule."""
    if not isinstance(grammar, str) or not grammar:
        return False
    return not any("::=" in _clean(line) for line in grammar.split("\n"))


def lark_to_ebnf(grammar: str) -> str:
    """The EBNF of a Lark grammar, as vLLM writes it.

    Raises:
        LarkConversionError: no rule, mismatched quotes, an alternative before any rule,
            or a reference to a rule that is not defined.
    """
    if not isinstance(grammar, str):
        raise LarkConversionError(f"Grammar must be a string, got {type(grammar)}")
    if not grammar.strip():
        raise LarkConversionError("Grammar string cannot be empty")
    lines = [_clean(line) for line in grammar.split("\n")]
    defined = [
        _rule_name(line) for line in lines if line and not line.startswith("|") and ":" in line
    ]
    if not defined:
        raise LarkConversionError("No valid rules found in grammar")
    root = "start" if "start" in defined else defined[0]

    rules: list[tuple[str, list[str]]] = []
    referenced: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            if line.startswith("|"):
                if not rules:
                    raise LarkConversionError(
                        f"Alternative '|' on line {number} without a preceding rule definition"
                    )
                name = rules[-1][0]
                body = _body(line[1:], f"alternative for rule '{name}'", number, referenced)
                rules[-1][1].append(body)
            elif ":" in line:
                name_part, definition = line.split(":", 1)
                name = name_part.strip().strip("?")
                rules.append((name, [_body(definition, f"rule '{name}'", number, referenced)]))
        except LarkConversionError as e:
            raise LarkConversionError(f"Error on line {number}: {e}") from None
    undefined = referenced - set(defined) - {"root"}
    if undefined:
        raise LarkConversionError(
            f"Referenced rules are not defined: {', '.join(sorted(undefined))}"
        )
    return "\n".join([f"root ::= {root}"] + [f"{n} ::= {' | '.join(alts)}" for n, alts in rules])


def _clean(line: str) -> str:
    return _COMMENT.sub("", line).strip()


def _rule_name(line: str) -> str:
    return line.split(":", 1)[0].strip().strip("?")


def _body(text: str, what: str, number: int, referenced: set[str]) -> str:
    """One alternative, double-quoted, with the rule names it mentions added to
    `referenced`."""
    if text.count("'") % 2 or text.count('"') % 2:
        raise LarkConversionError(f"Mismatched quotes in {what} on line {number}")
    text = _SINGLE_QUOTED.sub(r'"\1"', text)
    names = _OPERATORS.sub(" ", _DOUBLE_QUOTED.sub("", text))
    referenced.update(_NAME.findall(names))
    return text.strip()
