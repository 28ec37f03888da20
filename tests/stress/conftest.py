import sys
from pathlib import Path

# The stress modules import each other by name (spawned ranks import the functions they run
# by module name), and their test model is the benchmarks' bench_model (benchmarks/_common.py).
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
sys.path.insert(0, str(HERE))
