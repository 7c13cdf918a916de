"""The example configs under examples/ and the world size each is meant for (its header line
``# megatron-gndpo plan -c examples/NAME.yaml -n N``): shared by the config and CLI tests."""

from __future__ import annotations

import re
from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))
HEADER = re.compile(
    r"^# megatron-gndpo plan -c examples/(?P<name>\S+\.yaml) -n (?P<n>\d+)\s*$", re.M
)


def example_world_size(path: Path) -> int:
    """The world size named by the example's ``# megatron-gndpo plan ... -n N`` header line."""
    match = HEADER.search(path.read_text(encoding="utf-8"))
    assert match is not None, (
        f"{path.name} lacks the header line '# megatron-gndpo plan -c examples/{path.name} -n N' "
        "naming the world size it is meant for"
    )
    assert match["name"] == path.name, f"{path.name}'s header names {match['name']}"
    return int(match["n"])
