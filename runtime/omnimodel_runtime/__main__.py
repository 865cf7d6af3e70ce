"""``python -m omnimodel_runtime`` = the ``omnimodel`` command.

The ``__main__`` guard matters: vLLM starts worker processes with ``spawn``, which re-imports the main
module; without the guard each worker would run the CLI again.
"""

import sys

from omnimodel_runtime.cli import main

if __name__ == "__main__":
    sys.exit(main())
