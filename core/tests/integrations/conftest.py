"""The trainer-integration tests share helpers from this folder (``_trainer_helpers``)."""

from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))
