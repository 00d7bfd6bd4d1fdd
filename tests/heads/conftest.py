"""Triton runs on CPU only through its interpreter; turn it on before anything imports triton."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
