"""``python -m kvtier.bench``: the same as ``kvtier bench``."""

from __future__ import annotations

import sys

from kvtier.bench import main

sys.exit(main())
