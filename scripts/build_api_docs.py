"""Build the API reference of elastictrain's public names (``elastictrain.__all__``)
from their docstrings with pdoc, warnings as errors.

    python scripts/build_api_docs.py [--out DIR]      # default: build/api

Writes ``DIR/elastictrain.html`` (open it in a browser). Exits 1 if pdoc warns, a public
name has no docstring or is missing from the page. Needs pdoc (in the test extra).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import warnings
from pathlib import Path


def build(out: Path) -> list[str]:
    """Write the reference into ``out``; returns the problems found (none: good)."""
    import pdoc
    import pdoc.render

    import elastictrain

    # No search index: pdoc would precompile it with Node.js where installed (a process).
    pdoc.render.configure(search=False)

    problems = [f"{name}: no docstring" for name in elastictrain.__all__
                if not inspect.getdoc(getattr(elastictrain, name))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a docstring pdoc cannot read fails the build
        pdoc.pdoc("elastictrain", output_directory=out)
    page = (out / "elastictrain.html").read_text(encoding="utf-8")
    problems += [f"{name}: not on the page" for name in elastictrain.__all__
                 if f'id="{name}"' not in page]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/api"),
                        help="directory for the HTML (default: build/api)")
    args = parser.parse_args(argv)
    problems = build(args.out)
    for problem in problems:
        print(f"build_api_docs: {problem}", file=sys.stderr)
    if not problems:
        print(f"API reference: {args.out / 'elastictrain.html'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
