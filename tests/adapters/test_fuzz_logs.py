"""Every reader, fuzzed: any damage to a log ends `kvledger replay --check` (and
`inspect`) with exit 0, 1 or 2 and a message, never a traceback.

Hypothesis mutates real logs (binary, version-1 binary, JSONL, gzipped JSONL): flipped bytes,
cuts, spliced or repeated runs, and edits of JSONL values. The CI profile
runs a few hundred cases; `HYPOTHESIS_PROFILE=nightly` runs ten times more.
"""

from __future__ import annotations

import gzip
import io
import random
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.adapters.cli.main import main

pytestmark = pytest.mark.slow


def _log(tmp: Path, fmt: str) -> bytes:
    path = tmp / f"base.{fmt}"
    with redirect_stdout(io.StringIO()):
        assert main(["simulate", "--scenario", "hybrid", "--steps", "40", "--seed", "5", "--format",
                     "binary" if fmt == "binary" else "jsonl", "--out", str(path)]) == 0
    data = path.read_bytes()
    return gzip.compress(data) if fmt == "jsonl.gz" else data


class _Logs(dict):
    def __repr__(self) -> str:  # a failure report names the damaged bytes, not the whole logs
        return f"<base logs: {', '.join(self)}>"


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    tmp = tmp_path_factory.mktemp("fuzz")
    logs = _Logs((fmt, _log(tmp, fmt)) for fmt in ("binary", "jsonl", "jsonl.gz"))
    # The version-1 binary format, read through its upcasting path.
    logs["binary-v1"] = (Path(__file__).resolve().parents[1] / "events" / "fixtures" / "format_v1.kvlog").read_bytes()
    return logs


_VALUES = st.one_of(st.sampled_from([-1, 0, 1, 7, 99, 2**31, 2**63, 10**30, None, "", "x", [], {}, 1.5, True]),
                    st.lists(st.integers(-2, 10**6), max_size=4))


def _edit_field(draw: st.DrawFn, line: bytes) -> bytes:
    """A well-formed JSONL line with one value replaced: past the JSON parser, into the codec."""
    import json

    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict) or not record:
        return line
    parent: dict | list = record
    slot: object = draw(st.sampled_from(sorted(record)))
    # Down into columns and tables (a block id inside a group's list), or stop at any level.
    while isinstance(parent[slot], list) and parent[slot] and draw(st.booleans()):  # type: ignore[index]
        parent = parent[slot]  # type: ignore[index]
        slot = draw(st.integers(0, len(parent) - 1))
    parent[slot] = draw(_VALUES)  # type: ignore[index]
    return json.dumps(record).encode() + b"\n"


@st.composite
def damage(draw: st.DrawFn, data: bytes) -> bytes:
    """One to four mutations of `data`, chosen to reach past the first check."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "splice", "repeat", "digits", "insert", "field", "field"]))
        if kind == "field":
            lines = bytes(out).splitlines(keepends=True)
            if lines and lines[0].startswith(b"{"):
                index = draw(st.integers(0, len(lines) - 1))
                lines[index] = _edit_field(draw, lines[index])
                out = bytearray(b"".join(lines))
            continue
        at = draw(st.integers(0, max(0, len(out) - 1)))
        if kind == "flip" and out:
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del out[at:]
        elif kind == "splice" and out:
            end = draw(st.integers(at, len(out)))
            other = draw(st.integers(0, max(0, len(out) - 1)))
            out[at:end] = out[other:other + (end - at)]
        elif kind == "repeat":
            out[at:at] = out[at:at + draw(st.integers(1, 64))]
        elif kind == "digits":  # JSONL: a number turned into another (sizes, ids, seqs)
            text = draw(st.sampled_from([b"0", b"-1", b"99999999999999999999", b"1e308", b"null", b"[]", b'"x"']))
            out[at:at + 1] = text
        else:
            out[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(out)


def _run(tmp: Path, name: str, blob: bytes, argv_tail: list[str]) -> tuple[int, str]:
    path = tmp / name
    path.write_bytes(blob)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([*argv_tail[:1], str(path), *argv_tail[1:]])
    return code, err.getvalue()


@pytest.mark.parametrize("fmt", ["binary", "jsonl", "jsonl.gz", "binary-v1"])
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None)
@given(data=st.data())
def test_damaged_logs_end_in_an_exit_code_not_a_crash(fmt, data, bases, tmp_path) -> None:
    blob = data.draw(damage(bases[fmt]))
    name = f"fuzzed.{fmt}"
    code, err = _run(tmp_path, name, blob, ["replay", "--check"])
    assert code in (0, 1, 2)
    if code == 2:
        assert err.startswith("kvledger: "), err
    at = random.Random(len(blob)).randrange(0, 200)
    code, err = _run(tmp_path, name, blob, ["inspect", "--at", str(at)])
    assert code in (0, 2)
