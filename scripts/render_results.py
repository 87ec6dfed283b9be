#!/usr/bin/env python3
"""Rewrite every generated block of README.md and docs/ from the records under results/.

    python scripts/render_results.py           # rewrite the pages in place
    python scripts/render_results.py --check   # exit 1 if a page differs from its records

Update the records first: copy a full demo's results.json to results/demo/results.json
(`calibrl demo --out DIR` writes DIR/results.json), and a study's to results/study/.
"""

from __future__ import annotations

import argparse
import sys

from calibrl.demo.results_tables import pages, render_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report pages that differ from their records")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        if not page.exists():
            continue
        text = page.read_text(encoding="utf-8")
        rendered = render_text(text)
        if rendered != text:
            stale.append(page)
            if not args.check:
                page.write_text(rendered, encoding="utf-8")
    verb = "differ from their records" if args.check else "rewritten"
    for page in stale:
        print(f"{page}: {verb}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
