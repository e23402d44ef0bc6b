"""``kvpush bench``: sweep transfer shapes and compare kvpush with raw NIXL and a plain copy."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    raise SystemExit("kvpush bench is not built yet")
