import os
import sys

# tests import helpers (tests/live_server.py, tests/hf_models.py) as top-level modules
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
