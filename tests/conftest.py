import sys
from pathlib import Path

# tests/ on the path so that test modules can share helpers (harness, models) and so that
# spawned ranks can import the functions they run by module name.
sys.path.insert(0, str(Path(__file__).parent))
