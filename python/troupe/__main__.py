"""``python -m troupe generate|serve|node|...``: the ``troupe`` command of this package."""

import os
import sys


def main() -> None:
    command = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "troupe")
    if not os.access(command, os.X_OK):
        sys.exit(f"troupe: the command is missing from the package ({command})")
    os.execv(command, [command] + sys.argv[1:])


if __name__ == "__main__":
    main()
