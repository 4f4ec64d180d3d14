"""Make tests/jobs.py importable by the tests and by the ranks they spawn."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
