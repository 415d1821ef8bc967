"""The `mmgate` console command: `mmgate gateway ...` and `mmgate engine ...`, each the same as
`python -m gateway ...` / `python -m engine_adapter ...`.

Each subcommand's process description is imported only when it runs, so `mmgate gateway` loads no torch and
`mmgate engine` says how to install torch when it is missing.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

from serving.cli import Process, version
from serving.workers import STARTUP_FAILED

# subcommand: (module holding its `Process`, the attribute, what it runs, the package extra it needs)
COMMANDS: dict[str, tuple[str, str, str, str | None]] = {
    "gateway": ("gateway.__main__", "GATEWAY", "the gateway in front of a model server (python -m gateway)", None),
    "engine": ("engine_adapter.__main__", "ENGINE", "the encoder engine process (python -m engine_adapter)", "engine"),
}
USAGE_ERROR = 2


def usage() -> str:
    lines = ["usage: mmgate {gateway,engine} [--config FILE] [options]", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}}  {what}" for name, (_, _, what, _) in COMMANDS.items()]
    lines += ["", "`mmgate <command> --help` lists a command's options."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(usage())
        return 0 if args else USAGE_ERROR
    if args[0] == "--version":
        print(f"mmgate {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"mmgate: unknown command {name!r}; choose one of {', '.join(COMMANDS)}\n\n{usage()}")
        return USAGE_ERROR
    module, attribute, _, extra = COMMANDS[name]
    try:
        process: Process[Any] = getattr(importlib.import_module(module), attribute)
    except ModuleNotFoundError as exc:
        if extra is None or exc.name is None or exc.name.split(".")[0] == module.split(".")[0]:
            raise
        print(
            f"mmgate {name}: needs {exc.name}, which is not installed: pip install 'mmgate[{extra}]'", file=sys.stderr
        )
        return STARTUP_FAILED
    return process.main(rest, prog=f"mmgate {name}")


if __name__ == "__main__":
    sys.exit(main())
