"""``python -m shardfx``: the same as the ``shardfx`` command (see ``shardfx.run.cli``)."""

import sys

from shardfx.run.cli import main

if __name__ == "__main__":  # not when a spawned worker re-imports the main module
    sys.exit(main())
