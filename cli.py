"""The ``kvpush`` command: ``plugins``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _plugins(args: argparse.Namespace) -> int:
    from kvpush.core.manager import get_plugin_manager

    manager = get_plugin_manager()
    infos = manager.list_plugins()
    transports = sorted(manager.transports())
    layouts = sorted(manager.layouts())
    if args.json:
        print(
            json.dumps(
                {
                    "plugins": [
                        {
                            "name": info.name,
                            "distribution": info.distribution,
                            "version": info.version,
                            "hooks": list(info.hooks),
                        }
                        for info in infos
                    ],
                    "transports": transports,
                    "layouts": layouts,
                },
                indent=2,
            )
        )
        return 0
    width = max((len(info.name) for info in infos), default=4)
    for info in infos:
        print(f"{info.name:<{width}}  {info.distribution} {info.version}  {', '.join(info.hooks)}")
    print(f"\ntransports: {', '.join(transports)}\nlayouts: {', '.join(layouts)}")
    return 0


def _version() -> str:
    import kvpush

    return kvpush.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvpush {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    plugins = sub.add_parser("plugins", help="list registered plugins, transports and layouts")
    plugins.add_argument("--json", action="store_true", help="print one JSON object")
    plugins.set_defaults(func=_plugins)

    from kvpush.demo import runner

    demo = sub.add_parser("demo", help="push KV between real processes and verify every byte")
    runner.add_arguments(demo)
    demo.set_defaults(func=runner.main)

    from kvpush.demo import bench

    bench_parser = sub.add_parser("bench", help="sweep transfer shapes and compare with raw NIXL")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=bench.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
