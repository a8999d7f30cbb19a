"""Entry script of the frozen app: the window (`python -m app` options), or the engine CLI after `engine`.

`<frozen binary> engine hw --json` is `python -m engine hw --json` inside the bundle, so the frozen engine can be
checked without Qt, and support can ask a user for `hw` output from the shipped binary.
"""

import sys


def main() -> int:
    if sys.argv[1:2] == ["engine"]:
        from engine.cli import main as engine_main

        return engine_main(sys.argv[2:])
    from app.__main__ import main as app_main

    return app_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
