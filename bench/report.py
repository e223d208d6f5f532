"""Render committed benchmark results into bench/README.md, so it quotes the latest numbers.

    python -m bench.report            # rewrite the tables between <!-- bench:NAME --> markers

Each ``bench/results/NAME.json`` becomes markdown tables (one per ``section`` when rows carry
one) between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` in bench/README.md. The
top-level README's summary table is written by hand from these.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"section", "rss_samples", "corrupt_keys", "bit_exact", "bytes", "raw_p50_ms",
        "raw_p99_ms"}


def _interval(v: Any) -> bool:
    """A [low, high] pair (a confidence interval): shown in a cell."""
    return isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)


def fmt(v: Any) -> str:
    if v is None:
        return ""
    if _interval(v):
        return "[" + ", ".join(fmt(float(x)) for x in v) + "]"
    if isinstance(v, float):
        if v != v:
            return "–"
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)[:40]
    return str(v)


def table(rows: list[dict[str, Any]]) -> str:
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols and c not in SKIP]
    # a column holding any list or dict but an interval is left to the JSON
    cols = [c for c in cols if not any(isinstance(r.get(c), (list, dict))
                                       and not _interval(r.get(c)) for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def render(doc: dict[str, Any]) -> str:
    rows = doc.get("rows", [])
    parts = []
    sections: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        sections.setdefault(str(r.get("section", "")), []).append(r)
    for name, sec in sections.items():
        if name:
            parts.append(f"*{name}*\n")
        parts.append(table(sec) + "\n")
    for key in ("lookup", "gateway", "per_ratio", "speed"):
        if isinstance(doc.get(key), list) and doc[key]:
            parts.append(f"*{key}*\n")
            parts.append(table(doc[key]) + "\n")
    scalars = {k: v for k, v in doc.items() if isinstance(v, (int, float, str, bool))
               and k not in ("benchmark", "when", "pid")}
    if scalars:
        parts.append("Run facts: " + ", ".join(f"`{k}`={fmt(v)}" for k, v in scalars.items())
                     + f" (measured {doc.get('when', '?')}).\n")
    return "\n".join(parts)


def main() -> int:
    readme = ROOT / "bench" / "README.md"
    text = readme.read_text()
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        name = path.stem
        pat = re.compile(rf"(<!-- bench:{name} -->\n)(.*?)(<!-- /bench:{name} -->)", re.S)
        if not pat.search(text):
            continue
        body = render(json.loads(path.read_text()))
        text = pat.sub(lambda m, body=body: m.group(1) + body + m.group(3), text)
        print(f"bench/README.md: {name}")
    readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
