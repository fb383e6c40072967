"""Whether the Hugging Face hub answers: a fast probe, so an offline machine fails in seconds
(and loads from the local HF cache) instead of retrying for a minute. Nothing here downloads.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse


def hub_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the model hub answers (fails fast offline instead of retrying for a minute)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True
