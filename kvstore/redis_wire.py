"""RESP framing for the Redis tier's lean pipeline: what ``RedisTier`` sends on one pooled connection.

Who calls it: ``redis_tier.RedisTier`` only -- ``packed`` for any command list (GETRANGE, SET of a joined blob),
``set_frames`` for the SETs of a put of uncompressed objects. Both return a list of buffers for redis-py's
``Connection.send_packed_command``, which sends each one as it is.

``set_frames`` writes each SET's RESP itself rather than through ``hiredis.pack_command``: a bulk string is its
length and its bytes, so the value -- header + payload -- need never be one buffer. The payload leaves from the
tensor's own memory (a buffer of its own in the list); only the small pieces (the command, the key, the header,
small payloads) are copied, into joined runs. hiredis would copy every payload twice (joined blob, packed command):
~20 us of a 64 KiB object's ~45 us of client work. Redis can keep a large value (>= 32 KiB) in the buffer it read
it into, so one SET of the whole value costs it less than SET header + APPEND payload (which grows and copies it).
The key is ``check_key``'s (``[A-Za-z0-9_.:-]``) under the tier's prefix; lengths are byte counts, so nothing in a
key or a value can end a frame early.

    SET:  *3\\r\\n $3\\r\\n SET\\r\\n $<len key>\\r\\n <key>\\r\\n $<len value>\\r\\n <header> <payload> \\r\\n
          (with a TTL: *5 ... <payload>\\r\\n $2\\r\\n EX\\r\\n $<len ttl>\\r\\n <ttl>\\r\\n)
"""

from __future__ import annotations

import hiredis

PACK_JOIN = 64 << 10        # small pieces are joined into sends of up to this many bytes
SEND_APART = 16 << 10       # a payload from this size is its own buffer (sent from its memory), smaller ones joined


def packed(commands: list[tuple]) -> list[bytes]:
    """The commands in RESP (hiredis packs each), runs of small ones joined into one buffer up to PACK_JOIN bytes
    (fewer sends); a larger one is sent as it is, not copied again."""
    out, run, size = [], [], 0
    for command in commands:
        item = hiredis.pack_command(command)
        if size + len(item) > PACK_JOIN and run:
            out.append(b"".join(run))
            run, size = [], 0
        run.append(item)
        size += len(item)
    if run:
        out.append(b"".join(run))
    return out


def set_frames(sets: list[tuple[bytes, bytes, memoryview]], ttl_s: int | None) -> list[bytes | memoryview]:
    """RESP of ``SET key header+payload [EX ttl_s]`` per (key, header, payload) -- a payload being a flat byte
    buffer (``codec.encode_parts``) -- as a list of buffers: payloads of SEND_APART bytes or more as they are."""
    tail = b"\r\n" if ttl_s is None else b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_s)), ttl_s)
    argc = 3 if ttl_s is None else 5
    out, run, size = [], [], 0
    for key, header, payload in sets:
        nbytes = len(payload)
        run.append(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b" % (argc, len(key), key, len(header) + nbytes, header))
        if nbytes >= SEND_APART:
            out += (b"".join(run), payload)
            run, size = [tail], len(tail)
            continue
        run += (payload, tail)
        size += len(run[-3]) + nbytes + len(tail)
        if size >= PACK_JOIN:
            out.append(b"".join(run))
            run, size = [], 0
    if run:
        out.append(b"".join(run))
    return out
