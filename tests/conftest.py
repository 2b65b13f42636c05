import os
import sys

# Tests import the shared cases as `tests.cases`; make the repo root importable without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
