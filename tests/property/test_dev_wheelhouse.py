"""Laws of ``dev.py wheelhouse``: a trimmed wheel holds every other member byte for byte, and its RECORD names
exactly the members left (a wheel with nothing to trim is left as it was); the wheelhouse holds one version of
each pinned distribution, or is refused."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_spec = importlib.util.spec_from_file_location("dev", Path(__file__).resolve().parents[2] / "dev.py")
assert _spec is not None and _spec.loader is not None
dev = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dev)

RECORD = "pkg-1.0.dist-info/RECORD"
_part = st.text("abcxyz_", min_size=1, max_size=4)
_member = st.tuples(st.sampled_from(["pkg/jars/", "pkg/ui/build/", "pkg/", "pkg/ui/"]), _part).map("".join)


EXECUTABLE = 0o755 << 16
"""A member's ``external_attr`` for mode 0755: ``_wheel`` gives it to members whose name ends in ``x``."""


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 2, 3, 4, 6))
            info.external_attr = EXECUTABLE if name.endswith("x") else 0o644 << 16
            z.writestr(info, data)
        z.writestr(RECORD, "".join(f"{name},sha256=x,{len(data)}\n" for name, data in members.items()) + f"{RECORD},,\n")
    return path


def _read(path: Path) -> dict[str, tuple[bytes, int, tuple[int, ...]]]:
    """Each member's bytes, external attributes (its mode) and time."""
    with zipfile.ZipFile(path) as z:
        return {i.filename: (z.read(i), i.external_attr, i.date_time) for i in z.infolist()}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=st.dictionaries(_member, st.binary(max_size=64), min_size=1, max_size=12))
def test_trim_wheel_drops_exactly_the_prefixed_members_and_their_record_lines(
    tmp_path: Path, members: dict[str, bytes]
) -> None:
    """Law: the members under the prefixes and their RECORD lines go; every other member stays with its bytes,
    mode and time, and the file keeps its mode."""
    prefixes = ("pkg/jars/", "pkg/ui/build/")
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", members)
    wheel.chmod(0o640)
    original = _read(wheel)
    before = wheel.read_bytes()
    dropped = dev.trim_wheel(wheel, prefixes)
    kept = {name: data for name, data in members.items() if not name.startswith(prefixes)}
    assert dropped == len(members) - len(kept)
    if not dropped:
        assert wheel.read_bytes() == before
        return
    after = _read(wheel)
    record = after.pop(RECORD)[0].decode().splitlines()
    assert after == {name: original[name] for name in kept}
    assert wheel.stat().st_mode & 0o777 == 0o640
    assert [line.split(",")[0] for line in record] == [*kept, RECORD]
    assert list(tmp_path.iterdir()) == [wheel]  # no temporary file left beside it


def test_trim_wheel_that_fails_leaves_the_wheel_as_it_was_and_nothing_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", {"pkg/jars/a": b"j", "pkg/b": b"b"})
    before = wheel.read_bytes()

    def fail(*_args: object, **_kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(zipfile.ZipFile, "writestr", fail)
    with pytest.raises(OSError, match="disk full"):
        dev.trim_wheel(wheel, ("pkg/jars/",))
    assert list(tmp_path.iterdir()) == [wheel]
    assert wheel.read_bytes() == before


def test_trim_wheel_refuses_a_zip_without_exactly_one_top_level_record_naming_the_count(tmp_path: Path) -> None:
    path = tmp_path / "not-a-wheel.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/jars/a", b"x")
    with pytest.raises(ValueError, match=r"exactly one top-level \*\.dist-info/RECORD: got 0"):
        dev.trim_wheel(path, ("pkg/jars/",))


def test_wheelhouse_without_a_directory_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        dev.main(["wheelhouse"])
    assert exit_.value.code == 2
    assert "the following arguments are required: dir" in capsys.readouterr().err


def test_the_wheelhouse_holds_each_pinned_version_once_or_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    """Each ``name==version`` maps to its wheels (names compared as pip normalizes them: ``-``, ``_`` and ``.`` alike,
    any case); a missing version, or a second version beside it, is refused naming the distribution and the files."""
    for name in ("rpds_py-2026.9.1-cp312-cp312-manylinux2014_x86_64.whl", "TransferQueue-0.1.11-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    found = dev.wheels_of(["transferqueue==0.1.11", "rpds-py==2026.9.1"], tmp_path)
    assert [w.name.split("-")[0] for w in found] == ["TransferQueue", "rpds_py"]
    with pytest.raises(ValueError, match=r"wheels of ray 2.60.0 only: got versions \[\] \(none\)"):
        dev.wheels_of(["ray==2.60.0"], tmp_path)
    (tmp_path / "rpds_py-2025.1.0-cp312-cp312-manylinux2014_x86_64.whl").write_bytes(b"")
    with pytest.raises(ValueError, match=r"wheels of rpds-py 2026.9.1 only: got versions \['2025.1.0', '2026.9.1'\]"):
        dev.wheels_of(["rpds-py==2026.9.1"], tmp_path)
