"""The one zmq context of a process, shared by every socket pdserve opens (store client and daemon, the
engine core's client), and ``send_frames``, the store's multipart send.

Why not a context per object: an object that owns a context and a socket and is dropped without
``close()`` inside a reference cycle hangs the process when the garbage collector reaches it. The
collector clears the context's weak list of sockets before it runs finalizers, so the context's
finalizer sees no socket to close, and ``term()`` waits forever for the socket that is still open. The
test suite hung this way. The shared context is never collected: an object that is dropped only leaves a
socket, and the socket's finalizer closes it. Owners close their own sockets (``linger=0``) and never
terminate the context.
"""

from __future__ import annotations

import zmq


def shared_context() -> zmq.Context:
    return zmq.Context.instance()


_MORE = int(zmq.SNDMORE)


def send_frames(sock: zmq.Socket, frames: list) -> None:
    """``sock.send_multipart(frames, copy=False)`` without its per-frame costs that buy nothing here: a type check of
    every part and ``SNDMORE | flags`` on a Python enum (~1 us a frame; a Get reply of 64 KiB objects has 1024)."""
    last = len(frames) - 1
    send = sock.send
    for i, frame in enumerate(frames):
        send(frame, _MORE if i < last else 0, copy=False)
