"""The `latest` tox env's command: what differs from ci/constraints.txt, then the hf suite.

Prints each pinned library whose installed (newest) version is not the pin, then runs
pytest over tests/hf and tests/docs where something differs, or SHARDWISE_LATEST_FORCE=1.
Where nothing differs, the hf env ran the same suite on the same versions: it says so and
exits 0. Extra arguments go to pytest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

WATCHED = ("transformers", "diffusers", "accelerate", "peft", "huggingface_hub", "safetensors", "tokenizers")


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s#]+)", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def main(argv: list[str]) -> int:
    pinned = pins(Path(__file__).with_name("constraints.txt"))
    changes = []
    for name in WATCHED:
        key = name.lower().replace("_", "-")
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = "absent"
        pin = pinned.get(key, "unpinned")
        mark = "" if have == pin else "   <- differs from ci/constraints.txt"
        print(f"latest: {name} {have} (pinned {pin}){mark}")
        if have != pin:
            changes.append(f"{name} {pin} -> {have}")
    if not changes and os.environ.get("SHARDWISE_LATEST_FORCE") != "1":
        print("latest: NOT RUN: the newest releases are the pinned ones, which the hf env tests;"
              " SHARDWISE_LATEST_FORCE=1 runs it anyway")
        return 0
    print("latest: upstream changes under test: " + ("; ".join(changes) or "none (forced)"))
    rc = subprocess.call([sys.executable, "-m", "pytest", *(argv or ["tests/hf", "tests/docs"])])
    if rc not in (0, 5):
        print("latest: FAILED against " + ("; ".join(changes) or "the pinned versions")
              + ". Where the hf env (the pins) passed, one of these changes is the cause.")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
