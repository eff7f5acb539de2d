"""The ``splitserve`` command."""

from __future__ import annotations

import argparse
import logging
import sys

from splitserve.cluster import generate_command, render, serve_command
from splitserve.config import env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate_command.add_parser(commands)
    serve_command.add_parsers(commands)
    render.add_parser(commands)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=env("SPLITSERVE_LOG_LEVEL").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
