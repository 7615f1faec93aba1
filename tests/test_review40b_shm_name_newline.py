"""Review 40b: the sibling of 580f16b (check_key's ``^...$`` + ``match``) is left in kvstore/shm.py:38/106.

``ShmSegment.open`` checks the segment path a daemon's answer names with ``_NAME.match(p.name)`` where
``_NAME = re.compile(r"^pdserve-kv-[0-9a-f]{8,64}$")``: ``$`` matches before a trailing newline, so a name
``pdserve-kv-<hex>\\n`` -- not a pdserve segment name -- passes the check; the client maps that file and unlinks it.
Its docstring: the path "must be a pdserve segment in /dev/shm ... never a file the answer points at".

Correct: the name check is a full match (``fullmatch``, or ``\\Z``): such a path is refused with ValueError before
anything is opened, mapped or unlinked. Real file in /dev/shm, private to this user, of the size named.
"""

from __future__ import annotations

import os

import pytest

from pdserve.kvstore.shm import SHM_DIR, ShmSegment


def test_segment_name_ending_in_newline_is_refused():
    if not SHM_DIR.is_dir():
        pytest.skip(f"no {SHM_DIR}")
    path = SHM_DIR / f"pdserve-kv-{os.urandom(8).hex()}\n"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096)
    finally:
        os.close(fd)
    try:
        with pytest.raises(ValueError, match="not a pdserve segment"):
            seg = ShmSegment.open(str(path), 4096, 1)
            seg.close()
        assert path.exists(), "the client unlinked a file whose name is not a pdserve segment's"
    finally:
        path.unlink(missing_ok=True)
