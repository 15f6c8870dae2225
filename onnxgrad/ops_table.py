"""The supported-ops table, generated from the rule registry."""
from __future__ import annotations

from . import registry


def ops_table(markdown: bool = False) -> str:
    rows = []
    for r in registry.all_rules():
        if r.until >= registry.INF:
            opsets = f"{r.since}+"
        else:
            opsets = f"{r.since}-{r.until}" if r.until != r.since else str(r.since)
        inputs = "all" if r.wrt is None else ", ".join(str(i) for i in r.wrt)
        rows.append((r.op_type, opsets, inputs, r.limits))
    none = [(op, why) for op, why in registry.all_non_differentiable().items()]
    if markdown:
        lines = ["| op | opsets | differentiable inputs | limits |", "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
        lines += ["", "No gradient passes through: " + ", ".join(op for op, _ in none) + "."]
    else:
        lines = [f"{'op':28s} {'opsets':8s} {'inputs':10s} limits"]
        lines += [f"{a:28s} {b:8s} {c:10s} {d}" for a, b, c, d in rows]
        lines += ["", "no gradient (output carries none):"]
        lines += [f"  {op:26s} {why}" for op, why in none]
    return "\n".join(lines) + "\n"


START, END = "<!-- ops-table:start -->", "<!-- ops-table:end -->"


def readme_with_table(readme: str) -> str:
    """The README text with the generated table between its markers."""
    head, sep, rest = readme.partition(START)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"README lacks the {START} ... {END} markers")
    return f"{head}{START}\n{ops_table(markdown=True)}{END}{tail}"


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if len(sys.argv) == 3 and sys.argv[1] == "--update-readme":
        path = Path(sys.argv[2])
        path.write_text(readme_with_table(path.read_text()))
    else:
        sys.stdout.write(ops_table(markdown="--markdown" in sys.argv))
