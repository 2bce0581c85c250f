"""Constants of the decode kernel's source, for the tests that check what mirrors them (the tile policy) or
depends on them (which merge a launch runs)."""

import re
from pathlib import Path

DECODE_SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "decode_hd256.cu"


def decode_constant(name: str) -> int:
    """A ``constexpr int NAME = <literal>;`` of ``kernels/decode_hd256.cu``."""
    return int(re.search(rf"constexpr int {name} = (\d+);", DECODE_SOURCE.read_text()).group(1))


def decode_macro_default(name: str) -> int:
    """The default of a build-time macro of ``kernels/decode_hd256.cu`` (its ``#ifndef`` / ``#define``)."""
    return int(re.search(rf"#ifndef {name}\n#define {name} (\d+)\n#endif", DECODE_SOURCE.read_text()).group(1))
