"""What every model load in a process shares."""

from __future__ import annotations

import threading
from typing import Final

# Loading builds modules on the meta device through process-global patches (accelerate's
# ``init_empty_weights``), so two pipelines loading at once on different threads — the stages of
# ``omnimodel serve`` start concurrently — corrupt each other's modules. One load at a time per process,
# whichever engine loads (text to image, text to video).
LOAD_LOCK: Final = threading.Lock()
