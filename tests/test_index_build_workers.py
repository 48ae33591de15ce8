"""Index builds survive their workers: a measuring process killed (as by the OOM killer) is
reported and its chunk measured again, once, or the build fails clearly; never a hang. Temporary
files carry host and PID, and a build never removes another live build's file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.length_index import index as length_index
from energon_ordering.length_index.index import LengthIndex, index_path, write_length_index

TESTS = Path(__file__).parent
KILLED = "web-00000100"  # in the second of four chunks of 64


class KillingTaskEncoder(IndexedSyntheticTaskEncoder):
    """Kills the measuring process (SIGKILL, as the OOM killer does) on sample ``key``: once if
    ``marker`` is a path (the first process to create it dies), every time if None."""

    def __init__(self, key: str, marker: str | None):
        super().__init__()
        self.key, self.marker, self.parent = key, marker, os.getpid()

    def encode_sample(self, sample):
        if sample.__key__ == self.key and os.getpid() != self.parent:
            try:
                if self.marker is not None:
                    os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                os.kill(os.getpid(), signal.SIGKILL)
            except FileExistsError:
                pass
        return super().encode_sample(sample)


BUILD = """
import sys, warnings
sys.path.insert(0, {tests!r})
from test_index_build_workers import KillingTaskEncoder
from energon_ordering.length_index.build import build_length_index
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    built = build_length_index({path!r}, task_encoder=KillingTaskEncoder({key!r}, {marker!r}),
                               workers=2, name={name!r})
print("SAMPLES", built[0].summary.samples)
for w in caught:
    print("WARNING", w.message)
"""


def _build(path: Path, marker: str | None, name: str,
           timeout: float = 240) -> subprocess.CompletedProcess:
    """The build in its own process (session), killed by its id if it outlives ``timeout``."""
    code = BUILD.format(tests=str(TESTS), path=str(path), key=KILLED, marker=marker, name=name)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the index build hung: no result after {timeout} s (killed)")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def web(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("build_workers")
    make_synthetic_dataset(root, [SourceSpec("web", 256, "short")], shard_size=64)
    return root / "web"


def test_a_killed_measuring_process_is_reported_and_its_chunk_measured_again(web, tmp_path):
    # Before: Pool.imap waited forever for the chunk of the killed process.
    result = _build(web, str(tmp_path / "killed-once"), "once")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "killed-once").exists()  # a process was killed
    assert "SAMPLES 256" in result.stdout
    assert "WARNING length index: a measuring process died (killed by a signal" in result.stdout
    index = LengthIndex.open(web, "once")
    assert index.samples == 256 and index.length(KILLED) > 0
    reference = write_length_index(  # the same lengths, measured in this process
        web, ((f"web-{i:08d}", index.length(f"web-{i:08d}")) for i in range(256)),
        computed_by=index.computed_by, name="reference")
    assert LengthIndex.open(web, "reference").digest == index.digest
    assert reference.samples == 256


def test_a_chunk_lost_twice_fails_the_build_clearly(web):
    result = _build(web, None, "always")
    assert result.returncode != 0
    found = re.search(
        r"LengthIndexError: length index: a measuring process died again while measuring "
        r"samples 'web-(\d+)' \.\. 'web-(\d+)' \(\d+ samples in \d+ chunks\), which a process "
        r"was measuring when one died before .* nothing was written\. Build with fewer "
        r"processes \(--workers\)", result.stderr)
    assert found, result.stderr[-3000:]
    assert int(found[1]) <= int(KILLED[4:]) <= int(found[2])
    assert not index_path(web, "always").exists()
    assert not list(web.glob(".nv-meta/*.tmp-*"))


# -- temporary files ---------------------------------------------------------------------------

OTHER_BUILD = """
import sys, time
from pathlib import Path
from energon_ordering.length_index.index import write_length_index

def lengths():
    yield "web-00000000", 1.0
    while not Path({go!r}).exists():
        time.sleep(0.05)
    yield "web-00000001", 2.0

write_length_index({path!r}, lengths(), computed_by="the other build", name="shared")
"""


def test_a_build_never_removes_another_live_builds_temporary_file(web, tmp_path, monkeypatch):
    # Another build of the same index, from a host or PID namespace where this one's PIDs mean
    # nothing: its PID looks dead from here (as it does across machines or PID namespaces).
    # Before: this build deleted the other's temporary file, and the other build died.
    go = tmp_path / "go"
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_BUILD.format(go=str(go), path=str(web))],
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(web.glob(".nv-meta/*.shared.sqlite.tmp-*")):
            assert other.poll() is None and time.monotonic() < deadline, other.stderr.read()
            time.sleep(0.05)
        [tmp] = [p for p in web.glob(".nv-meta/*.shared.sqlite.tmp-*")
                 if not p.name.endswith("-journal")]  # sqlite's rollback journal of it
        monkeypatch.setattr(length_index, "process_alive", lambda pid: False)
        write_length_index(web, [("web-00000000", 5.0)], computed_by="this build", name="shared")
        assert tmp.exists()
        assert tmp.name.endswith(f".tmp-{length_index._host()}-{other.pid}")
    finally:
        go.touch()
        _, err = other.communicate(timeout=120)
    assert other.returncode == 0, err[-3000:]
    assert LengthIndex.open(web, "shared").computed_by == "the other build"  # it finished last


def test_stale_temporary_files_are_removed_only_when_certainly_dead(web, monkeypatch):
    folder = web / ".nv-meta"
    host = length_index._host()  # socket.gethostname(), as a file name
    dead = folder / f"energon_ordering_lengths.stale.sqlite.tmp-{host}-999999"
    elsewhere = folder / "energon_ordering_lengths.stale.sqlite.tmp-another-host-999999"
    for f in (dead, elsewhere):
        f.write_bytes(b"")
    monkeypatch.setattr(length_index, "process_alive", lambda pid: False)
    write_length_index(web, [("web-00000000", 1.0)], computed_by="test", name="stale")
    assert not dead.exists()  # this host, PID gone, not locked: a killed build's leftover
    assert elsewhere.exists()  # another host's: its PID means nothing here
    elsewhere.unlink()
